"""Adjoint identities and counting of the collectives, and the 16-bit wire sums (real mpiexec)."""

import pytest

from mpirun import ROOT, mpiexec


@pytest.mark.timeout(120)
@pytest.mark.parametrize("ranks", [1, 3, 4])
def test_collective_adjoints(ranks):
    proc = mpiexec(ranks, ["-m", "mpi4py", "tests/comm_check.py"], timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"OK comm adjoints on {ranks} ranks" in proc.stdout


FAKE_GPU = {"PYTHONPATH": f"{ROOT / 'tests' / 'fake_gpu'}:{ROOT}"}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_16bit_wire_sums_equal_the_rounded_partials_summed_in_rank_order(ranks):
    """comm_wire's reduce-scatter, all-reduce (padded or not) and reduce in
    float16 and bfloat16 against the exact expected bits and MPI's own
    float32 sum, with their counts; a float32/float64 wire is plain MPI."""
    pytest.importorskip("ml_dtypes")
    proc = mpiexec(ranks, ["-m", "mpi4py", "tests/comm_wire_check.py"], timeout=90)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"OK comm wire on {ranks} ranks device=cpu" in proc.stdout


@pytest.mark.timeout(120)
@pytest.mark.parametrize("cuda_aware", ["0", "1"], ids=["staged", "cuda-aware"])
def test_16bit_wire_sums_on_the_gpu_stand_in(cuda_aware):
    """The same on CI's CuPy stand-in (float16): through pinned staging
    buffers, and with device buffers handed to a CUDA-aware MPI."""
    pytest.importorskip("ml_dtypes")
    env = {**FAKE_GPU, "MPICUBE_CUDA_AWARE": cuda_aware}
    proc = mpiexec(3, ["-m", "mpi4py", "tests/comm_wire_check.py", "gpu"], timeout=90, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "OK comm wire on 3 ranks device=gpu" in proc.stdout


@pytest.mark.timeout(120)
@pytest.mark.parametrize("ranks,layout", [(2, "1d"), (4, "2d")])
def test_16bit_wire_staging_buffers_are_reused_across_steps(ranks, layout):
    """Whole float16 steps on the stand-in, staged: the wire sums' pinned
    buffers (all-to-all, all-gather, gather) come back to the pool, so
    nothing new is pinned after the second step."""
    import json

    proc = mpiexec(ranks, ["tests/gpu_staging_check.py", layout, "float16"], timeout=90, env=FAKE_GPU)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    after = json.loads(proc.stdout.strip().splitlines()[-1])["pinned_allocations_after_step"]
    assert after[0] > 0, after
    assert after[1] == after[3], after
