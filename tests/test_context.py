"""Context parallelism (--cp, mpicube.parallel.context): chunks and ring
schedule (pure), ring attention on a real ring against serial, and whole
training steps on every kind of layout with dp, --zero 1, --recompute,
--grad-accum and 16 bits equal to serial (tests/parallel_check.py: loss,
logits, gradients, parameters after 3 AdamW steps, float64 1e-10 with
dropout 0.1; measured traffic and memory == the cost model); the command
line (train, eval, checkpoints, bad input)."""

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import TINY

from mpirun import mpiexec

from mpicube.analysis.costmodel import Problem, step_traffic
from mpicube.core.config import ModelConfig
from mpicube.core.errors import ConfigError
from mpicube.ops import attention_blocks as ab
from mpicube.parallel import context
from mpicube.parallel.gridspec import GridSpec


def test_chunks_cover_the_sequence_and_balance_the_work():
    """Ranks' positions partition 0..T-1 (chunk r and its mirror 2C-1-r);
    over the ring every block at or below the diagonal is computed exactly
    once, and every rank computes the same number of blocks."""
    T, C, block = 48, 3, 4                                   # chunks of 8: two blocks each
    c = T // (2 * C)
    assert sorted(np.concatenate([context.local_positions(T, C, r) for r in range(C)])) == list(range(T))
    assert list(context.local_positions(T, C, 0)[c - 1:c + 1]) == [c - 1, (2 * C - 1) * c]
    seen, per_rank = [], []
    for r in range(C):
        mine, count = context.chunks(C, r), 0
        for s in range(C):
            for _, _, q0, k0 in context._pairs(mine, context.chunks(C, (r - s) % C), c, block):
                seen.append((q0, k0))
                count += 1
        per_rank.append(count)
    want = [(i, j) for i in range(0, T, block) for j in range(0, i + 1, block)]
    assert sorted(seen) == want and len(want) == ab.computed_pairs(T, block)
    assert len(set(per_rank)) == 1, per_rank
    for T, C, block in ((48, 3, 4), (60, 3, 4), (40, 1, 16), (7, 1, 3)):      # the closed forms of the cost model
        c = T // (2 * C)
        pairs = [(rows, cols) for rk in range(C) for s in range(C)
                 for rows, cols, _, _ in context._pairs(context.chunks(C, rk), context.chunks(C, (rk - s) % C), c,
                                                        block)]
        if C > 1:
            assert context.ring_scores(T, C, block) == sum((a.stop - a.start) * (b.stop - b.start) for a, b in pairs)
        assert ab.computed_scores(T, block) == sum(min(block, T - i) * min(block, T - j)
                                                   for i in range(0, T, block) for j in range(0, i + 1, block))


def test_bad_sizes_name_valid_ones():
    with pytest.raises(ConfigError, match=r"--seq-len 10 must be divisible by 2 x --cp 2 = 4 .* use --seq-len 8 or "
                                          r"12, or --cp one of \[1, 5\]"):
        context.validate(10, 2)
    with pytest.raises(ConfigError, match=r"--cp 3 must divide the world size 4; choose one of \[1, 2, 4\]"):
        GridSpec(cp=3).tp(4)


def test_ring_traffic_model():
    """Per layer: K/V shifted C-1 times forward, C-1 + C (dK/dV) backward;
    --recompute blocks shifts forward's again; the weight gradients summed over cp."""
    cfg = ModelConfig(vocab_size=61, n_ctx=16, n_layer=2, n_head=4, n_embd=16)
    p = Problem(cfg, "serial", 1, 1, 1, 4, 16, "float64", cp=4)
    t = step_traffic(p)
    kv = 2 * 4 * (16 // 4) * 16
    params = sum(int(np.prod(d.shape)) for d in __import__("mpicube.model.gpt", fromlist=["x"]).gpt_params(cfg))
    assert t.msgs["cp"] == 2 * (3 + 3 + 4) + 2 * 3
    assert t.elems["cp"] == 2 * (3 + 3 + 4) * kv + 2 * params * 3 / 4
    blocks = step_traffic(Problem(cfg, "serial", 1, 1, 1, 4, 16, "float64", cp=4, recompute="blocks"))
    assert blocks.msgs["cp"] == t.msgs["cp"] + 2 * 3


@pytest.mark.timeout(200)
def test_ring_attention_equals_serial():
    proc = mpiexec(4, ["-m", "mpi4py", "tests/context_check.py"], timeout=150)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "OK ring attention cp=4 T=64 block=4" in proc.stdout
    assert "OK ulysses 4 x ring 1 T=64 block=4" in proc.stdout      # Ulysses over the 4 ranks
    assert "OK ulysses 2 x ring 2 T=64 block=4" in proc.stdout      # the hybrid: groups of 2, a ring of 2


def test_ulysses_positions_traffic_and_bad_sizes():
    """--cp-kind ulysses/hybrid: the ranks' runs cover the sequence, a
    hybrid group's runs are the ring rank's two chunks in order; the
    all-to-all traffic of the cost model; sizes that do not fit the heads,
    cp or the sequence refused in one line naming the values that work."""
    from mpicube.analysis.costcp import ring_traffic, ulysses_traffic
    from mpicube.parallel.planning import resolve

    T = 32
    for C, U in ((4, 4), (8, 2), (4, 1)):
        runs = [context.local_positions(T, C, r, U) for r in range(C)]
        assert sorted(np.concatenate(runs)) == list(range(T))
        for g in range(C // U):
            group = np.concatenate(runs[g * U:(g + 1) * U])
            assert list(group) == list(context.local_positions(T, C // U, g))
    cfg = ModelConfig(vocab_size=61, n_ctx=16, n_layer=2, n_head=4, n_embd=16)
    p = Problem(cfg, "serial", 1, 1, 1, 4, 16, "float64", cp=4, ulysses=4)
    slab = 4 * (16 // 4) * (4 // 4) * 4                                  # seqs x T/cp x heads/U x hd
    t = ulysses_traffic(p)
    assert t.elems["ulysses"] == 2 * 2 * 3 * (3 + 1) * slab   # layers x (fwd, bwd) x peers x (qkv + y) and t.msgs["ulysses"] == 2 * 4 * 3
    assert not ring_traffic(p).msgs
    hybrid = Problem(cfg, "serial", 1, 1, 1, 4, 16, "float64", cp=4, ulysses=2)
    assert ring_traffic(hybrid).msgs["cp"] == 2 * (2 * 1 + 2)            # a ring of 2 groups
    bad = [(GridSpec(cp=4, cp_kind="ulysses"), ModelConfig(vocab_size=61, n_ctx=16, n_layer=1, n_head=6, n_embd=24),
            r"^--cp 4 \(the Ulysses size, --cp-kind ulysses\) must divide the 6 attention heads .*use --cp one of \[1, 2\]$"),
           (GridSpec(cp=4, cp_kind="hybrid", ulysses=3), cfg, r"^--ulysses 3 must divide --cp 4: use --ulysses one of"),
           (GridSpec(cp=2, ulysses=2), cfg, r"^--ulysses 2 applies to --cp-kind hybrid only"),
           (GridSpec(cp=8, cp_kind="ulysses"), ModelConfig(vocab_size=61, n_ctx=12, n_layer=1, n_head=8, n_embd=16,
                                                           arch="llama", n_kv_head=8, ffn_hidden=8),
            r"^--seq-len 12 must be divisible by 8"),
           (GridSpec(layout="1d", cp=4, cp_kind="ulysses"),
            ModelConfig(vocab_size=61, n_ctx=16, n_layer=1, n_head=8, n_embd=16, arch="llama", n_kv_head=2,
                        ffn_hidden=8),
            r"whole kv groups of the 2 kv heads: use --cp one of \[1, 2\]$")]
    for plan, model, message in bad:
        world = plan.cp * (4 if plan.layout == "1d" else 1)
        with pytest.raises(ConfigError, match=message):
            resolve(plan, model, 8, world)


# (ranks, layout, dp, depth, environment): cp 2 with every layout, dp, zero,
# recompute mode, accumulation and dtype runs in tests/test_combo_matrix.py;
# here a ring of 4 with --recompute blocks, and the device path.
CASES = [
    (4, "serial", 1, 1, {"MPICUBE_CHECK_CP": "4", "MPICUBE_CHECK_RECOMPUTE": "blocks"}),
    (2, "serial", 1, 1, {"MPICUBE_CHECK_CP": "2", "MPICUBE_CHECK_DEVICE": "gpu",         # the CuPy stand-in: the
                         "PYTHONPATH": str(Path(__file__).resolve().parent / "fake_gpu")}),   # ring through staging
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("ranks,layout,dp,depth,env", CASES,
                         ids=[f"{c[1]}-n{c[0]}-" + "-".join(f"{k[14:].lower()}{v}" for k, v in c[4].items()
                                                              if k.startswith("MPICUBE_CHECK_")) for c in CASES])
def test_cp_matches_serial(ranks, layout, dp, depth, env):
    proc = mpiexec(ranks, ["-m", "mpi4py", "tests/parallel_check.py", layout, dp, depth, 0.1], timeout=240, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"OK {layout} world={ranks} dp={dp} depth={depth}" in proc.stdout
    assert f"cp={env['MPICUBE_CHECK_CP']} loss=" in proc.stdout


def test_trace_train_eval_and_bad_input(mpicube, tiny_shard):
    """trace --cp 2 (1-D on 4 ranks, --recompute blocks, dropout, float64)
    agrees with a serial trace tensor by tensor (full logical tensors,
    dropout masks included); train --cp 2 saves a checkpoint that
    evaluates to the same loss with --cp 2 (ring and Ulysses) and without;
    a cp that does not divide the world is one line and exit 2."""
    args = [*TINY[2:], "--dtype", "float64", "--dropout", "0.1", "--steps", "2", "--data", str(tiny_shard)]
    for name, n, extra in (("cp.h5", 4, ["--cp", "2", "--layout", "1d", "--recompute", "blocks"]),
                           ("serial.h5", 1, ["--layout", "serial"])):
        r = mpicube.run("trace", *args, *extra, "--out", name, n=n)
        assert r.returncode == 0, r
    r = mpicube.run("compare", "cp.h5", "serial.h5")
    assert r.returncode == 0 and "all tensors agree" in r.stdout, r
    r = mpicube.run("train", *args, "--layout", "serial", "--cp", "2", "--out", "run", n=2)
    assert r.returncode == 0, r
    losses = []
    for n, extra in ((2, ["--cp", "2"]), (2, ["--cp", "2", "--cp-kind", "ulysses"]), (1, [])):
        r = mpicube.run("eval", "run", "--batches", "2", "--dtype", "float64", *extra, n=n)
        assert r.returncode == 0, r
        losses.append(json.loads(r.stdout.splitlines()[-1])["loss"])
    assert all(abs(loss - losses[-1]) <= 1e-10 * abs(losses[-1]) for loss in losses[:-1]), losses
    r = mpicube.run("train", *args, "--cp", "2", "--out", "bad", n=1)
    assert r.returncode == 2 and r.error_lines() == ["error: --cp 2 must divide the world size 1; choose one of [1]"]


def test_info_table_and_the_pictures_follow_the_code():
    """info's cp table: activations per rank fall with cp (1/8 at cp 8 on
    the 4-layer, n_embd 144 model at T 8192); docs/context-parallelism.md
    shows what tools/cp_pictures.py draws from the code now."""
    import subprocess
    import sys

    from mpicube.analysis.costcontext import context_table
    from mpicube.analysis.costmemory import step_memory_bytes

    cfg = ModelConfig(vocab_size=256, n_ctx=8192, n_layer=4, n_head=12, n_embd=144)
    one, eight = (step_memory_bytes(Problem(cfg, "serial", 1, 1, 1, 1, 8192, "float32", cp=c)) for c in (1, 8))
    assert eight.activations * 8 == one.activations
    table = context_table(ModelConfig(vocab_size=256, n_ctx=64, n_layer=2, n_head=4, n_embd=16), 4, 4)
    assert len([line for line in table.splitlines() if line.split()[:1] in (["1d"], ["2d"], ["3d"], ["2.5d"])]) == 16
    root = Path(__file__).resolve().parents[1]
    for tool, page in (("tools/cp_pictures.py", "docs/context-parallelism.md"),
                       ("tools/ulysses_pictures.py", "docs/ulysses.md")):
        proc = subprocess.run([sys.executable, tool, "--check", page], cwd=root, capture_output=True, text=True,
                              timeout=60)
        assert proc.returncode == 0, proc.stdout + proc.stderr
