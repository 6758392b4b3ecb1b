"""Point-to-point messages between two ranks of one communicator: a
pipeline's activations and gradients between neighbouring stages (axis
"pp") and context parallelism's K/V blocks around its ring (axis "cp").

Functions of a ``Comm`` rather than its methods only to keep ``comm.py``
within the project's size limit; they use its buffer helpers (staging,
16-bit words, the stream synchronisation before each MPI call) and its
counters, so the profiler and the cost-model checks see them as they see
every collective. Counted on the sender only: one message of ``x.size``
elements per send, so a rank's counters are what it sends (a receive
counts its wait time, nothing moved). 16-bit arrays travel as raw words.
"""

from __future__ import annotations

import numpy as np

from .comm import Comm, Pending
from .waiting import complete
from ..device import precision

SHIFT_TAG = 22        # the ring's messages: one in flight per pair of neighbours at a time


def isend(comm: Comm, x, dest: int, tag: int) -> Pending:
    """Start sending ``x`` to group rank ``dest``; ``.wait()`` completes
    it (the buffer is held until then)."""
    send = comm._to_mpi(comm._words(x))
    t0 = comm._start("isend")
    request = comm.mpi.Isend(send, dest=dest, tag=tag)
    comm._count(send.size, 1, t0, send.itemsize)

    def finish():
        complete(request)
        comm._done(send)

    return Pending(finish, comm, send, "isend")


def irecv(comm: Comm, shape, dtype, source: int, tag: int) -> Pending:
    """Post a receive of a (shape) array of ``dtype`` from group rank
    ``source``; ``.wait()`` returns it (on the device)."""
    dtype = np.dtype(dtype)
    words = np.dtype(np.uint16) if precision.is_half(dtype) else dtype
    recv = comm._empty(tuple(shape), words)
    t0 = comm._start("irecv")
    request = comm.mpi.Irecv(recv, source=source, tag=tag)
    comm._count(0, 0, t0, recv.itemsize)

    def finish():
        complete(request)
        out = comm._from_mpi(recv)
        return out if out.dtype == dtype else out.view(dtype)

    return Pending(finish, comm, recv, "irecv")


def ishift(comm: Comm, x, dest: int, source: int) -> Pending:
    """Start sending ``x`` to rank ``dest`` and receiving an array of the
    same shape and format from ``source`` (a step around a ring: context
    parallelism's K/V blocks); ``.wait()`` returns what arrived. One
    message of x.size elements, in x's own format."""
    send = comm._to_mpi(comm._words(x))
    recv = comm._empty(send.shape, send.dtype)
    t0 = comm._start("ishift")
    requests = [comm.mpi.Irecv(recv, source=source, tag=SHIFT_TAG),
                comm.mpi.Isend(send, dest=dest, tag=SHIFT_TAG)]
    comm._count(send.size, 1, t0, send.itemsize)

    def finish():
        for request in requests:
            complete(request)
        comm._done(send)
        out = comm._from_mpi(recv)
        return out.view(x.dtype) if precision.is_half(x.dtype) else out

    return Pending(finish, comm, send, "ishift")
