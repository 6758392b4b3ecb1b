"""The GPU path (``--device gpu``), run on CI's strict CuPy stand-in
(tests/fake_gpu): NumPy memory behind an array type that refuses every
implicit host conversion, as CuPy does, and counts the transfers.

Every layout in float64 with dropout, staged through host buffers and with
MPI reading device memory directly (MPICUBE_CUDA_AWARE=1), at sizes above
the CPU's cache-blocking sizes, equals the serial CPU model to 1e-10; every
layout x {float64, float16, bfloat16} x {staged, CUDA-aware} at a small
size equals the serial CPU model of its dtype (one 8-rank launch); the
command line trains, resumes bit for bit, saves and evaluates on it; a
serial step copies to the host only a fixed handful of scalars; bad GPU
options give one line and exit 2.

With MPICUBE_FAKE_GPU_KERNELS=1 the stand-in also runs CUDA source (through
tests/cuda_emu.py's g++ emulation), so mpicube's opt-in CUDA kernels
(MPICUBE_CUDA_KERNELS=1) are checked at their call sites in whole steps:
serial, 1d, 2d and 3d against the serial CPU model, a bitwise resume, and
no extra host copies; each test asserts that every kernel ran on every rank.
"""

import json

import pytest

import cuda_emu
from conftest import TINY, last_json, paired, read_metrics
from mpicube.device import cuda_source
from mpirun import ROOT, mpiexec

FAKE_GPU = {"PYTHONPATH": f"{ROOT / 'tests' / 'fake_gpu'}:{ROOT}"}
LARGE = {**FAKE_GPU, "MPICUBE_CHECK_DEVICE": "gpu", "MPICUBE_CHECK_SIZE": "large"}

CASES = [
    # (ranks, layout, dp, depth)
    (1, "serial", 1, 1),
    (2, "serial", 2, 1),
    (2, "1d", 1, 1),
    (4, "2d", 1, 1),
    (8, "2.5d", 1, 2),
    (8, "3d", 1, 1),
    (8, "2d", 2, 1),
]


# MPI reading device memory directly changes only how comm.py hands buffers
# to MPI, per kind of collective: 1-D's all-reduces, 2-D's broadcasts and
# reduces with a data-parallel all-reduce, 3-D's (nonblocking) all-gathers
# and reduce-scatters cover every kind, so the other layouts run staged only.
CUDA_AWARE_CASES = [(2, "1d", 1, 1), (8, "3d", 1, 1), (8, "2d", 2, 1)]
RUNS = [(*c, "0") for c in CASES] + [(*c, "1") for c in CUDA_AWARE_CASES]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("ranks,layout,dp,depth,cuda_aware", RUNS,
                         ids=[f"{c[1]}-n{c[0]}-dp{c[2]}-{'cuda-aware' if c[4] == '1' else 'staged'}" for c in RUNS])
def test_gpu_layout_matches_serial_cpu(ranks, layout, dp, depth, cuda_aware):
    env = {**LARGE, "MPICUBE_CUDA_AWARE": cuda_aware}
    proc = mpiexec(ranks, ["-m", "mpi4py", "tests/parallel_check.py", layout, dp, depth, 0.1, 16], timeout=240,
                   env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"OK {layout} world={ranks} dp={dp} depth={depth} device=gpu" in proc.stdout


MATRIX = [(layout, dtype, transport) for dtype in ("float64", "float16", "bfloat16")
          for layout in ("serial", "1d", "2d", "2.5d", "3d") for transport in ("staged", "cuda-aware")]


@pytest.mark.timeout(300)
def test_every_layout_dtype_and_transport_matches_serial_cpu():
    """tests/gpu_matrix_check.py: the 30 cases of layout x {float64, float16,
    bfloat16} x {staged, CUDA-aware} in one 8-rank launch, each against the
    serial CPU model of its dtype (1e-10 in float64, parallel_check's 16-bit
    tolerance), with the stand-in's stream-order check on."""
    proc = mpiexec(8, ["-m", "mpi4py", "tests/gpu_matrix_check.py"], timeout=240,
                   env={"PYTHONPATH": f"{ROOT / 'tests' / 'fake_gpu'}:{ROOT}:{ROOT / 'tests'}"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    done = {tuple(line.split()[1:4]) for line in proc.stdout.splitlines() if line.startswith("OK ")}
    assert done == set(MATRIX), sorted(set(MATRIX) - done)


def test_stand_in_is_strict():
    """The checks above mean something only if the stand-in really refuses
    host conversion: np.asarray of a device array must fail."""
    code = "import cupy, numpy; a = cupy.zeros(3)\ntry:\n    numpy.asarray(a)\nexcept TypeError:\n    print('refused')"
    proc = mpiexec(1, ["-c", code], timeout=60, env=FAKE_GPU)
    assert "refused" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.timeout(200)
def test_gpu_train_resume_is_bitwise_and_checkpoints_evaluate_anywhere(mpicube, tiny_shard):
    common = [*TINY[2:], "--layout", "1d", "--steps", "6", "--dropout", "0.1", "--data", tiny_shard,
              "--device", "gpu", "--log-every", "1"]
    straight = mpicube.run("train", *common, "--out", "straight", n=2, env=FAKE_GPU)
    assert straight.returncode == 0, straight
    first = mpicube.run("train", *common, "--out", "split", "--stop-after", "3", n=2, env=FAKE_GPU)
    assert first.returncode == 0, first
    second = mpicube.run("train", *common, "--out", "split", "--resume", n=2, env=FAKE_GPU)
    assert second.returncode == 0, second
    want = [r["loss"] for r in read_metrics(mpicube.cwd / "straight")[0]]
    got = [r["loss"] for r in read_metrics(mpicube.cwd / "split")[0]]
    assert len(want) == 6 and got == want                      # bit for bit

    ckpt = mpicube.cwd / "straight"
    on_gpu = mpicube.run("eval", ckpt, "--data", tiny_shard, "--batches", "2", "--device", "gpu", n=2,
                         env=FAKE_GPU)
    on_cpu = mpicube.run("eval", ckpt, "--data", tiny_shard, "--batches", "2", "--layout", "serial")
    assert on_gpu.returncode == 0 and on_cpu.returncode == 0, (on_gpu, on_cpu)
    a, b = last_json(on_gpu.stdout)["loss"], last_json(on_cpu.stdout)["loss"]
    assert abs(a - b) <= 1e-5 * abs(b), (a, b)                 # float32, different reduction orders


@pytest.mark.timeout(200)
def test_gpu_training_follows_cpu_in_float64(mpicube, tiny_shard):
    common = [*TINY, "--steps", "4", "--dropout", "0.1", "--data", tiny_shard, "--dtype", "float64"]
    cpu = mpicube.run("train", *common, "--out", "cpu")
    gpu = mpicube.run("train", *common, "--out", "gpu", "--device", "gpu", env=FAKE_GPU)
    assert cpu.returncode == 0 and gpu.returncode == 0, (cpu, gpu)
    for want, got in paired(read_metrics(mpicube.cwd / "cpu")[0], read_metrics(mpicube.cwd / "gpu")[0]):
        assert abs(got["loss"] - want["loss"]) <= 1e-10 * abs(want["loss"])
        assert abs(got["grad_norm"] - want["grad_norm"]) <= 1e-10 * abs(want["grad_norm"])


@pytest.mark.timeout(200)
def test_device_to_host_transfers_per_step_do_not_grow_with_depth(tmp_path, corpus_cache):
    env = {**FAKE_GPU, "MPICUBE_CACHE": str(corpus_cache)}
    proc = mpiexec(1, ["tests/gpu_transfers_check.py", tmp_path, 2, 6], timeout=150, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    counts = json.loads(proc.stdout.strip().splitlines()[-1])
    assert counts["2"] == counts["6"], counts
    assert max(counts["2"]) <= 2, counts          # the README's promise: the loss and the gradient norm


@pytest.mark.timeout(120)
@pytest.mark.parametrize("ranks,layout", [(2, "1d"), (4, "2d")])
def test_staging_buffers_are_reused_across_steps(ranks, layout):
    proc = mpiexec(ranks, ["tests/gpu_staging_check.py", layout], timeout=90, env=FAKE_GPU)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    after = json.loads(proc.stdout.strip().splitlines()[-1])["pinned_allocations_after_step"]
    assert after[0] > 0, after                      # the collectives were staged
    assert after[1] == after[3], after              # and nothing new was pinned after the second step


FP8_RECIPES = [["tensorwise"], ["delayed"], ["rowwise", "--fp8-pow2"], ["blockwise", "--fp8-block", "4"],
               ["mxfp8", "--fp8-block", "4"]]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("recipe", FP8_RECIPES, ids=[r[0] for r in FP8_RECIPES])
def test_gpu_fp8_operands_are_the_cpus_bytes(mpicube, recipe):
    """--fp8 on the GPU path: CuPy has no FP8 type, so its values are
    rounded by ops/fp8.round_to_format's bit arithmetic (float32 holding
    FP8 values, E8M0 scales as bytes). Every linear's quantized bytes and
    scales in a 2-step trace equal the CPU's (ml_dtypes' casts) exactly,
    and everything else to compare's float64 budget - but for the
    elements of rounding noise around an exact zero that is a difference of
    sums (a query's score gradients where a sequence repeats a token),
    which the GPU's attention (array code) sums in another order than the
    CPU's numba kernels: ``noise`` in tests/fp8_operands.differences,
    docs/fp8.md "Across layouts"."""
    import h5py
    from fp8_operands import differences

    from mpicube.check.compare import compare_traces
    from mpicube.training.fp8_options import fp8_recipe

    common = ["trace", *TINY, "--arch", "llama", "--dtype", "float64", "--steps", "2", "--fp8", *recipe]
    cpu = mpicube.run(*common, "--out", "cpu.h5")
    gpu = mpicube.run(*common, "--out", "gpu.h5", "--device", "gpu", env=FAKE_GPU)
    assert cpu.returncode == 0 and gpu.returncode == 0, (cpu, gpu)
    off = [r.name for r in compare_traces(mpicube.cwd / "cpu.h5", mpicube.cwd / "gpu.h5").rows if not r.ok]
    assert all("/fp8/" in name and "/dy." in name for name in off), off
    with h5py.File(mpicube.cwd / "cpu.h5") as a, h5py.File(mpicube.cwd / "gpu.h5") as b:
        names = []
        a.visit(lambda name: names.append(name) if "/fp8/" in f"/{name}" and isinstance(a[name], h5py.Dataset)
                else None)
        assert len(names) >= 8, names                   # bytes and scales of the block's linears
        block = int(recipe[recipe.index("--fp8-block") + 1]) if "--fp8-block" in recipe else None
        wrong = differences({n: b[n][()] for n in names}, {n: a[n][()] for n in names},
                            fp8_recipe(recipe[0], "float64", block=block), noise=1e-10)
        assert not wrong, wrong[:3]


def _error(result):
    lines = result.error_lines()
    assert result.returncode == 2 and len(lines) == 1 and "Traceback" not in result.stderr, result
    return lines[0]


@pytest.mark.timeout(120)
def test_bad_gpu_options_give_one_line(mpicube, tiny_shard):
    args = ["train", *TINY, "--steps", "2", "--data", tiny_shard]
    two = ["--dp", "2"]                                    # two ranks: the message still comes once
    assert "needs CuPy" in _error(mpicube.run(*args, *two, "--device", "gpu", "--out", "a", n=2))
    no_gpu = {**FAKE_GPU, "MPICUBE_FAKE_GPU_COUNT": "0"}
    assert "no usable CUDA device" in _error(mpicube.run(*args, *two, "--device", "gpu", "--out", "b", n=2,
                                                         env=no_gpu))
    assert "--tf32 applies to GPUs" in _error(mpicube.run(*args, "--tf32", "--out", "c"))
    bad_kernels = {**FAKE_GPU, "MPICUBE_CUDA_KERNELS": "maybe"}
    assert "MPICUBE_CUDA_KERNELS" in _error(mpicube.run(*args, "--device", "gpu", "--out", "d", env=bad_kernels))


@pytest.mark.timeout(60)
def test_cuda_aware_request_is_refused_when_mpi_says_no():
    """The MPICH wheel answers MPIX_GPU_query_support with "no": asking for
    CUDA-aware MPI with a real CuPy would crash in the first collective, so
    the check refuses it (the stand-in is exempt: its memory is host memory)."""
    code = ("import types\nfrom mpicube.device import backend\nfrom mpicube.core.errors import UserError\n"
            "print('support', backend.mpi_cuda_support())\n"
            "try:\n    backend.check_cuda_aware(types.SimpleNamespace())\n"
            "except UserError as e:\n    print('refused:', e)\n")
    proc = mpiexec(1, ["-c", code], timeout=40)
    assert "support False" in proc.stdout, proc.stdout + proc.stderr
    assert "refused: MPICUBE_CUDA_AWARE=1, but this MPI" in proc.stdout


# --- mpicube's CUDA kernels at their call sites, on the stand-in --------------------
# MPICUBE_FAKE_GPU_KERNELS=1 gives the stand-in a cupy.RawModule that runs the
# kernels' CUDA source through tests/cuda_emu.py's g++ emulation, so
# MPICUBE_CUDA_KERNELS=1 takes them inside whole steps. Every rank reports its
# launches per kernel (MPICUBE_FAKE_GPU_REPORT): each kernel must have run on
# every rank, or the check passed on the array path and means nothing.
KERNEL_CASES = [(1, "serial"), (2, "1d"), (4, "2d"), (8, "3d")]


@pytest.fixture(scope="session")
def emulated_kernels(tmp_path_factory):
    """The stand-in's kernel environment, the libraries compiled once here
    (so ranks never wait on g++ inside a launch's time limit)."""
    if cuda_emu.compiler() is None:
        pytest.skip("no g++: the stand-in cannot run CUDA source without it")
    cache = tmp_path_factory.mktemp("cuda-emu")
    for dtype in ("float32", "float64"):
        cuda_emu.build(cuda_source.source(dtype), cache)
    return {**FAKE_GPU, "MPICUBE_FAKE_GPU_KERNELS": "1", "MPICUBE_CUDA_KERNELS": "1",
            "MPICUBE_FAKE_GPU_KERNEL_CACHE": str(cache)}


# The causal softmax kernels serve today's T x T attention only, which
# MPICUBE_ATTENTION=full selects; the default blockwise attention
# (ops.attention_blocks) runs as array code.
FULL_ATTENTION_KERNELS = {"softmax_causal", "softmax_causal_backward"}


def kernel_launches(report, ranks: int, full_attention: bool = False) -> list:
    """Per process: {kernel: launches}; checks each of ``ranks`` processes
    ran every kernel (the full-attention ones only if ``full_attention``)."""
    counts = [json.loads(p.read_text())["launches"] for p in report.parent.glob(report.name + ".*")]
    assert len(counts) == ranks, counts
    every = set(cuda_emu.kernels(cuda_source.source("float64")))
    if not full_attention:
        every -= FULL_ATTENTION_KERNELS
    for launches in counts:
        assert {k for k, n in launches.items() if n > 0} == every, launches
    return counts


@pytest.mark.timeout(300)
@pytest.mark.parametrize("ranks,layout", KERNEL_CASES, ids=[c[1] for c in KERNEL_CASES])
def test_cuda_kernels_in_whole_steps_match_serial_cpu(ranks, layout, emulated_kernels, tmp_path):
    report = tmp_path / "launches"
    env = {**emulated_kernels, "MPICUBE_CHECK_DEVICE": "gpu", "MPICUBE_FAKE_GPU_REPORT": str(report)}
    full = layout == "serial"                      # one case runs the T x T attention and its softmax kernels
    if full:
        env["MPICUBE_ATTENTION"] = "full"
    proc = mpiexec(ranks, ["-m", "mpi4py", "tests/parallel_check.py", layout, 1, 1, 0.1, 8], timeout=240, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"OK {layout} world={ranks} dp=1 depth=1 device=gpu dtype=float64" in proc.stdout
    kernel_launches(report, ranks, full_attention=full)


@pytest.mark.timeout(300)
def test_cuda_kernels_train_resume_bitwise(mpicube, tiny_shard, emulated_kernels, tmp_path):
    common = [*TINY[2:], "--layout", "1d", "--steps", "6", "--dropout", "0.1", "--data", tiny_shard,
              "--device", "gpu", "--log-every", "1"]
    runs = [("straight", []), ("split", ["--stop-after", "3"]), ("split", ["--resume"])]
    mpicube.env["MPIEXEC_TIMEOUT"] = "150"                     # emulated kernels: slower than the array path
    for i, (out, extra) in enumerate(runs):
        env = {**emulated_kernels, "MPICUBE_FAKE_GPU_REPORT": str(tmp_path / f"run{i}")}
        result = mpicube.run("train", *common, "--out", out, *extra, n=2, env=env, timeout=200)
        assert result.returncode == 0, result
        kernel_launches(tmp_path / f"run{i}", 2)
    want = [r["loss"] for r in read_metrics(mpicube.cwd / "straight")[0]]
    got = [r["loss"] for r in read_metrics(mpicube.cwd / "split")[0]]
    assert len(want) == 6 and got == want                      # bit for bit


@pytest.mark.timeout(200)
def test_cuda_kernels_copy_nothing_more_to_the_host(emulated_kernels, tmp_path, corpus_cache):
    """The kernels' launches take host scalars only: a serial step copies to
    the host exactly what it copies on the array path."""
    counts = {}
    for on in ("0", "1"):
        env = {**emulated_kernels, "MPICUBE_CUDA_KERNELS": on, "MPICUBE_CACHE": str(corpus_cache),
               "MPICUBE_FAKE_GPU_REPORT": str(tmp_path / f"kernels{on}")}
        proc = mpiexec(1, ["tests/gpu_transfers_check.py", tmp_path / f"kernels{on}", 2], timeout=150, env=env)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        counts[on] = json.loads(proc.stdout.strip().splitlines()[-1])["2"]
    kernel_launches(tmp_path / "kernels1", 1)
    assert counts["1"] == counts["0"], counts

