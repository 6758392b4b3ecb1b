"""Sums that travel in 16 bits: the reductions of ``mpicube.parallel.comm`` with a
16-bit *wire format* (part of the comm layer; only ``Comm`` calls these).

MPI has no float16 or bfloat16 sum, and a user-defined MPI operation would
run a Python callback per message and round every partial sum. So the data
move as raw 2-byte words through MPI's plain data-movement collectives, and
the arithmetic happens at the receiver, in float32:

* reduce-scatter = all-to-all of the g 16-bit blocks, then each rank adds
  the g blocks it received in float32, in rank order;
* all-reduce = the same over the flattened array (zero-padded to a multiple
  of g), then an all-gather of the sums rounded to 16 bits, so every rank
  holds the identical result;
* reduce onto a root = the same all-to-all and float32 sums, then a gather
  of the 16-bit-rounded sums onto the root (Rabenseifner's reduce). Not a
  gather of the g partials with the sum at the root: the root's link would
  carry (g-1) partials per call, more bytes than the float32 reduce it
  replaces once g > 2 (the counting below prices a collective by its
  busiest link, as for broadcast); this way every link carries
  2 (g-1)/g of the data at 2 bytes, less than float32's 4 for any g.

Every partial is rounded to the wire format once (the caller's own block
too, so the result does not depend on which rank owns it), and every sum
runs in the same order on every rank and in every run: the results are
deterministic and bitwise reproducible. A reduce-scatter returns the
float32 sums (rounded to the input's format if that is 16-bit); an
all-reduce and a reduce return the 16-bit-rounded sums, in the input's
format (so a weight-gradient block summed by SUMMA's reduce is rounded to
16 bits once before it is added to the float32 gradient; the 3-D layout's
weight-gradient reduce-scatter keeps the float32 sum).

Counting, per rank, as the data travel (same conventions as ``comm``):

=================  ==============================  ============================
collective         elements moved                  messages
=================  ==============================  ============================
reduce-scatter     (g-1)/g * input size            g-1 (all-to-all)
all-reduce         2 (g-1) * ceil(n/g)             2 (g-1) (all-to-all + all-gather)
reduce             2 (g-1) * ceil(n/g)             2 (g-1) (all-to-all + gather)
=================  ==============================  ============================

at 2 bytes each, the same on every rank. For a multiple of g elements the
first two are exactly the ring figures of a float32 reduction; a reduce
moves 2 (g-1)/g n elements where the float32 reduce is counted n, in twice
the messages.
"""

from __future__ import annotations

from fractions import Fraction

from ..device import precision
from .waiting import complete


def _blocks(xp, x, g, axis):
    """x as (g, *block): its g blocks along ``axis`` one after another."""
    if axis % x.ndim == 0:
        return x.reshape((g, x.shape[0] // g) + tuple(x.shape[1:]))
    return xp.stack(xp.split(x, g, axis=axis))


def _sum_rows(xp, parts):
    """parts (g, *block) in the wire format -> float32 (*block): the g rows
    added one after another in rank order (the same order everywhere)."""
    total = parts[0].astype(xp.float32)
    for k in range(1, parts.shape[0]):
        total += parts[k].astype(xp.float32)
    return total


def _words(comm, x, wire):
    """x rounded to the wire format, as a contiguous uint16 buffer for MPI."""
    xp = comm.backend.xp
    return comm._to_mpi(xp.ascontiguousarray(precision.narrow(x, wire)).view(xp.uint16))


def _alltoall_start(comm, x, axis, wire, nonblocking=False, kind: str = "alltoall (16-bit)"):
    """Start the all-to-all of x's 16-bit blocks; returns (request or None,
    send, recv, t0). recv (g, *block) receives block ``rank`` of every
    rank; t0 is the clock after the stream was synchronised on the built
    send buffer (``Comm._start``), right before the MPI call."""
    send = _words(comm, _blocks(comm.backend.xp, x, comm.size, axis), wire)
    recv = comm._empty(send.shape, send.dtype)
    t0 = comm._start(kind)
    if nonblocking:
        return comm.mpi.Ialltoall(send, recv), send, recv, t0
    complete(comm.mpi.Ialltoall(send, recv))
    return None, send, recv, t0


def _summed(comm, recv, wire):
    """float32 sum, in rank order, of the received 16-bit blocks."""
    parts = comm._from_mpi(recv).view(wire)                 # (g, *block)
    return _sum_rows(comm.backend.xp, parts)


def reduce_scatter(comm, x, axis, wire):
    _, send, recv, t0 = _alltoall_start(comm, x, axis, wire, kind="reduce_scatter (16-bit)")
    g = comm.size
    comm._count(Fraction(g - 1, g) * x.size, g - 1, t0, 2)
    comm._done(send)
    return precision.narrow(_summed(comm, recv, wire), x.dtype)


def ireduce_scatter(comm, x, axis, wire, pending_cls):
    request, send, recv, t0 = _alltoall_start(comm, x, axis, wire, nonblocking=True,
                                              kind="ireduce_scatter (16-bit)")
    g = comm.size
    comm._count(Fraction(g - 1, g) * x.size, g - 1, t0, 2)

    def finish():
        complete(request)
        comm._done(send)
        return precision.narrow(_summed(comm, recv, wire), x.dtype)

    return pending_cls(finish, comm, send, "ireduce_scatter (16-bit)")


def _chunk_sums(comm, x, wire, kind: str):
    """The first half of an all-reduce or reduce: x flattened, zero-padded to
    g chunks, all-to-all, and this rank's chunk summed in float32 and
    rounded to the wire. Returns (that chunk as words, chunk length, the
    clock at the all-to-all's start)."""
    g, xp = comm.size, comm.backend.xp
    n = x.size
    chunk = -(-n // g)                                      # elements per rank's share
    flat = x.reshape(-1)                                    # (n,)
    if chunk * g != n:
        flat = xp.concatenate([flat, xp.zeros(chunk * g - n, dtype=x.dtype)])   # (g*chunk,)
    _, send, recv, t0 = _alltoall_start(comm, flat, 0, wire, kind=kind)
    comm._done(send)
    return _words(comm, _summed(comm, recv, wire), wire), chunk, t0   # (chunk,) uint16


def _assembled(comm, gathered, x, wire):
    """The (g, chunk) gathered sums as an array shaped and typed like x."""
    out = comm._from_mpi(gathered).view(wire).reshape(-1)[:x.size]   # (n,)
    return out.reshape(x.shape).astype(x.dtype)


def allreduce(comm, x, wire):
    """Sum of x over the group; every rank gets the same 16-bit-rounded sums."""
    g = comm.size
    mine, chunk, t0 = _chunk_sums(comm, x, wire, "allreduce (16-bit)")
    gathered = comm._empty((g, chunk), mine.dtype)
    comm._start("allreduce (16-bit)")                      # the sums were computed after the first sync
    complete(comm.mpi.Iallgather(mine, gathered))
    comm._count(2 * (g - 1) * chunk, 2 * (g - 1), t0, 2)
    comm._done(mine)
    return _assembled(comm, gathered, x, wire)


def reduce(comm, x, root, wire):
    """Sum onto ``root`` (the 16-bit-rounded sums, in x's format); None elsewhere."""
    g = comm.size
    mine, chunk, t0 = _chunk_sums(comm, x, wire, "reduce (16-bit)")
    gathered = comm._empty((g, chunk), mine.dtype) if comm.rank == root else None
    comm._start("reduce (16-bit)")                         # the sums were computed after the first sync
    complete(comm.mpi.Igather(mine, gathered, root=root))
    comm._count(2 * (g - 1) * chunk, 2 * (g - 1), t0, 2)
    comm._done(mine)
    return _assembled(comm, gathered, x, wire) if comm.rank == root else None
