"""What the watchdog's bookkeeping and the sleeping wait cost a collective.

    mpiexec -n 2 python tools/comm_overhead.py [--reps N]

Prints (rank 0), per call:
* the wait record: ``WAITS.enter`` + ``WAITS.leave``, the two calls every
  ``Comm`` collective now makes, beside the two clock reads every call made
  before (they read the same clock: the difference, two method calls, a
  tuple and three attribute writes, is what the record adds);
* an all-reduce of 8 and of 65,536 float32 three ways: MPI's blocking
  ``Allreduce`` (what ``Comm`` called before), ``Iallreduce`` completed by
  ``waiting.complete`` (what it calls now), and the whole ``Comm.allreduce``
  (copy, count, record), each the median of ``--reps`` calls, the three
  taken in turn after a barrier (``medians_us``).
A figure, not a test: the machine's other load moves it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from mpicube.device.backend import make_backend  # noqa: E402
from mpicube.parallel.comm import Comm, Counters  # noqa: E402
from mpicube.parallel.waiting import WAITS, complete  # noqa: E402


def medians_us(calls: dict, reps: int, world) -> dict:
    """Median microseconds of each call, taken in turn in every repetition
    (after a barrier, so both ranks arrive together: the balanced case, in
    which the wait never sleeps), so the machine's other load falls on all
    of them alike."""
    times = {name: [] for name in calls}
    for _ in range(reps):
        for name, call in calls.items():
            world.Barrier()
            t0 = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) * 1e6 for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=2000)
    args = parser.parse_args()
    world = MPI.COMM_WORLD
    comm = Comm(world, "tp", make_backend("cpu", "float32"), Counters())

    def record():
        WAITS.leave(WAITS.enter("allreduce", "tp"))

    def clock_reads():
        time.perf_counter()
        time.perf_counter()

    n = 200_000
    record_ns = min(timeit.repeat(record, number=n, repeat=7)) / n * 1e9
    clock_ns = min(timeit.repeat(clock_reads, number=n, repeat=7)) / n * 1e9
    rows = []
    for size in (8, 65536):
        x = np.ones(size, dtype=np.float32)
        buf = x.copy()
        got = medians_us({"blocking": lambda: world.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM),
                          "polled": lambda: complete(world.Iallreduce(MPI.IN_PLACE, buf, op=MPI.SUM)),
                          "comm": lambda: comm.allreduce(x)}, args.reps, world)
        rows.append((size, got["blocking"], got["polled"], got["comm"]))
    if world.Get_rank() == 0:
        print(f"{world.Get_size()} ranks, {args.reps} calls each (median), {MPI.Get_library_version().splitlines()[0]}")
        print(f"wait record (WAITS.enter + WAITS.leave): {record_ns:.0f} ns per collective; the two clock reads "
              f"it replaces: {clock_ns:.0f} ns; added: {record_ns - clock_ns:.0f} ns")
        print(f"{'elements':>9} {'Allreduce':>11} {'Iallreduce+complete':>20} {'Comm.allreduce':>15}")
        for size, blocking, polled, whole in rows:
            print(f"{size:>9} {blocking:>9.1f}us {polled:>18.1f}us {whole:>13.1f}us")


if __name__ == "__main__":
    main()
