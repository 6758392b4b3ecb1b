"""Every layout follows the serial model (float64, relative 1e-10): loss,
logits, every parameter gradient and the parameters after three AdamW steps,
with dropout on; and its measured communication equals the cost model
exactly. See tests/parallel_check.py for what each run checks.

Each layout on its smallest communicating grid (1-D p 2, 2-D q 2, 2.5-D
q 2 d 2, 3-D q 2), with and without dp, runs in tests/test_combo_matrix.py
composed with the other axes; here the grids it does not hold: larger
groups (1-D p 4, q = 3) and grids of one rank, the blocking path, the
fused kernels."""

import pytest

from mpirun import mpiexec

CASES = [
    # (ranks, layout, dp, depth): the grids tests/test_combo_matrix.py does not hold
    (4, "1d", 1, 1),      # a 1-D group of 4
    (9, "2d", 1, 1),      # q = 3: padded panels
    (27, "3d", 1, 1),
    (1, "3d", 1, 1),      # grids of one rank: "gathered" panels are the parameters themselves
    (2, "2d", 2, 1),
]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("ranks,layout,dp,depth", CASES, ids=[f"{c[1]}-n{c[0]}-dp{c[2]}-d{c[3]}" for c in CASES])
def test_layout_matches_serial(ranks, layout, dp, depth):
    proc = mpiexec(ranks, ["-m", "mpi4py", "tests/parallel_check.py", layout, dp, depth, 0.1], timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"OK {layout} world={ranks} dp={dp} depth={depth}" in proc.stdout


@pytest.mark.timeout(240)
def test_cube_without_overlap_matches_serial():
    """The blocking path of the 3-D linears (MPICUBE_OVERLAP=0) is checked too."""
    proc = mpiexec(8, ["-m", "mpi4py", "tests/parallel_check.py", "3d", 1, 1, 0.1], timeout=180,
                   env={"MPICUBE_OVERLAP": "0"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "OK 3d world=8 dp=1 depth=1" in proc.stdout


OVERLAP_CASES = [(2, "1d", 1), (4, "2d", 1), (8, "2.5d", 2)]   # 3-D's blocking path: the test above


@pytest.mark.timeout(240)
@pytest.mark.parametrize("ranks,layout,depth", OVERLAP_CASES, ids=[f"{c[1]}-n{c[0]}" for c in OVERLAP_CASES])
def test_overlap_is_bit_identical_to_the_blocking_path(ranks, layout, depth):
    """1-D's nonblocking dX all-reduce and SUMMA's double-buffered panels
    (2-D, 2.5-D) give the results of MPICUBE_OVERLAP=0 bit for bit, with
    the same traffic (tests/overlap_check.py): so the blocking path follows
    serial wherever the cases above show the overlapped one does. With the
    1-D launch, a mixture's experts over dp = ep = 2 computing their own
    rows while the all-to-all carries the others do too."""
    moe = ["moe"] if layout == "1d" else []        # and a mixture with dp = ep = 2 (model/moe_experts.py)
    proc = mpiexec(ranks, ["-m", "mpi4py", "tests/overlap_check.py", layout, depth] + moe, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"OK overlap {layout} world={ranks} depth={depth}: bit-identical" in proc.stdout
    assert ("OK overlap moe serial world=2 dp=2 ep=2: bit-identical" in proc.stdout) == bool(moe)


FUSED_EVERYWHERE = {"MPICUBE_KERNELS": "numba", "MPICUBE_FUSED_MIN_ELEMS": "0", "OMP_NUM_THREADS": "2"}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("ranks,layout", [(2, "1d"), (4, "2d"), (8, "3d")])
def test_layout_matches_serial_with_fused_kernels(ranks, layout):
    """With the fused CPU kernels forced on at every size (two threads per
    rank), including LayerNorm statistics summed over a split hidden size and
    attention batches of one sequence split by heads, each layout still
    follows serial."""
    pytest.importorskip("numba")
    proc = mpiexec(ranks, ["-m", "mpi4py", "tests/parallel_check.py", layout, 1, 1, 0.1], timeout=180,
                   env=FUSED_EVERYWHERE)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"OK {layout} world={ranks} dp=1 depth=1" in proc.stdout
