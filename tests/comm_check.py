"""Run under mpiexec: adjoint identities of the counted collectives.

For a linear map A between distributed vectors, <A x, y> = <x, A* y> with
the inner products summed over ranks. All-gather and reduce-scatter are
adjoint (along any axis), so are broadcast and reduce; all-reduce is
self-adjoint. Also checks the elements counted against the ring formulas.
"""

from fractions import Fraction

import numpy as np
from mpi4py import MPI

from mpicube.device.backend import make_backend
from mpicube.parallel.comm import Comm, Counters
from mpicube.parallel.comm_start import iallreduce, ibcast

world = MPI.COMM_WORLD
backend = make_backend("cpu", "float64")
counters = Counters()
comm = Comm(world, "x", backend, counters)
g, rank = comm.size, comm.rank
rng = np.random.default_rng(100 + rank)


def dot(a, b):
    """Inner product summed over every rank."""
    return world.allreduce(float(np.vdot(a, b)), op=MPI.SUM)


def check(name, lhs, rhs):
    assert abs(lhs - rhs) <= 1e-12 * max(1.0, abs(lhs)), f"{name}: {lhs} != {rhs}"


for axis in (0, 1, -1):
    shape = [2, 3, 4]
    x = rng.normal(size=shape)
    gathered = list(shape)
    gathered[axis] *= g
    y = rng.normal(size=gathered)
    counters.reset()
    ax = comm.allgather(x, axis=axis)
    assert counters.elems["x"] == (g - 1) * x.size and counters.msgs["x"] == g - 1
    counters.reset()
    aty = comm.reduce_scatter(y, axis=axis)
    assert counters.elems["x"] == Fraction(g - 1, g) * y.size and counters.msgs["x"] == g - 1
    assert ax.shape == tuple(gathered) and aty.shape == tuple(shape)
    check(f"all-gather/reduce-scatter axis {axis}", dot(ax, y), dot(x, aty))

# the nonblocking variants return and count exactly what the blocking ones do
x, y = rng.normal(size=(2, 3)), rng.normal(size=(2 * g, 3))
counters.reset()
assert np.array_equal(comm.iallgather(x).wait(), comm.allgather(x))
assert np.array_equal(comm.iallgather(x, axis=1).wait(), comm.allgather(x, axis=1))
assert np.array_equal(comm.ireduce_scatter(y).wait(), comm.reduce_scatter(y))
assert counters.elems["x"] == 2 * (2 * (g - 1) * x.size + Fraction(g - 1, g) * y.size)
assert counters.msgs["x"] == 6 * (g - 1)
z = rng.normal(size=(2, 3 * g))
assert np.array_equal(comm.ireduce_scatter(z, axis=1).wait(), comm.reduce_scatter(z, axis=1))

# comm_start's iallreduce and ibcast too (with two started at once, as SUMMA's double
# buffering and 1-D's backward post them), each counted as its blocking form
x = rng.normal(size=(4, 3))
counters.reset()
want_sum, want_max = comm.allreduce(x), comm.allreduce(x, "max")
want_b = [comm.bcast(x, root=root) for root in range(g)]
blocking = (counters.elems["x"], counters.bytes["x"], counters.msgs["x"])
counters.reset()
pending = [iallreduce(comm, x), iallreduce(comm, x, "max")] + [ibcast(comm, x, root=root) for root in range(g)]
got = [p.wait() for p in pending]
assert (counters.elems["x"], counters.bytes["x"], counters.msgs["x"]) == blocking
for a, b in zip(got, [want_sum, want_max] + want_b):
    assert np.array_equal(a, b) and a.dtype == b.dtype
assert got[0] is not x, "iallreduce must not reduce into its input"

for root in range(g):
    x, y = rng.normal(size=(5, 2)), rng.normal(size=(5, 2))
    counters.reset()
    bx = comm.bcast(x, root=root)
    rty = comm.reduce(y, root=root)
    assert counters.elems["x"] == (2 * x.size if g > 1 else 0) and counters.msgs["x"] == 2 * (g - 1)
    # the map reads x only on the root; its adjoint writes only there
    x_used = x if rank == root else np.zeros_like(x)
    rty_full = rty if rank == root else np.zeros_like(y)
    check(f"bcast/reduce root {root}", dot(bx, y), dot(x_used, rty_full))

x, y = rng.normal(size=7), rng.normal(size=7)
counters.reset()
check("all-reduce self-adjoint", dot(comm.allreduce(x), y), dot(x, comm.allreduce(y)))
assert counters.elems["x"] == 2 * Fraction(2 * (g - 1), g) * 7 and counters.msgs["x"] == 4 * (g - 1)
expected_max = np.empty_like(x)
world.Allreduce(x, expected_max, op=MPI.MAX)
assert np.array_equal(comm.allreduce(x, "max"), expected_max)

world.Barrier()
if rank == 0:
    print(f"OK comm adjoints on {g} ranks")
