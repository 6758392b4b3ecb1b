"""The GPU path (``--device gpu``), run on CI's strict CuPy stand-in
(tests/fake_gpu): NumPy memory behind an array type that refuses every
implicit host conversion, as CuPy does, and counts the transfers.

Every layout in float64 with dropout, staged through host buffers and with
MPI reading device memory directly (MPICUBE_CUDA_AWARE=1), at sizes above
the CPU's cache-blocking sizes, equals the serial CPU model to 1e-10; the
command line trains, resumes bit for bit, saves and evaluates on it; a
serial step copies to the host only a fixed handful of scalars; bad GPU
options give one line and exit 2.
"""

import json

import pytest

from conftest import TINY, last_json, read_metrics
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


@pytest.mark.timeout(300)
@pytest.mark.parametrize("cuda_aware", ["0", "1"], ids=["staged", "cuda-aware"])
@pytest.mark.parametrize("ranks,layout,dp,depth", CASES, ids=[f"{c[1]}-n{c[0]}-dp{c[2]}" for c in CASES])
def test_gpu_layout_matches_serial_cpu(ranks, layout, dp, depth, cuda_aware):
    env = {**LARGE, "MPICUBE_CUDA_AWARE": cuda_aware}
    proc = mpiexec(ranks, ["-m", "mpi4py", "tests/parallel_check.py", layout, dp, depth, 0.1, 16], timeout=240,
                   env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"OK {layout} world={ranks} dp={dp} depth={depth} device=gpu" in proc.stdout


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
    for want, got in zip(read_metrics(mpicube.cwd / "cpu")[0], read_metrics(mpicube.cwd / "gpu")[0]):
        assert abs(got["loss"] - want["loss"]) <= 1e-10 * abs(want["loss"])
        assert abs(got["grad_norm"] - want["grad_norm"]) <= 1e-10 * abs(want["grad_norm"])


@pytest.mark.timeout(200)
def test_device_to_host_transfers_per_step_do_not_grow_with_depth(tmp_path, corpus_cache):
    env = {**FAKE_GPU, "MPICUBE_CACHE": str(corpus_cache)}
    proc = mpiexec(1, ["tests/gpu_transfers_check.py", tmp_path, 2, 6], timeout=150, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    counts = json.loads(proc.stdout.strip().splitlines()[-1])
    assert counts["2"] == counts["6"], counts
    assert max(counts["2"]) <= 8, counts


@pytest.mark.timeout(120)
@pytest.mark.parametrize("ranks,layout", [(2, "1d"), (4, "2d")])
def test_staging_buffers_are_reused_across_steps(ranks, layout):
    proc = mpiexec(ranks, ["tests/gpu_staging_check.py", layout], timeout=90, env=FAKE_GPU)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    after = json.loads(proc.stdout.strip().splitlines()[-1])["pinned_allocations_after_step"]
    assert after[0] > 0, after                      # the collectives were staged
    assert after[1] == after[3], after              # and nothing new was pinned after the second step


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
    code = ("import types\nfrom mpicube import backend\nfrom mpicube.errors import UserError\n"
            "print('support', backend.mpi_cuda_support())\n"
            "try:\n    backend.check_cuda_aware(types.SimpleNamespace())\n"
            "except UserError as e:\n    print('refused:', e)\n")
    proc = mpiexec(1, ["-c", code], timeout=40)
    assert "support False" in proc.stdout, proc.stdout + proc.stderr
    assert "refused: MPICUBE_CUDA_AWARE=1, but this MPI" in proc.stdout
