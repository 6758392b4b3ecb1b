"""--zero 1: the AdamW moments (and a 16-bit run's float32 master weights)
sharded over the data-parallel replicas (mpicube/parallel/zero.py).

1. Every layout with dp = 2 follows the serial model (zero 0) in float64
   to 1e-10, with measured communication and memory (the sharded moments
   and master included) equal to the cost model, in
   tests/test_combo_matrix.py (zero 1 with every layout, pipeline
   schedule, cp, recompute mode and dtype); here dp = 4 (four chunks),
   AdamW's fused kernel on the chunk's runs, and two runs on CI's CuPy
   stand-in for the device path (tests/parallel_check.py with
   MPICUBE_CHECK_ZERO=1).
2. Checkpoints keep their format (full logical tensors) and move freely:
   real `mpicube train` runs saved with --zero 1 continue with --zero 0 on
   another layout and world size and vice versa, following the
   uninterrupted runs; a zero 1 and a zero 0 run save the same tensors; a
   bfloat16 zero 1 run resumes bit for bit.
3. `--zero 1` with dp = 1: one line from rank 0, exit status 2; `info`
   knows --zero.
"""

import shutil

import numpy as np
import pytest
from conftest import MpiCube, checkpoint_tensors, paired, read_metrics, relerr

from mpicube.files import checkpoint
from mpirun import ROOT, mpiexec

# The fused CPU kernels forced on at every size, two threads per rank (as tests/test_layouts.py):
# AdamW's numba kernel on the chunk's decayed and undecayed runs.
FUSED = {"MPICUBE_KERNELS": "numba", "MPICUBE_FUSED_MIN_ELEMS": "0", "OMP_NUM_THREADS": "2"}
CASES = [
    # (ranks, layout, dp, depth, env): what tests/test_combo_matrix.py does not hold
    (4, "serial", 4, 1, {}),   # four chunks
    (4, "1d", 2, 1, FUSED),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("ranks,layout,dp,depth,env", CASES,
                         ids=[f"{c[1]}-n{c[0]}-dp{c[2]}" + ("-fused" if c[4] else "") for c in CASES])
def test_zero_matches_serial(ranks, layout, dp, depth, env):
    if env:
        pytest.importorskip("numba")
    proc = mpiexec(ranks, ["-m", "mpi4py", "tests/parallel_check.py", layout, dp, depth, 0.1], timeout=240,
                   env={"MPICUBE_CHECK_ZERO": "1", **env})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"OK {layout} world={ranks} dp={dp} depth={depth} device=cpu dtype=float64 recompute=none accum=1 zero=1" in proc.stdout


FAKE_GPU = {"PYTHONPATH": f"{ROOT / 'tests' / 'fake_gpu'}:{ROOT}", "MPICUBE_CHECK_DEVICE": "gpu"}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("ranks,layout,dtype,cuda_aware", [(2, "serial", "float64", "0"), (4, "1d", "float16", "1")],
                         ids=["serial-float64-staged", "1d-float16-cuda-aware"])
def test_zero_on_the_gpu_path(ranks, layout, dtype, cuda_aware):
    """The device path (CI's strict CuPy stand-in, tests/fake_gpu): the
    reduce-scatter, the all-gather of the chunk (16-bit words in float16)
    and the gathered master stay on the device or go through the staging
    buffers, and the result follows the serial CPU model."""
    env = {**FAKE_GPU, "MPICUBE_CHECK_ZERO": "1", "MPICUBE_CHECK_DTYPE": dtype, "MPICUBE_CUDA_AWARE": cuda_aware}
    proc = mpiexec(ranks, ["-m", "mpi4py", "tests/parallel_check.py", layout, 2, 1, 0.1], timeout=240, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"OK {layout} world={ranks} dp=2 depth=1 device=gpu dtype={dtype} recompute=none accum=1 zero=1" in proc.stdout


# --- checkpoints -------------------------------------------------------------------

MODEL = ["--n-layer", "1", "--n-head", "6", "--n-embd", "36", "--seq-len", "8", "--batch-size", "36"]
SCHEDULE = ["--steps", "5", "--warmup", "1", "--lr", "1e-2", "--ckpt-every", "3", "--keep", "0"]
SAVED_STEP = 3
EVAL_RTOL = 1e-6        # a forward pass in float32, summed in another order
STEP_RTOL = 1e-5        # one more optimizer step in float32, in another order




class Runs:
    """Training runs in one directory (tests/test_zero23.py uses them too, with more blocks)."""

    def __init__(self, cube: MpiCube, model=MODEL):
        self.cube, self.dir, self.model = cube, cube.cwd, model

    def train(self, out, n, *extra):
        r = self.cube.run("train", *self.model, *SCHEDULE, "--out", out, *extra, n=n, timeout=240)
        assert r.returncode == 0, r
        return r

    def resume(self, src, out, n, *extra):
        """Steps 4 and 5 from ``src``'s step-3 checkpoint, full state (the
        checkpoint copied into a new run directory and resumed there)."""
        shutil.copytree(self.dir / src / "ckpt" / f"step_{SAVED_STEP:08d}",
                        self.dir / out / "ckpt" / f"step_{SAVED_STEP:08d}")
        r = self.train(out, n, "--resume", *extra)
        assert "resuming from" in r.stdout, r
        return r

    def steps(self, run) -> list:
        return read_metrics(self.dir / run)[0]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus_cache) -> Runs:
    """Two uninterrupted runs on 1-D with dp 2 (4 ranks), zero 1 and zero 0."""
    runs = Runs(MpiCube(tmp_path_factory.mktemp("zero"), corpus_cache))
    r = runs.train("z1", 4, "--layout", "1d", "--dp", "2", "--zero", "1")
    assert "layout 1d (tp 2, dp 2, p 2)" in r.stdout, r
    runs.train("z0", 4, "--layout", "1d", "--dp", "2", "--zero", "0")
    return runs


def test_zero1_follows_zero0_and_saves_the_same_tensors(runs):
    """In training, zero 1 follows zero 0 to float32 rounding, and its
    checkpoints hold the same full logical tensors: parameters and the
    moments gathered from the shards."""
    for a, b in paired(runs.steps("z1"), runs.steps("z0")):
        assert relerr(a["loss"], b["loss"]) < STEP_RTOL, (a, b)
    a, b = checkpoint_tensors(runs.dir / "z1"), checkpoint_tensors(runs.dir / "z0")
    assert sorted(a) == sorted(b)
    assert any(name.startswith("optimizer/v/") for name in a)
    for name in a:
        assert a[name].shape == b[name].shape, name
        got, want = a[name], b[name]
        if name.endswith("attn.c_attn.bias"):
            # The key bias's gradient is zero in exact arithmetic (a constant added
            # to a row's scores leaves its softmax unchanged), so what AdamW steps
            # on is rounding noise, normalised to steps of size lr whatever its
            # size: the two runs' noise differs (another summation order), and so
            # may those elements, by up to lr per step. The query and value parts
            # follow to float32 rounding as every other tensor does.
            h = got.shape[0] // 3
            assert np.abs(got[h:2 * h] - want[h:2 * h]).max() <= 2 * 1e-2 * 5, name     # lr x steps
            got, want = np.concatenate([got[:h], got[2 * h:]]), np.concatenate([want[:h], want[2 * h:]])
        assert np.abs(got - want).max() <= STEP_RTOL * 10 * np.abs(want).max(), name
    with checkpoint.open_checkpoint(runs.dir / "z1") as ck:
        assert ck.attrs["adam_t"] == 5


def _follows(runs, got_run, want_run):
    got = [s for s in runs.steps(got_run) if s["step"] > SAVED_STEP]
    want = [s for s in runs.steps(want_run) if s["step"] > SAVED_STEP]
    assert [s["step"] for s in got] == [SAVED_STEP + 1, SAVED_STEP + 2]
    assert relerr(got[0]["loss"], want[0]["loss"]) < EVAL_RTOL, (got[0], want[0])
    assert relerr(got[1]["loss"], want[1]["loss"]) < STEP_RTOL, (got[1], want[1])
    assert relerr(got[1]["grad_norm"], want[1]["grad_norm"]) < STEP_RTOL, (got[1], want[1])
    a, b = checkpoint_tensors(runs.dir / got_run), checkpoint_tensors(runs.dir / want_run)
    for name in b:
        assert np.abs(a[name] - b[name]).max() <= STEP_RTOL * 10 * np.abs(b[name]).max(), name


def test_zero1_checkpoint_resumes_with_zero0_elsewhere(runs):
    """The zero 1 run's step-3 checkpoint continues on serial, 1 rank,
    zero 0 and follows the uninterrupted zero 1 run (step 5 depends on the
    moments and step count carried over)."""
    runs.resume("z1", "z1_to_serial", 1, "--layout", "serial", "--zero", "0")
    _follows(runs, "z1_to_serial", "z1")


def test_zero0_checkpoint_resumes_with_zero1_elsewhere(runs):
    """The zero 0 run's step-3 checkpoint continues on serial with dp 2
    (2 ranks), zero 1: each replica keeps its chunk of the moments."""
    runs.resume("z0", "z0_to_serial_dp2", 2, "--layout", "serial", "--dp", "2", "--zero", "1")
    _follows(runs, "z0_to_serial_dp2", "z0")


def test_zero1_bfloat16_resumes_bit_for_bit(runs):
    """bfloat16 with zero 1 (the float32 master sharded): the master and
    moments gathered for the step-3 save and scattered on resume continue
    the run bit for bit on the same layout."""
    resumes_bit_for_bit(runs, ["--layout", "serial", "--dp", "2", "--zero", "1", "--dtype", "bfloat16"])


def resumes_bit_for_bit(runs, opts):
    """A run with ``opts`` (2 ranks) and its resume from the step-3
    checkpoint with the same options: the same steps 4 and 5 and the same
    final checkpoint, bit for bit (tests/test_zero23.py uses it too)."""
    runs.train("bf", 2, *opts)
    runs.resume("bf", "bf_cont", 2, *opts)
    got = [s for s in runs.steps("bf_cont") if s["step"] > SAVED_STEP]
    want = [s for s in runs.steps("bf") if s["step"] > SAVED_STEP]
    assert [(s["loss"], s["grad_norm"]) for s in got] == [(s["loss"], s["grad_norm"]) for s in want]
    a, b = checkpoint_tensors(runs.dir / "bf_cont"), checkpoint_tensors(runs.dir / "bf")
    assert sorted(a) == sorted(b)
    for name in b:
        assert np.array_equal(a[name], b[name]), name


# --- bad input and info ---------------------------------------------------------------


def test_zero_needs_data_parallelism(mpicube):
    """Every rank refuses before any collective; rank 0 says it once."""
    r = mpicube.run("train", "--layout", "1d", "--zero", "1", "--steps", "1", n=2)
    assert r.returncode == 2, r
    assert r.error_lines() == ["error: --zero 1 shards the optimizer state over data-parallel replicas and "
                               "needs --dp 2 or more (got --dp 1)"], r


def test_info_knows_zero(tmp_path):
    """`info --zero 1` predicts the sharded optimizer state (2 C moments,
    C = ceil(P / dp)) and says so; with dp 1 it refuses in one line."""
    from test_formats import run_cases

    from mpicube.core.config import ModelConfig
    from mpicube.analysis.costmodel import Problem
    from mpicube.analysis.costmemory import step_memory
    from mpicube.analysis.costreport import _fmt

    args = ["info", "-n", "8", "--dp", "4", "--layout", "1d", "--n-embd", "64", "--n-head", "4"]
    bad, plain, zero = run_cases(tmp_path, [["info", "-n", "4", "--zero", "1"], args, args + ["--zero", "1"]])
    assert bad["status"] == 2, bad
    assert len(bad["err"]) == 1 and "--dp 2 or more" in bad["err"][0], bad
    assert plain["status"] == 0 and zero["status"] == 0, (plain, zero)
    assert any("optimizer state sharded over dp (--zero 1)" in x for x in zero["out"])
    assert not any("--zero 1" in x for x in plain["out"])

    def optimizer_elems(out):
        return next(x for x in out if x.strip().startswith("optimizer ")).split()[1]

    cfg = ModelConfig(vocab_size=256, n_ctx=64, n_layer=4, n_head=4, n_embd=64)
    p0, p1 = Problem(cfg, "1d", 2, 4, 1, 8, 64), Problem(cfg, "1d", 2, 4, 1, 8, 64, zero=1)
    moments = step_memory(p0).optimizer                      # 2 P
    assert step_memory(p1).optimizer == 2 * -(-moments // 2 // 4)   # 2 C, C = ceil(P / 4)
    assert optimizer_elems(plain["out"]) == _fmt(moments)
    assert optimizer_elems(zero["out"]) == _fmt(step_memory(p1).optimizer)
