"""Mixed precision: --dtype float16 (dynamic loss scaling) and bfloat16.

- The `make train` model (the Makefile's TRAIN_DEFAULTS) for 300 steps in
  each 16-bit format ends within 0.05 of the float32 run's mean loss over
  its last 50 steps, same seed. The float16 run also takes one injected
  overflow (MPICUBE_TEST_OVERFLOW_STEP): exactly that step is skipped, the
  scale backs off, and the checkpoint saved right after it holds only
  finite float32 tensors.
- Checkpoints of a 16-bit run evaluate in float32 and float64 on any layout.
- float16 resume is exact, loss scale and its counters included.
- Every layout in 16 bits against serial in 16 bits (tests/parallel_check.py
  states the tolerance and why), with measured bytes == the cost model
  (tests/test_combo_matrix.py's cases); the
  GPU path on CI's CuPy stand-in in float16 (and in both 16-bit formats in
  tests/test_gpu_path.py's layout x dtype x transport matrix).
- The blockwise 16-bit GEMM equals float32 GEMMs of the widened operands.
- Bad input: one line, exit 2.
"""

import json
import math

import subprocess
from types import SimpleNamespace

import h5py
import numpy as np
import pytest

from conftest import TINY, MpiCube, last_json, paired, read_metrics
from mpirun import ROOT, mpiexec

# The Makefile's TRAIN_DEFAULTS, but 300 steps and no evaluation.
MAKE_TRAIN = ["--n-layer", "4", "--n-head", "12", "--n-embd", "144", "--seq-len", "64", "--batch-size", "8",
              "--lr", "3e-3", "--warmup", "20", "--steps", "300", "--log-every", "100"]
OVERFLOW_STEP = 150
FAKE_GPU = {"PYTHONPATH": f"{ROOT / 'tests' / 'fake_gpu'}:{ROOT}"}


@pytest.fixture(scope="module")
def trained(tmp_path_factory, corpus_cache):
    """The three 300-step runs, shared by the tests below: float32, float16
    with an overflow injected at step 150 (checkpoints every 150 steps), bfloat16."""
    cube = MpiCube(tmp_path_factory.mktemp("precision"), corpus_cache)
    cube.env["MPIEXEC_TIMEOUT"] = "600"
    # The three runs are independent single-rank jobs: run side by side, one
    # core's worth of threads each (this model's GEMMs gain nothing from more),
    # they finish in about half the time of one after another.
    jobs = {}
    for dtype in ("float32", "float16", "bfloat16"):
        extra = ["--ckpt-every", str(OVERFLOW_STEP), "--keep", "0"] if dtype == "float16" else []
        env = {"MPICUBE_NODE_CORES": 1, **({"MPICUBE_TEST_OVERFLOW_STEP": OVERFLOW_STEP} if dtype == "float16" else {})}
        out = (cube.cwd / f"{dtype}.out").open("w+")          # files, not pipes: no job waits on a full pipe
        cmd = cube.command("train", *MAKE_TRAIN, "--dtype", dtype, *extra, "--out", dtype, env=env)
        jobs[dtype] = (subprocess.Popen(cmd, cwd=cube.cwd, env=cube.env, stdout=out, stderr=subprocess.STDOUT,
                                        text=True), out)
    runs = {}
    try:
        for dtype, (job, out) in jobs.items():
            job.wait(timeout=660)
            out.seek(0)
            output = out.read()
            assert job.returncode == 0, f"{dtype} run failed:\n{output}"
            runs[dtype] = (cube.cwd / dtype, SimpleNamespace(returncode=job.returncode, stdout=output))
    finally:
        for job, out in jobs.values():
            if job.poll() is None:
                job.kill()
            out.close()
    return cube, runs


def mean_last_50(run_dir) -> float:
    losses = [r["loss"] for r in read_metrics(run_dir)[0]]
    assert len(losses) == 300
    return float(np.mean(losses[-50:]))


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_16bit_training_ends_within_005_of_float32(trained, dtype):
    _, runs = trained
    want, got = mean_last_50(runs["float32"][0]), mean_last_50(runs[dtype][0])
    assert abs(got - want) <= 0.05, (dtype, got, want)


@pytest.mark.timeout(1500)
def test_injected_overflow_skips_exactly_that_step_and_saves_only_finite_values(trained):
    _, runs = trained
    run_dir, result = runs["float16"]
    steps = read_metrics(run_dir)[0]
    skipped = [r["step"] for r in steps if r["skipped"]]
    assert skipped == [OVERFLOW_STEP], skipped
    by_step = {r["step"]: r for r in steps}
    assert by_step[OVERFLOW_STEP]["loss_scale"] == 65536.0 and by_step[OVERFLOW_STEP]["grad_norm"] is None
    assert by_step[OVERFLOW_STEP + 1]["loss_scale"] == 32768.0            # backed off by 0.5 ...
    assert by_step[300]["loss_scale"] == 32768.0                          # ... and not grown (interval 2000)
    assert all(math.isfinite(r["grad_norm"]) for r in steps if not r["skipped"])
    assert f"step {OVERFLOW_STEP}: gradient overflow at loss scale 65536: step skipped" in result.stdout
    for step, adam_t in ((OVERFLOW_STEP, OVERFLOW_STEP - 1), (300, 299)):   # the skipped step made no update
        with h5py.File(run_dir / "ckpt" / f"step_{step:08d}" / "checkpoint.h5") as f:
            assert f.attrs["adam_t"] == adam_t
            assert json.loads(f.attrs["loss_scale"]) == {"scale": 32768.0, "growth_interval": 2000,
                                                         "backoff": 0.5, "good_steps": step - OVERFLOW_STEP,
                                                         "skipped": 1}
            # tensors may be links into other files of the checkpoint: list the groups, read through them
            tensors = [f"{group}/{name}" for group in ("model", "optimizer/m", "optimizer/v") for name in f[group]]
            assert len(tensors) == 3 * (2 + 12 * 4 + 2)          # every parameter and both Adam moments
            for name in tensors:
                values = f[name][...]
                assert values.dtype == np.float32, (name, values.dtype)     # checkpoints hold the master
                assert np.isfinite(values).all(), name


@pytest.mark.timeout(1500)
def test_16bit_checkpoints_evaluate_in_float32_and_float64_on_any_layout(trained):
    cube, runs = trained
    ckpt = runs["bfloat16"][0]
    cases = [(1, "serial", "float32"), (8, "3d", "float64"), (4, "2d", "float32"), (2, "1d", "float64")]
    losses = {}
    for n, layout, dtype in cases:
        result = cube.run("eval", ckpt, "--layout", layout, "--dtype", dtype, "--batches", "2", n=n, timeout=300)
        assert result.returncode == 0, result
        losses[layout, dtype] = last_json(result.stdout)["loss"]
    reference = losses["3d", "float64"]
    for key, loss in losses.items():
        assert abs(loss - reference) <= 1e-5 * reference, (key, loss, reference)   # float32 reassociation
    # and it evaluates in 16 bits too, close to the float32 figure (bfloat16 rounding of the weights)
    result = cube.run("eval", ckpt, "--layout", "serial", "--dtype", "bfloat16", "--batches", "2", timeout=300)
    assert result.returncode == 0, result
    assert abs(last_json(result.stdout)["loss"] - reference) <= 0.02 * reference


@pytest.mark.timeout(200)
def test_float16_resume_is_exact_with_the_loss_scale(mpicube, tiny_shard):
    common = [*TINY, "--steps", "8", "--data", tiny_shard, "--dtype", "float16", "--loss-scale", "1024",
              "--loss-scale-growth-interval", "2", "--log-every", "1"]
    overflow = {"MPICUBE_TEST_OVERFLOW_STEP": 3}
    straight = mpicube.run("train", *common, "--out", "straight", env=overflow)
    first = mpicube.run("train", *common, "--out", "split", "--stop-after", "5", env=overflow)
    second = mpicube.run("train", *common, "--out", "split", "--resume", env=overflow)
    assert straight.returncode == first.returncode == second.returncode == 0, (straight, first, second)
    keys = ("loss", "grad_norm", "loss_scale", "skipped")
    want = [tuple(r[k] for k in keys) for r in read_metrics(mpicube.cwd / "straight")[0]]
    got = [tuple(r[k] for k in keys) for r in read_metrics(mpicube.cwd / "split")[0]]
    assert got == want                                                    # bit for bit
    scales = [r[2] for r in want]
    assert scales == [1024, 1024, 2048, 1024, 1024, 2048, 2048, 4096]    # x2 after 2 good steps, /2 on overflow
    assert [r[3] for r in want] == [False, False, True] + [False] * 5


# Every layout in both 16-bit formats against serial in the same format, with
# measured bytes == the cost model, composed with dp, pipeline schedules, cp,
# sequence parallelism, zero, recompute and accumulation:
# tests/test_combo_matrix.py.


# bfloat16 on the stand-in (which like CuPy 14 refuses a batched bfloat16
# matmul, attention's P V): every layout, staged and CUDA-aware, in
# tests/test_gpu_path.py's layout x dtype x transport matrix.


@pytest.mark.timeout(300)
@pytest.mark.parametrize("cuda_aware", ["0"], ids=["staged"])
def test_gpu_path_in_float16(cuda_aware):
    """The stand-in's float16 arrays through every collective of the 3-D
    layout (raw 16-bit words; sums added in float32 where they arrive),
    staged. (CUDA-aware 16-bit sums: tests/comm_wire_check.py in
    test_comm.py, and --zero 1 in float16 in test_zero.py.)"""
    env = {**FAKE_GPU, "MPICUBE_CHECK_DEVICE": "gpu", "MPICUBE_CHECK_SIZE": "large", "MPICUBE_CHECK_DTYPE": "float16",
           "MPICUBE_CUDA_AWARE": cuda_aware}
    proc = mpiexec(8, ["-m", "mpi4py", "tests/parallel_check.py", "3d", 1, 1, 0.1, 16], timeout=240, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "OK 3d world=8 dp=1 depth=1 device=gpu dtype=float16" in proc.stdout


@pytest.mark.timeout(120)
def test_gpu_training_in_float16_follows_the_cpu(mpicube, tiny_shard):
    common = [*TINY, "--steps", "3", "--data", tiny_shard, "--dtype", "float16", "--log-every", "1"]
    cpu = mpicube.run("train", *common, "--out", "cpu")
    gpu = mpicube.run("train", *common, "--out", "gpu", "--device", "gpu", env=FAKE_GPU)
    assert cpu.returncode == 0 and gpu.returncode == 0, (cpu, gpu)
    for want, got in paired(read_metrics(mpicube.cwd / "cpu")[0], read_metrics(mpicube.cwd / "gpu")[0]):
        assert got["loss_scale"] == want["loss_scale"] and not got["skipped"]
        assert abs(got["loss"] - want["loss"]) <= 8 * 2.0 ** -11 * want["loss"], (got, want)


def test_blockwise_16bit_gemm_equals_float32_gemm_of_the_widened_operands(monkeypatch):
    """Every branch of precision.matmul's NumPy path (row blocks, k blocks
    with a float32 accumulator, batches), with blocks small enough that
    each operand is cut several times."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    from mpicube.device import precision

    monkeypatch.setattr(precision, "BLOCK_ELEMS", 64)
    rng = np.random.default_rng(0)
    for dtype in (np.float16, ml_dtypes.bfloat16):
        for a_shape, b_shape in (((37, 9), (9, 5)), ((6, 300), (300, 7)), ((3, 2, 11, 4), (3, 2, 4, 8))):
            a = rng.normal(size=a_shape).astype(dtype)
            b = rng.normal(size=b_shape).astype(dtype)
            exact = np.matmul(a.astype(np.float32), b.astype(np.float32))
            got32 = precision.matmul(a, b, dtype=np.float32)
            assert got32.dtype == np.float32
            np.testing.assert_allclose(got32, exact, rtol=2e-6, atol=2e-6 * np.abs(exact).max())
            got16 = precision.matmul(a, b)                         # rounded once into the 16-bit result
            assert got16.dtype == dtype
            np.testing.assert_array_equal(got16, got32.astype(dtype))
            out = np.empty(exact.shape, dtype=np.float32)
            assert precision.matmul(a, b, out=out) is out
            np.testing.assert_array_equal(out, got32)


def test_bfloat16_halves_activation_memory_against_float32():
    """The cost model (which parallel_check holds equal to what the model
    keeps and moves): bfloat16 activations take half of float32's bytes
    but for LayerNorm's float32 statistics and the embedding's float32
    gradient panel; the layouts' gathers, broadcasts and sums move half
    (exactly: test_bfloat16_moves_half_the_bytes_of_float32_but_...)."""
    from mpicube.core.config import ModelConfig
    from mpicube.analysis.costmodel import Problem, step_traffic
    from mpicube.analysis.costmemory import step_memory_bytes

    cfg = ModelConfig(vocab_size=256, n_ctx=64, n_layer=4, n_head=12, n_embd=144)
    for layout, tp in (("3d", 8), ("2d", 4), ("1d", 4), ("serial", 1)):
        m32, m16 = (step_memory_bytes(Problem(cfg, layout, tp, 1, 1, 16, 64, d)) for d in ("float32", "bfloat16"))
        assert 0.5 < m16.activations / m32.activations < 0.52, layout
        t32, t16 = (step_traffic(Problem(cfg, layout, tp, 1, 1, 16, 64, d)) for d in ("float32", "bfloat16"))
        assert t16.total_elems() == t32.total_elems()
        assert t16.total_bytes() <= t32.total_bytes()


def kept_problem(problem):
    """``problem`` with only what keeps its width in bfloat16: the wire of
    activation sums, the activation format and the wire of gradient sums
    priced at 0 bytes, so its traffic's bytes are those of the float32
    statistics and the float64 scalars."""
    from dataclasses import dataclass, replace

    from mpicube.analysis.costmodel import Problem, Widths

    @dataclass
    class Kept(Problem):
        @property
        def widths(self) -> Widths:
            return replace(Widths.of(self.dtype), act=0, red=0, gsum=0)

    return Kept(**{f: getattr(problem, f) for f in problem.__dataclass_fields__})


# (layout, tp, dp, depth, zero, share): the cost-model cases of the byte ratio, and K's share of float32's bytes
RATIO_CASES = [("3d", 8, 1, 1, 0, 0.004), ("1d", 2, 1, 1, 0, 0.0015), ("1d", 4, 1, 1, 0, 0.0015),
               ("2d", 4, 1, 1, 0, 0.003), ("2.5d", 8, 1, 2, 0, 0.0025), ("1d", 2, 2, 1, 0, 0.0015),
               ("1d", 2, 2, 1, 1, 0.0015), ("2d", 4, 2, 1, 0, 0.003), ("3d", 8, 2, 1, 1, 0.004)]


def test_bfloat16_moves_half_the_bytes_of_float32_but_statistics_and_scalars():
    """Cost model, exactly: bytes16 = (bytes32 - K) / 2 + K, where K is what
    keeps its width (LayerNorm and cross-entropy statistics, the gradient
    norm and the loss), a small share of the traffic, with data parallelism
    and --zero 1 too (the gradient sums of replicated parameters and of dp
    travel in bfloat16): every case moves less than 0.502x of float32's
    bytes (3d 0.5018x, 1d 0.5006x, 1d x dp 2 0.5005x with --zero 0 or 1).
    float16 keeps its gradient sums in float32: with dp = 2 it moves more
    than 0.51x (1d x dp 2: 0.58x)."""
    from mpicube.core.config import ModelConfig
    from mpicube.analysis.costmodel import Problem, step_traffic

    cfg = ModelConfig(vocab_size=256, n_ctx=64, n_layer=4, n_head=12, n_embd=144)
    for layout, tp, dp, depth, zero, share in RATIO_CASES:
        case = (layout, tp, dp, depth, zero)
        t32, t16, t_fp16 = (step_traffic(Problem(cfg, layout, tp, dp, depth, 16 * dp, 64, d, zero=zero))
                            for d in ("float32", "bfloat16", "float16"))
        kept = step_traffic(kept_problem(Problem(cfg, layout, tp, dp, depth, 16 * dp, 64, "bfloat16",
                                                 zero=zero))).total_bytes()
        assert t16.total_bytes() == (t32.total_bytes() - kept) / 2 + kept, case
        assert 0 < kept / t32.total_bytes() < share, (case, float(kept / t32.total_bytes()))
        assert t16.total_bytes() / t32.total_bytes() < 0.502, case
        if dp > 1:
            assert t_fp16.total_bytes() / t32.total_bytes() > 0.51, case
        assert t16.total_elems() == t32.total_elems(), case      # groups of 2: the 16-bit sums count as MPI's
        if layout in ("1d", "3d"):
            assert t16.total_msgs() == t32.total_msgs()
        else:                           # SUMMA's reduce in 16 bits: an all-to-all and a gather, 2 (q-1) messages
            q, reduces = 2, 2 * 2 * 4 * cfg.n_layer                 # per linear: q for dX, q for dW
            assert t16.total_msgs() == t32.total_msgs() + reduces * (q - 1)


BENCH_SMALL = ["--n-layer", "2", "--n-head", "12", "--n-embd", "48", "--seq-len", "16", "--batch-size", "8",
               "--warmup-steps", "1", "--steps", "1", "--json"]


# (ranks, layout, dp, zero): real runs of the byte ratio
RUN_CASES = [(8, "3d", 1, 0), (2, "1d", 1, 0), (4, "1d", 2, 0), (4, "1d", 2, 1)]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("ranks,layout,dp,zero", RUN_CASES, ids=["3d", "1d", "1d-dp2", "1d-dp2-zero1"])
def test_bfloat16_run_moves_the_bytes_the_model_predicts_about_half_of_float32(ranks, layout, dp, zero):
    """Real runs (mpicube bench, rank 0's counters): measured == predicted
    in float32 and in bfloat16, and the measured ratio is the model's
    (bytes16 = (bytes32 - K) / 2 + K, K the statistics and scalars that
    keep their width), with data parallelism and --zero 1 as well: the
    bfloat16 gradient sums move half of float32's."""
    from fractions import Fraction

    from mpicube.core.config import ModelConfig
    from mpicube.analysis.costmodel import Problem, step_traffic

    measured = {}
    for dtype in ("float32", "bfloat16"):
        proc = mpiexec(ranks, ["-m", "mpicube", "bench", "--layout", layout, "--dtype", dtype, "--dp", dp,
                               "--zero", zero, *BENCH_SMALL], timeout=180)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        comm = last_json(proc.stdout)["results"][0]["comm"]
        assert comm["exact"] and comm["measured_bytes"] == comm["predicted_bytes"], comm
        measured[dtype] = Fraction(comm["measured_bytes"])
    cfg = ModelConfig(vocab_size=256, n_ctx=16, n_layer=2, n_head=12, n_embd=48)
    p32 = Problem(cfg, layout, ranks // dp, dp, 1, 8, 16, "float32", zero=zero)
    kept = step_traffic(kept_problem(Problem(cfg, layout, ranks // dp, dp, 1, 8, 16, "bfloat16",
                                             zero=zero))).total_bytes()
    assert measured["float32"] == step_traffic(p32).total_bytes()
    assert measured["bfloat16"] == (measured["float32"] - kept) / 2 + kept
    assert 0.5 < measured["bfloat16"] / measured["float32"] < 0.51, float(measured["bfloat16"] / measured["float32"])


@pytest.mark.timeout(200)
def test_bad_precision_input_is_one_error_line(mpicube, tiny_shard, tmp_path):
    args = ["train", *TINY, "--steps", "2", "--data", tiny_shard]

    def error(result):
        lines = result.error_lines()
        assert result.returncode == 2 and len(lines) == 1 and "Traceback" not in result.stderr, result
        return lines[0]

    assert "loss scaling applies to --dtype float16 only" in error(mpicube.run(*args, "--loss-scale", "8",
                                                                               "--out", "a"))
    assert "--loss-scale-backoff must be between 0 and 1" in error(mpicube.run(
        *args, "--dtype", "float16", "--loss-scale-backoff", "1.5", "--out", "b"))
    assert "--loss-scale must be a positive number" in error(mpicube.run(
        *args, "--dtype", "float16", "--loss-scale", "0", "--out", "c"))
    assert "--tf32 applies to GPUs" in error(mpicube.run(*args, "--dtype", "float16", "--tf32", "--out", "d"))
    assert "use --dtype float16 on GPUs" in error(mpicube.run(*args, "--dtype", "bfloat16", "--device", "gpu",
                                                               "--out", "e", env={**FAKE_GPU,
                                                               "MPICUBE_FAKE_GPU_NO_BFLOAT16": "1"}))
    hidden = tmp_path / "no_ml_dtypes" / "ml_dtypes"              # an ml_dtypes that fails to import
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text("raise ImportError('ml_dtypes hidden by the test')\n")
    no_ml_dtypes = {"PYTHONPATH": f"{hidden.parent}:{ROOT}"}
    assert "needs the ml_dtypes package" in error(mpicube.run(*args, "--dtype", "bfloat16", "--out", "f",
                                                              env=no_ml_dtypes))
    assert not (mpicube.cwd / "a" / "ckpt").exists()


def test_info_reports_real_widths(mpicube):
    r16 = mpicube.run("info", "--layout", "3d", "-n", "8", "--n-embd", "192", "--batch-size", "16",
                      "--dtype", "float16")
    r32 = mpicube.run("info", "--layout", "3d", "-n", "8", "--n-embd", "192", "--batch-size", "16")
    assert r16.returncode == 0 and r32.returncode == 0, (r16, r32)
    assert "float32 master + float16 working copy" in r16.stdout
    assert "communication per rank per step (float16: elements, bytes, messages)" in r16.stdout

    def total(stdout, section):
        lines = stdout.split(section, 1)[1].splitlines()
        return next(line for line in lines if line.strip().startswith("total")).split()

    elems16, bytes16 = total(r16.stdout, "communication per rank")[1:3]
    elems32, bytes32 = total(r32.stdout, "communication per rank")[1:3]
    assert elems16 == elems32 and bytes16 != bytes32


COMM16 = """
import numpy as np, ml_dtypes
from fractions import Fraction
from mpi4py import MPI
from mpicube.device.backend import make_backend
from mpicube.parallel.comm import Comm, Counters
world = MPI.COMM_WORLD
g, r = world.size, world.rank
for dtype in (np.float16, ml_dtypes.bfloat16):
    counters = Counters()
    comm = Comm(world, "x", make_backend("cpu", "float32"), counters)
    x = (np.random.default_rng(r).normal(size=(g * 3, 5)) * 100).astype(dtype)      # (g*3, 5)
    everyone = [(np.random.default_rng(k).normal(size=(g * 3, 5)) * 100).astype(dtype) for k in range(g)]
    gathered = comm.allgather(x, axis=1)
    assert gathered.dtype == dtype and np.array_equal(gathered.view(np.uint16),
                                                      np.concatenate(everyone, axis=1).view(np.uint16))
    assert np.array_equal(comm.bcast(x, root=g - 1).view(np.uint16), everyone[-1].view(np.uint16))
    exact = sum(e.astype(np.float32) for e in everyone)                                # float32 sum, rounded once
    summed = comm.reduce_scatter(x, axis=0)
    assert summed.dtype == dtype and np.array_equal(summed, exact[r * 3:(r + 1) * 3].astype(dtype))
    assert np.array_equal(comm.allreduce(x), exact.astype(dtype))
    n = x.size
    want = (g - 1) * n * 2 + n * 2 + Fraction(g - 1, g) * n * 4 + Fraction(2 * (g - 1), g) * n * 4
    assert counters.bytes["x"] == want, (counters.bytes["x"], want)
print("OK comm16")
"""


@pytest.mark.timeout(120)
def test_16bit_collectives_move_raw_words_and_reduce_in_float32():
    pytest.importorskip("ml_dtypes")
    proc = mpiexec(3, ["-c", COMM16], timeout=60)
    assert proc.returncode == 0 and "OK comm16" in proc.stdout, proc.stdout + proc.stderr
