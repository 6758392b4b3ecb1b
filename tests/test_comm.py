"""Adjoint identities and counting of the collectives (real mpiexec)."""

import pytest

from mpirun import mpiexec


@pytest.mark.timeout(120)
@pytest.mark.parametrize("ranks", [1, 3, 4])
def test_collective_adjoints(ranks):
    proc = mpiexec(ranks, ["-m", "mpi4py", "tests/comm_check.py"], timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"OK comm adjoints on {ranks} ranks" in proc.stdout
