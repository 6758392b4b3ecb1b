"""Agreement on host objects between all ranks: rank 0's result (or its
user-facing error) given to everyone (``on_root``), the largest of one
integer over the ranks (``agree_max``, e.g. a stop flag).

Raw mpi4py calls on a plain communicator, not a ``Comm``: this is
bookkeeping, not model data, so nothing is counted. Each wait still goes
through ``waiting.complete`` (poll, then sleep) and is noted in
``waiting.WAITS`` for the watchdog, so a rank waiting on the others neither
spins on a core nor hangs unseen.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from .waiting import WAITS, complete
from ..core.errors import UserError


def on_root(mpi_comm, fn):
    """Run ``fn`` on rank 0 only and give its result, or its user-facing
    error, to every rank: a bad input then stops all ranks with the same
    message instead of leaving some of them waiting in a collective."""
    result = error = None
    if mpi_comm.Get_rank() == 0:
        try:
            result = fn()
        except UserError as exc:
            error = (type(exc), str(exc))
    if mpi_comm.Get_size() > 1:             # the others wait for rank 0 without spinning
        WAITS.enter("a barrier for rank 0's work", "world")
        complete(mpi_comm.Ibarrier())
        WAITS.leave()
    result, error = mpi_comm.bcast((result, error), root=0)
    if error is not None:
        raise error[0](error[1])
    return result


def agree_max(mpi_comm, value: int) -> int:
    """The largest ``value`` over all ranks (e.g. a stop flag)."""
    buf = np.array([int(value)], dtype=np.int64)
    WAITS.enter("an agreement (allreduce)", "world")
    complete(mpi_comm.Iallreduce(MPI.IN_PLACE, buf, op=MPI.MAX))
    WAITS.leave()
    return int(buf[0])
