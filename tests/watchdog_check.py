"""The watchdogs' agreement on who speaks, on 3 ranks (run by
tests/test_watchdog.py): real threads and messages, a made-up wait record
per rank, an abort that only notes the line. Rank 0 prints one JSON line:
for each case, the lines every rank would have printed.

stopped   ranks 0 and 2 stuck in the same all-reduce, rank 1 stopped (its
          watchdog never runs): rank 0 speaks and names rank 1.
deadlock  every rank stuck, rank 2 in another collective: rank 0 speaks,
          every rank answered, and says where each waits.
first     rank 2 stuck long before rank 0, rank 1 busy (no stall): rank 2
          speaks first, rank 0 holds its claim and stays silent.
"""

import io
import json
import threading
import time

from mpi4py import MPI

from mpicube.parallel.waiting import Waits
from mpicube.parallel.watchdog import Watchdog

world = MPI.COMM_WORLD
rank = world.Get_rank()
TIMEOUT = 1.0


def case(stuck: dict, running: bool = True) -> list:
    """``stuck``: rank -> (kind, axis, seconds already waited); a rank not
    in it makes progress. Returns every rank's printed lines (on rank 0)."""
    waits = Waits()
    waits.at_step(7)
    now = time.perf_counter()
    if rank in stuck:
        kind, axis, ago = stuck[rank]
        waits.current = (kind, axis, now - ago)
    else:
        waits.progress = now + 3600              # busy, never stalled
    err, aborted = io.StringIO(), threading.Event()
    dog = Watchdog(world, TIMEOUT, waits, abort=aborted.set, err=err)    # collective
    if running:
        dog.start()
    time.sleep(2 * TIMEOUT + 2 * dog.grace + 0.5)                       # long enough to report, not to self-report
    if running:
        dog.stop()
    lines = world.gather(err.getvalue().splitlines(), root=0)
    world.Barrier()
    return lines


results = {
    "stopped": case({0: ("allreduce", "tp", 0), 2: ("allreduce", "tp", 0)}, running=rank != 1),
    "deadlock": case({0: ("allreduce", "tp", 0), 1: ("allreduce", "tp", 0), 2: ("allgather", "dp", 0)}),
    "first": case({0: ("allreduce", "tp", 0), 2: ("bcast", "row", TIMEOUT)}),
}
if rank == 0:
    print(json.dumps(results), flush=True)
