"""All-to-all-v: every rank of a group sends a different number of rows to
every other (expert parallelism's token dispatch and combine, axis "ep").

A function of a ``Comm`` rather than its method only to keep ``comm.py``
within the project's size limit (as ``comm_p2p``); it uses the Comm's
buffer helpers (staging, 16-bit words, the stream synchronisation before
each MPI call) and counters, so the profiler, the watchdog and the cost
model see it as every collective. Two calls, both nonblocking and
completed by ``waiting.complete``: the row counts first (``Ialltoall`` of
one integer per peer), then the rows (``Ialltoallv``) in x's own format
(16-bit rows as raw words). Counted per rank as what it sends to the
others: the counts exchange g-1 elements (8 bytes each) in g-1 messages,
the rows (rows sent to other ranks) x (row width) elements in one
message per peer it sends a row to.
"""

from __future__ import annotations

import numpy as np

from .comm import Comm
from .waiting import complete
from ..device import precision


def exchange_counts(comm: Comm, send_counts: np.ndarray) -> np.ndarray:
    """send_counts (g,) or (g, k) host ints: row j is what this rank tells
    peer j (how many rows it sends it) -> the same shape, row j what peer j
    told this rank."""
    send = np.ascontiguousarray(send_counts, dtype=np.int64)       # (g,) or (g, k)
    recv = np.empty_like(send)
    if comm.size == 1:
        return send
    t0 = comm._start("alltoall")
    complete(comm.mpi.Ialltoall(send, recv))
    per = send.size // comm.size
    comm._count((comm.size - 1) * per, comm.size - 1, t0, send.itemsize)
    return recv


def alltoallv(comm: Comm, x, send_counts: np.ndarray, recv_counts: np.ndarray = None):
    """x (m, w): rows grouped by destination rank, ``send_counts[j]`` of
    them for rank j (host ints summing to m) -> (recv (r, w): the rows
    every rank sent here, grouped by source rank, recv_counts (g,)). Given
    ``recv_counts`` (a reply along the same pairs: the combine after a
    dispatch), the counts exchange is skipped."""
    if comm.size == 1:
        return x, np.asarray(send_counts, dtype=np.int64)
    if recv_counts is None:
        recv_counts = exchange_counts(comm, send_counts)
    width = int(np.prod(x.shape[1:]))
    dtype = x.dtype
    send = comm._to_mpi(comm._words(x))                                           # (m, w)
    recv = comm._empty((int(recv_counts.sum()),) + tuple(x.shape[1:]), send.dtype)   # (r, w)
    sc, rc = np.asarray(send_counts, dtype=np.int64) * width, recv_counts * width
    sd, rd = np.cumsum(sc) - sc, np.cumsum(rc) - rc
    t0 = comm._start("alltoallv")
    complete(comm.mpi.Ialltoallv([send, (sc, sd)], [recv, (rc, rd)]))
    others = [j for j in range(comm.size) if j != comm.rank]
    comm._count(int(sum(sc[j] for j in others)), sum(1 for j in others if sc[j]), t0, send.itemsize)
    comm._done(send)
    out = comm._from_mpi(recv)
    return (out.view(dtype) if precision.is_half(dtype) else out), recv_counts
