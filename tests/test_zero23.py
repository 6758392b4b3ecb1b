"""--zero 2 and --zero 3: gradients, then the weights too, sharded over the
data-parallel replicas layer by layer (mpicube/parallel/fsdp.py).

1. Every layout with dp 2 follows the serial model (zero 0) with zero 2
   and 3, with --recompute, --grad-accum, sequence parallelism and 16 bits,
   and its measured communication (every per-layer reduce-scatter and
   gather) and memory (every weight and gradient buffer, the slots of the
   gathered and prefetched layers included) equal the cost model exactly,
   in tests/test_combo_matrix.py. Here: dp 4 with more blocks than the two
   weight slots (tests/parallel_check.py with MPICUBE_CHECK_ZERO=3), and
   CI's CuPy stand-in for the device path (the gather received straight
   into the slot, or staged).
2. Checkpoints keep their format and move between zero settings, layouts
   and world sizes; a bfloat16 --zero 3 run resumes bit for bit.
3. --zero 2/3 with dp 1: one line, exit 2; `info` shows every --zero on
   every layout, and the cost model's figures at the paper's scale.
4. Composition (issue 32): --zero 2/3 with context parallelism (the chunk
   summed over the ring once per step) and with pipeline stages (each
   stage's store holds its chunks' blocks; wte a segment of its own whose
   chunk is summed over the tied pair; interleaved chunks' backwards out of
   order across micro-batches): serial in float64 with dropout to 1e-10,
   every rank's traffic and buffers equal to the cost model.
"""

import numpy as np
import pytest
from conftest import MpiCube, checkpoint_tensors, paired, relerr
from test_zero import EVAL_RTOL, SAVED_STEP, STEP_RTOL, Runs, resumes_bit_for_bit

from mpirun import ROOT, mpiexec

CASES = [
    # (ranks, layout, dp, depth, zero, env)
    # 4 blocks, two weight slots: blocks gathered again after each turn of the passes
    (4, "serial", 4, 1, 3, {"MPICUBE_CHECK_RECOMPUTE": "blocks", "MPICUBE_CHECK_ACCUM": "2",
                            "MPICUBE_CHECK_LAYERS": "4"}),
]


def _id(case):
    ranks, layout, dp, _, zero, env = case
    extra = "-".join(f"{k.split('_')[-1].lower()}{v}" for k, v in sorted(env.items()))
    return f"{layout}-n{ranks}-dp{dp}-zero{zero}" + (f"-{extra}" if extra else "")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("ranks,layout,dp,depth,zero,env", CASES, ids=[_id(c) for c in CASES])
def test_zero23_matches_serial(ranks, layout, dp, depth, zero, env):
    proc = mpiexec(ranks, ["-m", "mpi4py", "tests/parallel_check.py", layout, dp, depth, 0.1], timeout=240,
                   env={"MPICUBE_CHECK_ZERO": str(zero), **env})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    dtype = env.get("MPICUBE_CHECK_DTYPE", "float64")
    recompute, accum = env.get("MPICUBE_CHECK_RECOMPUTE", "none"), env.get("MPICUBE_CHECK_ACCUM", "1")
    cp = env.get("MPICUBE_CHECK_CP", "1")
    assert (f"OK {layout} world={ranks} dp={dp} depth={depth} device=cpu dtype={dtype} recompute={recompute} "
            f"accum={accum} zero={zero} cp={cp} ") in proc.stdout


@pytest.mark.timeout(300)
def test_zero23_with_pipeline_stages():
    """serial dp 2 x pp 2 (4 ranks), tests/pipeline_check.py in one launch:
    --zero 3 under interleaved (V 2, two blocks per chunk, four micro-
    batches, --recompute blocks: the chunks' backwards interleave across
    micro-batches, the block gathers follow the schedule's passes), and
    --zero 2 under 1F1B with three blocks per stage."""
    cases = ["serial 2 1 2 interleaved 2 4 zero=3 layers=8 recompute=blocks", "serial 2 1 2 1f1b 1 2 zero=2 layers=6"]
    args = [w for case in cases for w in case.split() + ["--"]][:-1]
    proc = mpiexec(4, ["-m", "mpi4py", "tests/pipeline_check.py", *args], timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for want in ("schedule=interleaved V=2 accum=4 dtype=float64 recompute=blocks zero=3",
                 "schedule=1f1b V=1 accum=2 dtype=float64 recompute=none zero=2"):
        assert f"OK pp serial world=4 dp=2 depth=1 pp=2 {want} " in proc.stdout, proc.stdout


FAKE_GPU = {"PYTHONPATH": f"{ROOT / 'tests' / 'fake_gpu'}:{ROOT}", "MPICUBE_CHECK_DEVICE": "gpu"}


@pytest.mark.timeout(300)
def test_zero3_on_the_gpu_path():
    """CI's strict CuPy stand-in, MPI not CUDA-aware: every gather goes
    through the staging buffers into the device slot, and the result
    follows the serial CPU model."""
    env = {**FAKE_GPU, "MPICUBE_CHECK_ZERO": "3", "MPICUBE_CUDA_AWARE": "0"}
    proc = mpiexec(2, ["-m", "mpi4py", "tests/parallel_check.py", "serial", 2, 1, 0.1], timeout=240, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "OK serial world=2 dp=2 depth=1 device=gpu dtype=float64 recompute=none accum=1 zero=3" in proc.stdout


# --- checkpoints -------------------------------------------------------------------

MODEL = ["--n-layer", "3", "--n-head", "6", "--n-embd", "36", "--seq-len", "8", "--batch-size", "36"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus_cache) -> Runs:
    """Uninterrupted runs on 1-D with dp 2 (4 ranks), --zero 3 and --zero 0."""
    runs = Runs(MpiCube(tmp_path_factory.mktemp("zero23"), corpus_cache), MODEL)
    r = runs.train("z3", 4, "--layout", "1d", "--dp", "2", "--zero", "3")
    assert "layout 1d (tp 2, dp 2, p 2)" in r.stdout, r
    runs.train("z0", 4, "--layout", "1d", "--dp", "2", "--zero", "0")
    return runs


def _same_tensors(a, b, rtol):
    assert sorted(a) == sorted(b)
    for name in b:
        assert a[name].shape == b[name].shape, name
        assert np.abs(a[name] - b[name]).max() <= rtol * 10 * np.abs(b[name]).max(), name


def test_zero3_follows_zero0_and_saves_the_same_tensors(runs):
    """zero 3 follows zero 0 to float32 rounding; its checkpoint holds the
    same full logical tensors (weights and moments gathered from the
    per-layer chunks)."""
    for a, b in paired(runs.steps("z3"), runs.steps("z0")):
        assert relerr(a["loss"], b["loss"]) < STEP_RTOL, (a, b)
    a, b = checkpoint_tensors(runs.dir / "z3"), checkpoint_tensors(runs.dir / "z0")
    assert any(name.startswith("optimizer/m/h.2.") for name in a)
    _same_tensors(a, b, STEP_RTOL)


def test_checkpoints_move_between_zero_settings(runs):
    """zero 3's step-3 checkpoint (1-D, 4 ranks) continues on serial with
    dp 2 and zero 2 (2 ranks) and follows the uninterrupted run (step 5
    depends on the moments carried over). What a checkpoint holds does not
    depend on the zero setting that wrote it (the test above), so this
    also covers a zero 0 checkpoint read into per-layer chunks."""
    for src, out, zero in (("z3", "z3_to_z2", "2"),):
        runs.resume(src, out, 2, "--layout", "serial", "--dp", "2", "--zero", zero)
        got = [s for s in runs.steps(out) if s["step"] > SAVED_STEP]
        want = [s for s in runs.steps(src) if s["step"] > SAVED_STEP]
        assert [s["step"] for s in got] == [SAVED_STEP + 1, SAVED_STEP + 2]
        assert relerr(got[0]["loss"], want[0]["loss"]) < EVAL_RTOL, (got[0], want[0])
        assert relerr(got[1]["loss"], want[1]["loss"]) < STEP_RTOL, (got[1], want[1])
        assert relerr(got[1]["grad_norm"], want[1]["grad_norm"]) < STEP_RTOL, (got[1], want[1])
        _same_tensors(checkpoint_tensors(runs.dir / out), checkpoint_tensors(runs.dir / src), STEP_RTOL)


def test_zero3_bfloat16_resumes_bit_for_bit(runs):
    """bfloat16 with zero 3 (float32 master chunk, 16-bit gathers): the state
    gathered for the step-3 save and scattered on resume continues the run
    bit for bit."""
    resumes_bit_for_bit(runs, ["--layout", "serial", "--dp", "2", "--zero", "3", "--dtype", "bfloat16"])


# --- bad input, info and the cost model -------------------------------------------------


def test_zero23_need_data_parallelism(mpicube, tmp_path):
    """Every rank refuses before any collective; rank 0 says it once (train),
    and info the same way."""
    from test_formats import run_cases

    r = mpicube.run("train", "--layout", "1d", "--zero", "3", "--steps", "1", n=2)
    assert r.returncode == 2, r
    assert r.error_lines() == ["error: --zero 3 shards the optimizer state, gradients and parameters over "
                               "data-parallel replicas and needs --dp 2 or more (got --dp 1)"], r
    args = ["info", "-n", "16", "--dp", "2", "--layout", "1d", "--n-embd", "64", "--n-head", "8"]
    bad, good = run_cases(tmp_path, [["info", "-n", "4", "--zero", "2"], args + ["--zero", "2"]])
    assert bad["status"] == 2 and len(bad["err"]) == 1, bad
    assert "--zero 2 shards the optimizer state and gradients" in bad["err"][0], bad
    assert good["status"] == 0, good
    assert any("optimizer state and gradients sharded over dp (--zero 2)" in x for x in good["out"])
    table = good["out"].index(next(x for x in good["out"] if x.startswith("weights + gradients + optimizer")))
    rows = []
    for line in good["out"][table + 2:]:
        if not line.strip():
            break                                             # the next table (context parallelism) follows
        rows.append(line.split())
    for layout in ("1d", "3d"):                               # tp 8: a line, then a cube
        assert [r[1] for r in rows if r[0] == layout] == list("0123"), rows


PAPER = dict(vocab_size=50304, n_ctx=2048, n_layer=24, n_head=64, n_embd=8192)


def test_cost_model_at_the_papers_scale():
    """64-rank cube x dp 8, batch 128: each --zero setting holds less than
    the one before, zero 3's chunk buffers (master, gradient, moments: C
    each, 2 C) are 1/dp of zero 0's weights + gradients + optimizer state
    up to padding, and on top it holds only the slots: the outside segment
    and two blocks (the current and the prefetched), for weights and for
    gradients."""
    from mpicube.analysis.costmemory import step_memory, step_memory_bytes
    from mpicube.analysis.costmodel import Problem, local_param_sizes
    from mpicube.core.config import ModelConfig
    from mpicube.parallel import zero

    cfg = ModelConfig(**PAPER)
    problems = [Problem(cfg, "3d", 64, 8, 1, 128, 2048, zero=z) for z in range(4)]
    state = [sum(getattr(step_memory_bytes(p), k) for k in ("params", "grads", "optimizer")) for p in problems]
    assert state[0] > state[1] > state[2] > state[3]
    sizes = [(n, s) for n, (s, _) in local_param_sizes(problems[3]).items()]
    segments = zero.segment_sizes(sizes, 8, 3)
    chunk = sum(c for _, _, c in segments)
    block = 8 * segments[1][2]
    outside = 8 * segments[0][2]
    assert segments[0][0] == zero.OUTSIDE and len(segments) == 25
    assert step_memory(problems[3]).optimizer == 2 * chunk
    assert state[3] == 4 * (4 * chunk + 2 * (outside + 2 * block))      # float32: C master + C grad + 2 C moments
    assert 0 <= 16 * chunk - state[0] / 8 < 16 * len(segments)          # padding: < 1 element of C per segment
