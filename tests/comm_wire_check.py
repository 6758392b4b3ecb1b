"""Run under mpiexec: the 16-bit wire sums (mpicube.parallel.comm_wire) against plain
MPI sums of the same data.

Every rank can regenerate every other rank's input from its seed, so the
exact expected result is computed locally: the g partials rounded to the
wire format, added in float32 in rank order. The collectives must equal it
bit for bit, be identical on every rank, lie within g * u * max|partial| of
MPI's own float32 sum, and count elements, bytes and messages as the table
in comm_wire's docstring says. A wire equal to the data's format must be
the plain MPI reduction, bit for bit.

Usage: python -m mpi4py tests/comm_wire_check.py [gpu]   (gpu: CuPy or CI's stand-in)
"""

import sys
from fractions import Fraction

import ml_dtypes
import numpy as np
from mpi4py import MPI

from mpicube.device.backend import make_backend
from mpicube.parallel.comm import Comm, Counters

world = MPI.COMM_WORLD
g, rank = world.size, world.rank
DEVICE = sys.argv[1] if len(sys.argv) > 1 else "cpu"
backend = make_backend(DEVICE, "float32")
xp, host = backend.xp, backend.to_host
counters = Counters()
comm = Comm(world, "x", backend, counters)
WIRES = (np.dtype(np.float16),) if DEVICE == "gpu" else (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))


def data(shape, seed):
    """Rank ``seed``'s float32 input, with a spread of magnitudes."""
    rng = np.random.default_rng([seed, *shape])
    return (rng.normal(size=shape) * np.exp(rng.normal(size=shape))).astype(np.float32)


def wire_sum(parts, wire):
    """What the wire collectives compute: each partial rounded once, float32
    sum in rank order (a group of one moves nothing and returns its input)."""
    if len(parts) == 1:
        return parts[0]
    total = parts[0].astype(wire).astype(np.float32)
    for p in parts[1:]:
        total += p.astype(wire).astype(np.float32)
    return total


def same_everywhere(name, a):
    """Every rank holds the identical bytes of ``a``."""
    mine = np.ascontiguousarray(a).tobytes()
    assert all(other == mine for other in world.allgather(mine)), f"{name}: ranks disagree"


def near_mpi_sum(name, got, x, wire, block=None, rounded=False):
    """Within g u max|partial| of MPI's own float32 sum (each partial's
    rounding error is at most u), plus u |sum| if the sum is rounded too."""
    plain = np.empty_like(x)
    world.Allreduce(x, plain, op=MPI.SUM)
    if block is not None:
        plain = plain[block]
    u = {"float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}[wire.name]
    bound = g * u * world.allreduce(float(np.abs(x).max()), op=MPI.MAX) + rounded * u * np.abs(plain).max()
    if got is None:                     # not the root of a reduce: took part in the sums above only
        return
    assert np.abs(got.astype(np.float64) - plain).max() <= bound, f"{name}: off the float32 sum"


def counted(elems, msgs, width):
    assert counters.elems["x"] == elems, (counters.elems["x"], elems)
    assert counters.bytes["x"] == elems * width, (counters.bytes["x"], elems * width)
    assert counters.msgs["x"] == msgs, (counters.msgs["x"], msgs)
    counters.reset()


for wire in WIRES:
    # reduce-scatter along the first and a later axis, blocking and not
    for axis, shape in ((0, (3 * g, 5)), (1, (2, 4 * g, 3)), (-1, (3, 2 * g))):
        everyone = [data(shape, k) for k in range(g)]
        x = everyone[rank]
        want = np.split(wire_sum(everyone, wire), g, axis=axis)[rank]
        counters.reset()
        got = host(comm.reduce_scatter(xp.asarray(x), axis=axis, wire=wire))
        assert got.dtype == np.float32 and np.array_equal(got, want), f"reduce-scatter {wire} axis {axis}"
        counted(Fraction(g - 1, g) * x.size if g > 1 else 0, g - 1, 2)
        pending = comm.ireduce_scatter(xp.asarray(x), axis=axis, wire=wire)
        assert np.array_equal(host(pending.wait()), want), f"ireduce-scatter {wire} axis {axis}"
        counted(Fraction(g - 1, g) * x.size if g > 1 else 0, g - 1, 2)
        index = [slice(None)] * x.ndim
        index[axis] = slice(rank * x.shape[axis] // g, (rank + 1) * x.shape[axis] // g)
        near_mpi_sum(f"reduce-scatter {wire}", got, x, wire, tuple(index))
        # a 16-bit input is summed the same way and rounded back to its format
        x16 = x.astype(wire)
        got16 = host(comm.reduce_scatter(xp.asarray(x16), axis=axis, wire=wire))
        assert got16.dtype == wire and np.array_equal(got16.view(np.uint16), want.astype(wire).view(np.uint16))
        counters.reset()

    # all-reduce: sizes that do and do not divide by g (zero padding)
    for shape in ((2 * g, 3), (7,), (1, 5, 3)):
        everyone = [data(shape, 10 + k) for k in range(g)]
        x = everyone[rank]
        want = wire_sum(everyone, wire)
        want = want.astype(wire).astype(np.float32) if g > 1 else want    # the sums, rounded to the wire
        got = host(comm.allreduce(xp.asarray(x), wire=wire))
        assert got.dtype == np.float32 and got.shape == x.shape and np.array_equal(got, want), f"all-reduce {shape}"
        same_everywhere(f"all-reduce {shape}", got)
        chunk = -(-x.size // g)
        counted(2 * (g - 1) * chunk if g > 1 else 0, 2 * (g - 1), 2)
        near_mpi_sum(f"all-reduce {wire}", got, x, wire, rounded=True)

    # reduce onto each root in turn: the rounded sums there, the same count on every rank
    for root in range(g):
        everyone = [data((4, 3), 20 + root * g + k) for k in range(g)]
        x = everyone[rank]
        got = comm.reduce(xp.asarray(x), root=root, wire=wire)
        if g == 1:
            assert np.array_equal(host(got), x)
            continue
        if rank == root:
            want = wire_sum(everyone, wire).astype(wire).astype(np.float32)
            assert host(got).dtype == np.float32 and np.array_equal(host(got), want), f"reduce root {root}"
        else:
            assert got is None
        near_mpi_sum(f"reduce {wire}", host(got) if rank == root else None, x, wire, rounded=True)
        counted(2 * (g - 1) * -(-x.size // g), 2 * (g - 1), 2)
    if g > 1:
        try:
            comm.allreduce(xp.asarray(data((4,), 0)), "max", wire=wire)
        except ValueError:
            pass
        else:
            raise AssertionError("a max over a 16-bit wire must be refused")
    counters.reset()

# a wire in the data's own format is the plain MPI reduction, bit for bit
for dtype in (np.float32, np.float64):
    b = make_backend(DEVICE, np.dtype(dtype).name)
    c = Comm(world, "x", b, counters)
    x = data((2 * g, 3), rank).astype(dtype)
    for plain, wired in ((c.allreduce(b.xp.asarray(x)), c.allreduce(b.xp.asarray(x), wire=dtype)),
                         (c.reduce_scatter(b.xp.asarray(x)), c.reduce_scatter(b.xp.asarray(x), wire=dtype))):
        assert np.array_equal(b.to_host(plain), b.to_host(wired)) and b.to_host(wired).dtype == dtype
    counters.reset()
    c.allreduce(b.xp.asarray(x), wire=dtype)
    counted(Fraction(2 * (g - 1), g) * x.size if g > 1 else 0, 2 * (g - 1), np.dtype(dtype).itemsize)

world.Barrier()
if rank == 0:
    print(f"OK comm wire on {g} ranks device={DEVICE}")
