"""--sequence-parallel on the 1-D layout (parallel/layouts/seqpar.py): equal
to serial in float64 with dropout, measured traffic and memory equal to the
cost model (in tests/test_combo_matrix.py's cases), the same
bytes as plain 1-D but for the once-per-step LayerNorm/wpe gradient sums,
1/tp of the canonical-region activations, and bad input refused in one line."""

from __future__ import annotations

import json

import pytest
from conftest import TINY

from mpicube.analysis.costmemory import kept_and_rerun_terms
from mpicube.analysis.costmodel import Problem, step_traffic
from mpicube.core.config import ModelConfig
from mpicube.core.errors import ConfigError
from mpicube.parallel.grid import plan
from mpicube.parallel.gridspec import GridSpec


# Equality with serial (float64 1e-10 with dropout; 16 bits at parallel_check's
# bound) with traffic and saved activations equal to the cost model, with dp,
# every zero, --recompute, --grad-accum and both 16-bit formats, runs in
# tests/test_combo_matrix.py.


def test_same_bytes_and_a_tp_th_of_the_canonical_activations():
    """Each all-reduce is an all-gather plus a reduce-scatter: the bytes
    differ from plain 1-D by the gradient sums of ln_* and wpe over tp
    alone; LayerNorm outputs, masks and statistics shrink by tp."""
    cfg = ModelConfig(vocab_size=61, n_ctx=64, n_layer=3, n_head=4, n_embd=32)
    plain, seq = (Problem(cfg, "1d", 4, 1, 1, 8, 64, "float64", sequence_parallel=s) for s in (False, True))
    sums = (cfg.n_ctx + 2 * 2 * cfg.n_layer + 2) * cfg.n_embd         # wpe, ln_1, ln_2 of every block, ln_f
    assert step_traffic(seq).total_bytes() - step_traffic(plain).total_bytes() == 8 * sums * 2 * 3 // 4
    assert step_traffic(seq).msgs["tp"] == step_traffic(plain).msgs["tp"] + 2 * 3
    n, h = 8 * 64, 32
    kept = [sum(kept_and_rerun_terms(p, dropout=True)[0].values()) for p in (plain, seq)]
    canonical = (3 * (2 + 2) + 1 + 1) * n * h + (2 * 3 + 1) * n     # LN xhat, resid masks, ln_f, emb mask; rstd
    assert kept[0] - kept[1] == canonical * 3 // 4


def test_bad_input_names_the_nearest_valid_values():
    cfg = ModelConfig(vocab_size=61, n_ctx=10, n_layer=1, n_head=4, n_embd=16)
    with pytest.raises(ConfigError, match="applies to the 1d layout only"):
        plan(GridSpec("2d", sequence_parallel=True), cfg, 8, 4)
    with pytest.raises(ConfigError, match=r"sequence length \(--seq-len\) of 8 or 12"):
        plan(GridSpec("1d", sequence_parallel=True), cfg, 8, 4)
    with pytest.raises(ConfigError, match=r"--sequence-parallel with --cp 2 splits the 6 positions of a context-"
                                          r"parallel rank over the 4 tensor-parallel ranks: use a sequence length "
                                          r"\(--seq-len\) of 8 or 16"):
        plan(GridSpec("1d", cp=2, sequence_parallel=True), ModelConfig(vocab_size=61, n_ctx=12, n_layer=1,
                                                                       n_head=4, n_embd=16), 8, 8)


def test_cli_trace_train_eval_bench_info_and_refusal(mpicube, tiny_shard):
    """trace --sequence-parallel (1-D on 2 ranks, dropout, float64) agrees
    with a serial trace tensor by tensor, masks included; a checkpoint
    trained with it evaluates to the same loss with and without it; bench
    measures the cost model's traffic and activations exactly; info names
    it; on the serial layout it is one line and exit 2."""
    args = [*TINY[2:], "--dtype", "float64", "--dropout", "0.1", "--steps", "2", "--data", str(tiny_shard)]
    for name, n, extra in (("sp.h5", 2, ["--layout", "1d", "--sequence-parallel"]),
                           ("serial.h5", 1, ["--layout", "serial"])):
        r = mpicube.run("trace", *args, *extra, "--out", name, n=n)
        assert r.returncode == 0, r
    r = mpicube.run("compare", "sp.h5", "serial.h5")
    assert r.returncode == 0 and "all tensors agree" in r.stdout, r
    r = mpicube.run("train", *args, "--layout", "1d", "--sequence-parallel", "--out", "run", n=2)
    assert r.returncode == 0, r
    losses = []
    for n, extra in ((2, ["--layout", "1d", "--sequence-parallel"]), (1, [])):
        r = mpicube.run("eval", "run", "--batches", "2", "--dtype", "float64", *extra, n=n)
        assert r.returncode == 0, r
        losses.append(json.loads(r.stdout.splitlines()[-1])["loss"])
    assert abs(losses[0] - losses[1]) <= 1e-10 * abs(losses[1])
    r = mpicube.run("eval", "run", "--seq-len", "15", "--layout", "1d", "--sequence-parallel", n=2)
    assert r.returncode == 2 and r.error_lines() == [
        "error: --sequence-parallel: --seq-len 15 must be divisible by the tensor-parallel size 2: "
        "use --seq-len 14 or 16"], r
    r = mpicube.run("bench", *TINY[2:], "--layout", "1d", "--sequence-parallel", "--steps", "1", "--warmup-steps",
                    "0", "--json", n=2)
    assert r.returncode == 0, r
    result = json.loads(r.stdout.splitlines()[-1])["results"][0]
    assert result["sequence_parallel"] and result["comm"]["exact"], result
    assert result["memory"]["activations"] == result["memory"]["measured_activations"], result
    r = mpicube.run("info", "--layout", "1d", "-n", "2", "--sequence-parallel", "--n-layer", "1", "--n-head", "2",
                    "--n-embd", "16", "--seq-len", "16")
    assert r.returncode == 0 and "sequence parallel" in r.stdout, r
    r = mpicube.run("train", *args, "--layout", "serial", "--sequence-parallel", "--out", "bad", n=1)
    assert r.returncode == 2 and r.error_lines() == [
        "error: --sequence-parallel applies to the 1d layout only (layout serial): use --layout 1d, "
        "or drop --sequence-parallel"], r
