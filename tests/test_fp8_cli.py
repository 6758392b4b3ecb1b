"""--fp8 on the command line: bad input is one line and exit 2 with no run
directory left (all in one process through the real entry point,
tests/cli_cases.py), and NaN reaching a quantizer stops the run as a
diverged loss does (exit 3, one line naming the tensor and the step,
nothing saved from that step). The numbers themselves are checked
against serial in tests/combo_matrix_check.py's FP8 cases and against
hand-made known answers in tests/test_fp8_quant.py."""

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import REPO, TINY, paired
from mpirun import job_env

from mpicube.files import checkpoint

PYTHON = sys.executable


def refusal_cases(tmp_path):
    """(name, argv, expected error line)."""
    train = ["train", "--layout", "serial", "--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--seq-len", "32",
             "--batch-size", "4", "--steps", "1", "--out", tmp_path / "run"]
    return [
        ("unknown recipe", train + ["--fp8", "fp4"], r"Invalid value for '--fp8': 'fp4' is not one of 'tensorwise'"),
        ("float16 master", train + ["--fp8", "tensorwise", "--dtype", "float16"],
         r"--fp8 tensorwise needs --dtype float32 or float64, not float16"),
        ("bfloat16 master", train + ["--fp8", "mxfp8", "--dtype", "bfloat16"], r"needs --dtype float32 or float64"),
        ("accumulate", train + ["--fp8", "rowwise", "--fp8-accumulate", "float64"],
         r"--fp8-accumulate float64 needs --dtype float64"),
        ("block no shard fits", train + ["--fp8", "mxfp8"],
         r"--fp8 mxfp8: --n-embd is 16, not a multiple of the 32-element block .*--fp8-block 16"),
        ("blockwise tiles", train + ["--fp8", "blockwise"],
         r"--fp8 blockwise: --n-embd is 16, not a multiple of the 128-element tile"),
        ("positions", train[:-4] + ["--steps", "1", "--out", tmp_path / "run", "--seq-len", "24", "--fp8", "mxfp8",
                                    "--fp8-block", "16"],
         r"a rank's consecutive positions of a sequence \(--seq-len\) is 24, not a multiple of the 16"),
        ("2-D shard widths", ["info", "--layout", "2d", "-n", "4", "--n-layer", "1", "--n-head", "2", "--n-embd",
                              "16", "--seq-len", "16", "--batch-size", "8", "--fp8", "blockwise", "--fp8-block", "16"],
         r"--fp8 blockwise: a rank's query columns \(n_head / 2 x head_dim\) is 8, not a multiple of the "
         r"16-element tile .*--fp8-block 8"),
        ("MLA latent widths", ["info", "--arch", "deepseek_v3", "--layout", "2d", "-n", "4", "--n-layer", "1",
                               "--n-head", "4", "--n-embd", "32", "--kv-lora-rank", "12", "--q-lora-rank", "8",
                               "--qk-nope-head-dim", "4", "--qk-rope-head-dim", "4", "--v-head-dim", "4",
                               "--ffn-hidden", "32", "--seq-len", "16", "--batch-size", "8", "--fp8", "blockwise",
                               "--fp8-block", "4"],
         r"--fp8 blockwise: a rank's latent columns \(--kv-lora-rank / 2\) is 6, not a multiple of the 4-element "
         r"tile .*--fp8-block 2"),
        ("expert tiles", ["info", "--layout", "1d", "-n", "8", "--dp", "4", "--ep", "2", "--arch", "mixtral",
                          "--n-experts", "4", "--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--ffn-hidden",
                          "16", "--seq-len", "16", "--batch-size", "8", "--fp8", "blockwise", "--fp8-block", "4"],
         r"--fp8 blockwise with a mixture of experts on --dp 4 --cp 1 --ep 2: an expert's token rows are spread "
         r"over ranks .*use layout 1d with --ep equal to --dp and --cp 1"),
        ("block option", train + ["--fp8", "tensorwise", "--fp8-block", "16"], r"--fp8-block applies to blockwise"),
        ("pow2 option", train + ["--fp8", "mxfp8", "--fp8-pow2", "--fp8-block", "16"], r"--fp8-pow2 applies to rowwise"),
        ("history", train + ["--fp8", "delayed", "--fp8-amax-history", "0"], r"--fp8-amax-history must be at least 1"),
        ("bench float16", ["bench", "--layout", "serial", "--n-layer", "1", "--n-head", "2", "--n-embd", "16",
                           "--fp8", "tensorwise", "--dtype", "float16"], r"needs --dtype float32 or float64"),
    ]


# --fp8 delayed's amax histories in the checkpoint: 4 steps straight, and 2 then --resume for 2 more
DELAYED = ["train", "--layout", "serial", "--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--seq-len", "16",
           "--batch-size", "4", "--steps", "4", "--fp8", "delayed", "--fp8-amax-history", "4", "--log-every", "1"]
RESUME_RUNS = [DELAYED + ["--out", "whole"], DELAYED + ["--out", "split", "--stop-after", "2"],
               DELAYED + ["--out", "split", "--resume"]]


def test_fp8_refusals_are_one_line_each(tmp_path, corpus_cache):
    """The refusals, and in the same process (the session's start-up paid
    once) a delayed run stopped after 2 steps and resumed: its losses are
    the uninterrupted run's bit for bit, which needs the amax histories
    from the checkpoint (restarted empty, step 3's scales differ)."""
    cases = refusal_cases(tmp_path)
    spec = tmp_path / "cases.json"
    spec.write_text(json.dumps([[str(a) for a in argv] for _, argv, _ in cases] + RESUME_RUNS))
    proc = subprocess.run([PYTHON, str(Path(__file__).with_name("cli_cases.py")), str(spec)], cwd=tmp_path,
                          env=job_env({"MPICUBE_CACHE": str(corpus_cache)}), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [r["status"] for r in results[len(cases):]] == [0, 0, 0], results[len(cases):]
    assert any("resuming from" in line for line in results[-1]["out"]), results[-1]
    with checkpoint.open_checkpoint(tmp_path / "split") as ck:
        assert dict(ck.attrs["fp8"])["step"] == 4                   # the histories of the last step saved
    losses = {run: [json.loads(line)["loss"] for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()
                    if '"loss"' in line] for run in ("whole", "split")}
    assert len(losses["whole"]) == 4 and losses["split"] == losses["whole"], losses
    for (name, _, expect), res in paired(cases, results[:len(cases)]):
        lines = res["out"] + res["err"]
        errors = [line for line in lines if line.startswith("error:")]
        assert res["status"] == 2 and len(errors) == 1, (name, res)
        assert re.search(expect, errors[0]), (name, errors[0])
        assert not any("Traceback" in line for line in lines), (name, res)
    assert not (tmp_path / "run").exists()               # every refusal came before the run directory


def test_nan_reaching_a_quantizer_stops_the_run(mpicube, tmp_path):
    """An absurd learning rate: the step after the first update carries
    NaN into a linear; its quantizer names the linear, the operand and
    the step, and the run stops with the divergence status, keeping the
    last good checkpoint only."""
    r = mpicube.run("train", *TINY, "--steps", "10", "--lr", "1e30", "--warmup", "0", "--ckpt-every", "1",
                    "--fp8", "tensorwise", "--out", "run")
    assert r.returncode == 3, r
    assert "Traceback" not in r.stdout + r.stderr
    [line] = r.error_lines()
    m = re.search(r"--fp8 tensorwise: (NaN|inf) reached the FP8 quantizer of h\.\d+\.\S+ (input x|weight|output "
                  r"gradient dy) \((forward|dgrad|wgrad) GEMM\) at step (\d+); stopped without saving", line)
    assert m, line
    bad = int(m.group(4))
    assert latest_step(tmp_path / "run") == bad - 1
    assert not (tmp_path / "run" / "ckpt" / f"step_{bad:08d}").exists()


def latest_step(run_dir):
    path = checkpoint.latest(run_dir)
    return None if path is None else int(path.name.split("_")[1])


def test_plans_fp8_cannot_run_are_refused_before_any_collective():
    """planning.resolve (pure) refuses what no shard could quantize as the
    serial model does: kv heads replicated over ranks (their dy is a
    partial sum on each), an expert's token tiles spread over replicas, a
    3-D weight shard's rows (a q^2-th of the hidden size) not whole tiles,
    DeepSeek-V3's latent and head widths on 2-D and 3-D; rowwise on 3-D
    is planned."""
    import pytest

    from mpicube.core.config import ModelConfig
    from mpicube.core.errors import ConfigError
    from mpicube.parallel.gridspec import Plan
    from mpicube.parallel.planning import resolve
    from mpicube.training.fp8_options import fp8_recipe

    llama = dict(vocab_size=61, n_ctx=16, n_layer=2, n_head=8, n_embd=16, arch="llama", ffn_hidden=24, n_kv_head=2)
    deepseek = dict(vocab_size=61, n_ctx=16, n_layer=1, n_head=4, n_embd=32, arch="deepseek_v3", ffn_hidden=32,
                    q_lora_rank=8, kv_lora_rank=16, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4)
    cases = [
        (Plan("1d", fp8=fp8_recipe("tensorwise", "float64")), ModelConfig(**llama), 4, "splits the heads 4 ways"),
        (Plan("1d", dp=2, fp8=fp8_recipe("mxfp8", "float64", block=2)), ModelConfig(**llama, n_experts=4, top_k=2),
         4, "expert's token rows are spread over ranks"),
        (Plan("3d", fp8=fp8_recipe("mxfp8", "float64", block=8)), ModelConfig(vocab_size=61, n_ctx=16, n_layer=2,
                                                                              n_head=4, n_embd=16), 8,
         r"a rank's weight rows \(--n-embd / 4\) is 4, not a multiple of the 8-element block.*--fp8-block 4"),
        (Plan("2d", fp8=fp8_recipe("blockwise", "float64", block=4)), ModelConfig(**llama, n_experts=4, top_k=2),
         4, "the token blocks of layout 2d"),
        (Plan("3d", fp8=fp8_recipe("mxfp8", "float64", block=4)), ModelConfig(**deepseek), 8,    # MLA's widths
         r"a rank's weight rows \(--q-lora-rank / 4\) is 2, not a multiple of the 4-element block.*--fp8-block 2"),
        (Plan("2d", fp8=fp8_recipe("blockwise", "float64", block=4)), ModelConfig(**{**deepseek, "v_head_dim": 3}), 4,
         r"a rank's kv_up columns \(n_head / 2 x \(qk_nope \+ v_head_dim\)\) is 14, not.*--fp8-block 2"),
    ]
    for plan, cfg, world, needle in cases:
        with pytest.raises(ConfigError, match=needle):
            resolve(plan, cfg, 8, world)
    resolve(Plan("1d", fp8=fp8_recipe("tensorwise", "float64")), ModelConfig(**llama), 8, 2)   # 2 ways: whole kv heads
    resolve(Plan("3d", fp8=fp8_recipe("rowwise", "float64")), ModelConfig(vocab_size=61, n_ctx=16, n_layer=2,
                                                                          n_head=4, n_embd=16), 8, 8)   # rowwise: 3-D


def test_trace_records_the_quantized_weights_and_scales_alike_on_serial_and_1d(mpicube, tmp_path):
    """trace --fp8 keeps each linear's quantized x, W and dy (their FP8
    bytes, as uint8, compared exactly) with their scales, assembled to
    the logical tensors; a tensor scale's once, oriented as its first
    GEMM quantizes it (x and W^T forward, dy dgrad); serial and 1-D write
    the same ones. (Every recipe on every layout: step 1 of
    tests/combo_matrix_check.py's FP8 cases, bit for bit.)"""
    import h5py

    opts = ["--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--seq-len", "16", "--batch-size", "4",
            "--steps", "2", "--dtype", "float64", "--fp8", "tensorwise"]
    for layout, n in (("serial", 1), ("1d", 2)):
        r = mpicube.run("trace", *opts, "--layout", layout, "--out", f"{layout}.h5", n=n)
        assert r.returncode == 0, r
    with h5py.File(tmp_path / "serial.h5") as f:
        got = f["step_1/fp8/h.0.mlp.c_fc"]
        assert sorted(got) == ["dy.dgrad", "w.forward", "x.forward"]             # one tensor scale each
        assert got["w.forward/bytes"].dtype == np.uint8 and got["w.forward/bytes"].shape == (64, 16)
        assert got["x.forward/bytes"].shape == (4 * 16, 16) and got["dy.dgrad/bytes"].shape == (4 * 16, 64)
        assert got["x.forward/scale"].shape == got["dy.dgrad/scale"].shape == (1, 1)
        assert got["x.forward/bytes"][...].any() and got["dy.dgrad/bytes"][...].any()
    from mpicube.check.compare import compare_traces

    # every byte and scale agrees, the attention's first-query gradient in c_attn's dy included: an exact
    # zero on both (ops/attention_blocks.first_query_exact), not float64 noise of either sign
    result = compare_traces(tmp_path / "serial.h5", tmp_path / "1d.h5")
    off = [r.name for r in result.rows if not r.ok]
    assert not off, off

    # FP8 codes compare as numbers: 0x80 (-0) is 0x00 (+0), the sign of a value's rounding noise; 0x01 is not
    import shutil
    name = "step_2/fp8/h.0.attn.c_attn/dy.dgrad/bytes"                 # +0 at each first query
    for code, agrees in ((0x80, True), (0x01, False)):
        shutil.copy(tmp_path / "serial.h5", tmp_path / "edited.h5")
        with h5py.File(tmp_path / "edited.h5", "r+") as f:
            codes = f[name][...]
            codes[tuple(np.argwhere(codes == 0)[0])] = code
            f[name][...] = codes
        rows = {r.name: r.ok for r in compare_traces(tmp_path / "serial.h5", tmp_path / "edited.h5").rows}
        assert rows[name] is agrees and all(ok for n, ok in rows.items() if n != name), (code, rows[name])
    assert len(result.rows) > 100 and "step_2/fp8/h.0.mlp.c_proj/dy.dgrad/bytes" in {r.name for r in result.rows}


def test_trace_places_an_experts_rows_in_serials_token_order(tmp_path):
    """trace --fp8 records a mixture's expert x and dy as (N_e, K), N_e
    the tokens routed to expert e, in global token order (docs/fp8.md, "In
    traces"): in a serial trace (in this process: no launch) expert e's
    x.forward decodes, row scale by row scale, to the rows of ln_2's
    output (the mixture's input) of the tokens that chose e, in token
    order, to FP8's rounding, and the experts' rows add up to every
    (token, choice) pair. (Every layout's against serial's, bit for bit:
    tests/combo_matrix_check.py's FP8 expert cases.)"""
    import h5py
    import ml_dtypes
    from mpi4py import MPI

    from mpicube.analysis.trace import run_trace
    from mpicube.cli.common import env_settings
    from mpicube.cli.train import trace_command

    h, E = 16, 4
    argv = ["--arch", "mixtral", "--n-experts", str(E), "--n-layer", "1", "--n-head", "2", "--n-embd", str(h),
            "--ffn-hidden", "32", "--seq-len", "16", "--batch-size", "4", "--steps", "1", "--dtype", "float64",
            "--fp8", "rowwise", "--layout", "serial", "--out", str(tmp_path / "moe.h5")]
    options = trace_command.make_context("trace", argv).params
    run_trace({**options, **env_settings()}, MPI.COMM_SELF, say=lambda *a, **k: None)
    with h5py.File(tmp_path / "moe.h5") as f:
        x = f["step_1/act/h.0.ln_2"][...].reshape(-1, h)                       # (B T, h) the mixture's input
        chosen = f["step_1/moe/h.0.experts"][...].reshape(len(x), -1)          # (B T, K)
        total = 0
        for e in range(E):
            got = f[f"step_1/fp8/h.0.moe.experts.{e}.c_fc"]
            rows = np.flatnonzero((chosen == e).any(axis=1))                   # (N_e,) in token order
            codes, scale = got["x.forward/bytes"][...], got["x.forward/scale"][...]   # (N_e, h), (N_e, 1)
            assert codes.shape == (len(rows), h) and scale.shape == (len(rows), 1), (codes.shape, scale.shape)
            assert got["x.wgrad/bytes"].shape == (h, len(rows)) and got["dy.dgrad/bytes"].shape == (len(rows), 64)
            values = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float64) / scale
            np.testing.assert_allclose(values, x[rows], rtol=2.0 ** -4, atol=1e-5 * np.abs(x).max())
            total += len(rows)
        assert 0 < total == chosen.size


FLOAT32_FP8 = ["--n-layer", "2", "--n-head", "4", "--n-embd", "64", "--seq-len", "32", "--batch-size", "8",
               "--steps", "1", "--dtype", "float32", "--fp8", "tensorwise"]


def test_float32_fp8_layouts_agree_under_the_fp8_unit_and_a_bug_still_fails(mpicube, tmp_path, corpus_cache):
    """With float32 accumulation the layouts' quantizer inputs differ by
    float32 rounding, so a few codes flip where a value lay at a rounding
    midpoint, and from there the difference cascades to FP8's own noise
    (docs/fp8.md, "FP8 in the depth-aware tolerance"). The default verdict
    allows the first flips their derived count, then holds every tensor to
    the format's step and, before the step's update, to the test along
    itself: serial and 1-D agree (2-D too, in the docs' measurement), while
    a gradient 1% off and a scale off by a factor 2 fail."""
    import shutil

    import h5py

    from mpicube.check.compare import compare_traces

    from mpi4py import MPI

    from mpicube.analysis.trace import run_trace
    from mpicube.cli.common import env_settings
    from mpicube.cli.train import trace_command
    from mpicube.files import data

    corpus = str(data.builtin_corpus(corpus_cache)[0])
    argv = [*FLOAT32_FP8, "--data", corpus, "--layout", "serial", "--out", str(tmp_path / "serial.h5")]
    options = trace_command.make_context("trace", argv).params        # serial in this process: no launch
    run_trace({**options, **env_settings()}, MPI.COMM_SELF, say=lambda *a, **k: None)
    r = mpicube.run("trace", *FLOAT32_FP8, "--data", corpus, "--layout", "1d", "--out", "1d.h5", n=2)
    assert r.returncode == 0, r
    with h5py.File(tmp_path / "serial.h5") as f:
        assert json.loads(f.attrs["fp8"]) == {"recipe": "tensorwise", "grad_format": "e5m2", "accumulate": "float32",
                                              "block": 0, "pow2": False}
    rows = compare_traces(tmp_path / "serial.h5", tmp_path / "1d.h5").rows
    off = [(r.name, r.note) for r in rows if not r.ok]
    assert not off, off[:3]
    flipped = [r for r in rows if "codes one FP8 step apart" in r.note]
    assert len(flipped) == 1 and "float32 rounding allows" in flipped[0].note, flipped      # the first flip
    assert sum("FP8 cascade" in r.note for r in rows) > 10                                  # and its cascade
    first = next(i for i, r in enumerate(rows) if "codes one FP8 step apart" in r.note)
    before = [r.name for r in rows[:first] if r.name.startswith("step_1/grad/") and r.name.endswith(".weight")]
    assert before and "step_1/grad/wte" in {r.name for r in rows[first:]}
    for name, factor, why in ((before[-1], 1.01, ""),                   # before the first flip: float32's budget
                              ("step_1/grad/wte", 1.01, "along itself"),  # after it: the test along itself
                              ("step_1/fp8/h.0.mlp.c_fc/dy.dgrad/scale", 2.0, "rel fro 5.00e-01 > 0.25")):
        shutil.copy(tmp_path / "1d.h5", tmp_path / "planted.h5")
        with h5py.File(tmp_path / "planted.h5", "r+") as f:
            f[name][...] = f[name][...] * np.float32(factor)
        result = compare_traces(tmp_path / "serial.h5", tmp_path / "planted.h5")
        assert result.first_divergence == name, (name, result.first_divergence)
        row = next(r for r in result.rows if r.name == name)
        assert why in row.note, row.note


def test_fp8_unit_decodes_every_code_and_allows_what_chernoff_says():
    """compare's FP8 unit (check/fp8_tolerance.py) decodes codes with its
    own table (the check package reads traces without ml_dtypes): every
    one of the 256 codes of e4m3 and e5m2 as ml_dtypes reads it, NaN and
    infinity included; and its allowance is the least count whose
    Chernoff tail exp(-mu) (e mu / a)^a is below 1e-6."""
    import math

    import ml_dtypes

    from mpicube.check.fp8_tolerance import _decoder, allowed

    codes = np.arange(256, dtype=np.uint8)
    for fmt, kind in (("e4m3", ml_dtypes.float8_e4m3fn), ("e5m2", ml_dtypes.float8_e5m2)):
        assert np.array_equal(_decoder(fmt)(codes), codes.view(kind).astype(np.float64), equal_nan=True), fmt

    def tail(mu, a):
        return math.exp(-mu + a * (1 + math.log(mu / a)))

    for mu in (1e-3, 0.5, 4.0, 100.0):
        a = allowed(mu)
        assert a > mu and tail(mu, a) <= 1e-6 and (a - 1 <= mu or tail(mu, a - 1) > 1e-6), (mu, a)
    assert (allowed(0.5), allowed(4.0)) == (8, 19)


def test_a_framework_trace_declares_its_fp8_recipe(tmp_path):
    """TraceWriter(fp8=...) writes the ``fp8`` root attribute compare's
    FP8 unit reads (a recipe, e4m3 or e5m2 gradients, float32 or float64
    accumulation); anything else is bad input naming the field, and no
    file is left."""
    import h5py
    import pytest

    from hostile_traces import CFG, OPTIMIZER

    from mpicube.check.writer import TraceWriter
    from mpicube.core.errors import UserError

    declared = {"recipe": "tensorwise", "grad_format": "e5m2", "accumulate": "float32"}
    with TraceWriter(tmp_path / "a.h5", CFG, OPTIMIZER, "float32", {"framework": "test"}, fp8=declared) as w:
        pass                                               # no steps: the attribute is what matters
    with h5py.File(tmp_path / "a.h5") as f:
        assert json.loads(f.attrs["fp8"]) == declared
    with pytest.raises(UserError, match=r"fp8 needs grad_format \(e4m3 or e5m2\), got 'e3m4'"):
        TraceWriter(tmp_path / "b.h5", CFG, OPTIMIZER, "float32", {}, fp8={**declared, "grad_format": "e3m4"})
    assert not (tmp_path / "b.h5").exists()


@pytest.mark.parametrize("recipe", [["tensorwise"], ["rowwise", "--fp8-pow2"]], ids=["tensorwise", "rowwise"])
def test_torchao_float8_training_agrees_with_the_reference(mpicube, tmp_path, monkeypatch, recipe):
    """torchao's float8 training (Float8LinearConfig from its recipe name,
    emulated) on tools/torch_trace.py's GPT-2, two steps from the same
    initial parameters and batches as ``trace --fp8`` in float64: loss,
    every activation, gradient and updated parameter agree under compare's
    float64 budget, within 1e-11 relative. torchao's emulation rounds to
    float32 where mpicube's float64 does not (tests/torchao_float64.py says
    where, and widens it); unpatched, the step differs by about 1e-7.
    torchao's rowwise recipe rounds its scales to powers of two: mpicube's
    --fp8-pow2. Skipped without torch and torchao."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("torchao.float8")
    import importlib.util

    import torchao_float64

    from mpicube.check.compare import compare_traces

    r = mpicube.run("trace", *TINY, "--n-layer", "2", "--steps", "2", "--dtype", "float64", "--fp8", *recipe,
                    "--fp8-accumulate", "float64", "--out", "ref.h5")
    assert r.returncode == 0, r
    spec = importlib.util.spec_from_file_location("torch_trace", REPO / "tools" / "torch_trace.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    torchao_float64.patch(monkeypatch, torch)
    assert tool.main([str(tmp_path / "ref.h5"), "--out", str(tmp_path / "torchao.h5"),
                      "--torchao-fp8", recipe[0]]) == 0
    result = compare_traces(tmp_path / "ref.h5", tmp_path / "torchao.h5", allow_missing=("*fp8/*",))
    compared = [row for row in result.rows if "/fp8/" not in f"/{row.name}"]
    assert len(compared) > 150 and all(row.ok for row in compared), [r.name for r in compared if not r.ok][:5]
    assert max(row.max_rel for row in compared) < 1e-11
    assert {"step_1/loss", "step_2/grad/h.1.mlp.c_fc.weight"} <= {row.name for row in compared}
