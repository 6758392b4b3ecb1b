"""All-to-all-v: every rank of a group sends a different number of rows to
every other (expert parallelism's token dispatch and combine, axis "ep").

A function of a ``Comm`` rather than its method only to keep ``comm.py``
within the project's size limit (as ``comm_p2p``); it uses the Comm's
buffer helpers (staging, 16-bit words, the stream synchronisation before
each MPI call), counters and ``Pending``, so the profiler, the watchdog
and the cost model see it as every collective. Two calls, both
nonblocking: the row counts first (``Ialltoall`` of one integer per peer,
completed at once by ``waiting.complete``), then the rows
(``Ialltoallv``, returned as a ``Pending``: the caller computes while
they travel and waits when it needs them) in x's own format (16-bit rows
as raw words).

A rank's rows for itself never enter MPI: ``ialltoallv`` passes them
with a count of zero, and the caller uses them where they are (the rows
of its own experts, parallel/experts.Dispatch), so they can be computed
on while the others are still in flight. Counted per rank as what it
sends to the others: the counts exchange g-1 elements (8 bytes each) in
g-1 messages, the rows (rows sent to other ranks) x (row width) elements
in one message per peer it sends a row to.
"""

from __future__ import annotations

import numpy as np

from .comm import Comm, Pending
from .waiting import complete
from ..device import precision
from ..device.arrays import array_module


def exchange_counts(comm: Comm, send_counts: np.ndarray) -> np.ndarray:
    """send_counts (g,) or (g, k) host ints: row j is what this rank tells
    peer j (how many rows it sends it) -> the same shape, row j what peer j
    told this rank (row ``comm.rank``: its own, unchanged)."""
    send = np.ascontiguousarray(send_counts, dtype=np.int64)       # (g,) or (g, k)
    recv = np.empty_like(send)
    if comm.size == 1:
        return send
    t0 = comm._start("alltoall")
    complete(comm.mpi.Ialltoall(send, recv))
    per = send.size // comm.size
    comm._count((comm.size - 1) * per, comm.size - 1, t0, send.itemsize)
    return recv


def _displacements(counts: np.ndarray) -> np.ndarray:
    return np.cumsum(counts) - counts


def ialltoallv(comm: Comm, x, send_counts: np.ndarray, recv_counts: np.ndarray, own_in_x: bool = True) -> Pending:
    """Start sending the rows of x to the other ranks: ``send_counts[j]``
    rows (g,) host ints) for rank j, grouped by destination in x, which
    holds this rank's own ``send_counts[rank]`` rows in their place when
    ``own_in_x`` (they are skipped) and not at all otherwise. ``wait()``
    returns (r_o, w): the rows the other ranks sent here,
    ``recv_counts[j]`` from rank j, grouped by source, without this
    rank's own."""
    me = comm.rank
    width = int(np.prod(x.shape[1:]))
    dtype = x.dtype
    sent = np.asarray(send_counts, dtype=np.int64).copy()
    if not own_in_x:
        sent[me] = 0
    sd = _displacements(sent)                                   # where each destination's rows start in x
    sc, rc = sent.copy(), np.asarray(recv_counts, dtype=np.int64).copy()
    sc[me] = rc[me] = 0                                         # the own rows stay where they are
    send = comm._to_mpi(comm._words(x))                                                # (m, w)
    recv = comm._empty((int(rc.sum()),) + tuple(x.shape[1:]), send.dtype)              # (r_o, w)
    t0 = comm._start("ialltoallv")
    request = comm.mpi.Ialltoallv([send, (sc * width, sd * width)], [recv, (rc * width, _displacements(rc) * width)])
    comm._count(int(sc.sum()) * width, int(np.count_nonzero(sc)), t0, send.itemsize)

    def finish():
        complete(request)
        comm._done(send)
        out = comm._from_mpi(recv)
        return out.view(dtype) if precision.is_half(dtype) else out

    return Pending(finish, comm, send, "ialltoallv")


def alltoall(comm: Comm, x):
    """x (g, ...): slab j goes to rank j -> (g, ...): slab j came from
    rank j (this rank's own slab stays where it is). Equal slabs, one
    message per peer (Ulysses' exchange of sequence runs for head groups,
    parallel/ulysses.py); counted as ``ialltoallv`` counts: (g-1) slabs sent."""
    if comm.size == 1:
        return x
    xp = array_module(x)
    x = xp.ascontiguousarray(x)
    g, me = comm.size, comm.rank
    ones = np.ones(g, dtype=np.int64)
    others = ialltoallv(comm, x, ones, ones).wait()                # (g-1, ...) by source, without this rank
    out = xp.empty_like(x)
    out[me] = x[me]
    out[[j for j in range(g) if j != me]] = others
    return out
