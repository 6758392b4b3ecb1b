"""The nonblocking all-reduce and broadcast that the layouts overlap with
their GEMMs (part of the comm layer, beside ``comm_wire``).

``iallreduce(comm, x)`` and ``ibcast(comm, x, root)`` start what
``Comm.allreduce`` and ``Comm.bcast`` do and return a ``Pending`` whose
``wait()`` gives the same result: the same MPI operation on the same
buffers, built by the same ``Comm`` helpers (staging, 16-bit words). Each
is counted when it starts, with the figures of its blocking form, so the
cost model's counts hold whether or not a layout overlaps; the time spent
in ``wait()`` is added to the axis's seconds, as for ``Comm.iallgather``.
They live here rather than in ``comm.py`` only to keep that module within
the project's size limit.
"""

from __future__ import annotations

from fractions import Fraction

from mpi4py import MPI

from .comm import _OPS, Comm, Pending, _on_wire
from .waiting import complete
from ..device import precision


def iallreduce(comm: Comm, x, op: str = "sum", wire=None) -> Pending:
    """Start ``comm.allreduce(x, op, wire)``. A 16-bit ``wire`` runs
    comm_wire's blocking stages now (no overlap), the Pending holding the
    result."""
    if comm.size == 1:
        return Pending(lambda: x.copy())
    if _on_wire(wire):
        out = comm.allreduce(x, op, wire)
        return Pending(lambda: out)
    wide = comm._wide(x)
    buf = comm._private(wide) if wide is x else comm._to_mpi(wide)     # MPI reduces in place: never into x
    t0 = comm._start("iallreduce")
    request = comm.mpi.Iallreduce(MPI.IN_PLACE, buf, op=_OPS[op])
    g = comm.size
    comm._count(Fraction(2 * (g - 1), g) * buf.size, 2 * (g - 1), t0, buf.itemsize)

    def finish():
        complete(request)
        return precision.narrow(comm._from_mpi(buf), x.dtype)

    return Pending(finish, comm, buf, "iallreduce")


def ibcast(comm: Comm, x, root: int) -> Pending:
    """Start ``comm.bcast(x, root)``; the root leaves ``x`` unchanged until
    ``wait()`` (MPI reads it meanwhile)."""
    if comm.size == 1:
        return Pending(lambda: x)
    words = comm._words(x)
    buf = comm._empty(x.shape, words.dtype) if comm.rank != root else comm._to_mpi(words)
    t0 = comm._start("ibcast")
    request = comm.mpi.Ibcast(buf, root=root)
    comm._count(buf.size, comm.size - 1, t0, buf.itemsize)

    def finish():
        complete(request)
        if comm.rank != root:
            out = comm._from_mpi(buf)
            return out if out.dtype == x.dtype else out.view(x.dtype)
        comm._done(buf)
        if comm._staged:
            return x                            # the root keeps its own device array
        return buf if buf.dtype == x.dtype else buf.view(x.dtype)

    return Pending(finish, comm, buf, "ibcast")
