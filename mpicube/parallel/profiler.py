"""The span recorder of ``--profile START:STOP`` (part of the comm layer:
``comm`` calls it, so it sits beside it; docs/design.md section 11).

Why a recorder here and not a sampling profiler: the question is *when*
each rank computes, talks over which axis, and waits, on one clock for all
ranks, which only the code that makes the calls knows. A ``Recorder`` is
handed to the world ``comm.Comm`` when the communicators are built
(``grid.build_layout(recorder=)``, ``training.parts.build_parts``), and
every communicator split from it inherits it; while it is on (``start``
to ``stop``: the profiled steps) ``Comm._count`` hands it every counted
call (its kind, axis, bytes and the world ranks of its group) and
``Pending.wait`` every wait on a nonblocking one. The trainer's and
bench's profile sessions (``mpicube.analysis.profile``) switch it on and
wrap the model's modules and the optimizer step in ``timed`` for the
profiled steps only.

Off costs nothing per operation: a run without ``--profile`` builds its
Comms with no recorder (one ``is None`` check per call), and outside the
profiled steps the recorder is off; nothing is wrapped. There is no
process-wide state: two models in one process profile (or not)
independently.

A span is (thread, name, t0, t1, args) in this process's
``time.perf_counter`` seconds. Threads: ``COMPUTE`` for the main thread's
work, ``"comm " + axis`` for each communication axis (dp, tp, the layouts'
own, later pp). Kinds whose name starts with "i" are nonblocking starts
(``nonblocking``): the call is a span on the axis thread, and the time until
its wait ends is a *flight* (drawn as an async event); the wait is a span
named ``"wait " + kind``. Point-to-point calls (a pipeline's sends and
receives) are more kinds on their axis's thread, with their partner as
``peers``; nothing else changes.

Clocks. ``align_clocks`` runs once before the first profiled step: a
barrier, then rank 0 exchanges a few ping-pongs with every rank and takes,
from the round with the shortest round trip, the offset of that rank's
clock (the midpoint rule: the other's reading against the middle of the
round trip). Every rank then subtracts its offset and rank 0's start time,
so the trace is on rank 0's clock, to within half a round trip.
"""

from __future__ import annotations

import time

from .waiting import WAITS, complete

COMPUTE = "compute"
PING_ROUNDS = 5          # ping-pongs per rank in align_clocks; the shortest round trip wins
_TAG = 7525              # the message tag of align_clocks's ping-pongs


def nonblocking(kind: str) -> bool:
    """Whether ``kind`` names the start of a nonblocking call (iallgather, ...)."""
    return kind.startswith("i")


def axis_thread(axis: str) -> str:
    return "comm " + axis


class Recorder:
    """One rank's spans and flights of the profiled steps. ``sync`` (the
    backend's synchronize) runs before each compute span closes, so that on
    a GPU a module's span ends when its kernels have, not when they were
    queued. Peers are named by their rank in ``world`` (default
    MPI.COMM_WORLD). Off when made: the Comms that hold it record
    nothing until ``start``."""

    def __init__(self, sync=None, world=None):
        self.sync, self.world = sync, world       # world: the communicator whose ranks name peers
        self.on = False          # recording (the Comms that hold this recorder check it per call)
        self._peers = {}         # id(mpi communicator) -> world ranks of its group
        self.clear()

    def start(self) -> None:
        """Record the Comms' calls from now on."""
        self.on = True

    def stop(self) -> None:
        self.on = False

    def clear(self) -> None:
        """Forget every span and flight (what was written)."""
        self.spans = []          # (thread, name, t0, t1, args)
        self.flights = []        # (thread, name, t0, t1, args): nonblocking calls from start to end of wait
        self._started = {}       # (axis, end of the start call) -> bytes, until its wait

    def span(self, thread: str, name: str, t0: float, t1: float, args: dict = None) -> None:
        self.spans.append((thread, name, t0, t1, args))

    def peers(self, comm) -> list:
        """World ranks of ``comm``'s group, in its rank order (cached)."""
        key = id(comm.mpi)
        if key not in self._peers:
            from mpi4py import MPI

            world = (self.world or MPI.COMM_WORLD).Get_group()
            self._peers[key] = [int(r) for r in MPI.Group.Translate_ranks(comm.mpi.Get_group(),
                                                                          list(range(comm.size)), world)]
        return self._peers[key]

    def comm(self, comm, kind: str, t0: float, t1: float, nbytes, peers: list = None) -> None:
        """A counted call of ``comm`` (``Comm._count``): started at t0,
        returned at t1. ``peers`` (world ranks) default to ``comm``'s whole
        group; a point-to-point call names its partner."""
        blocking = not nonblocking(kind)
        peers = self.peers(comm) if peers is None else [int(p) for p in peers]
        self.spans.append((axis_thread(comm.axis), kind, t0, t1,
                           {"kind": kind, "axis": comm.axis, "bytes": float(nbytes), "peers": peers,
                            "blocking": blocking}))
        if not blocking:
            self._started[comm.axis, t1] = float(nbytes)

    def wait(self, comm, kind: str, since: float, t0: float, t1: float) -> None:
        """A wait on a nonblocking call of ``comm`` whose start returned at ``since``."""
        thread = axis_thread(comm.axis)
        nbytes = self._started.pop((comm.axis, since), 0.0)
        args = {"kind": kind, "axis": comm.axis, "bytes": nbytes, "peers": self.peers(comm)}
        self.spans.append((thread, "wait " + kind, t0, t1, {**args, "blocking": True}))
        self.flights.append((thread, kind, since, t1, args))


class timed:
    """Replace ``obj.method`` by a version that records a compute span
    named ``name`` (with ``args``) around each call, until ``restore()``.
    The wrapper is an instance attribute, so the class and every other
    instance are untouched, and nothing is left behind when profiling
    ends."""

    def __init__(self, recorder: Recorder, obj, method: str, name: str, args: dict = None):
        self.obj, self.method = obj, method
        self.had_own = method in vars(obj)
        self.own = vars(obj).get(method)
        original = getattr(obj, method)
        span, sync, clock = recorder.span, recorder.sync, time.perf_counter

        def wrapper(*a, **k):
            t0 = clock()
            try:
                return original(*a, **k)
            finally:
                if sync is not None:
                    sync()
                span(COMPUTE, name, t0, clock(), args)

        setattr(obj, method, wrapper)

    def restore(self) -> None:
        if self.had_own:
            setattr(self.obj, self.method, self.own)
        else:
            delattr(self.obj, self.method)


def align_clocks(mpi_world, clock=time.perf_counter) -> tuple:
    """(offset, origin): this rank's ``clock() - offset`` reads rank 0's
    clock, and ``origin`` is rank 0's reading at the end of the alignment
    (module docstring). Raw mpi4py on the world: bookkeeping, not counted."""
    size, rank = mpi_world.Get_size(), mpi_world.Get_rank()
    if size > 1:
        WAITS.enter("a barrier before the profile's clock alignment", "world")
        complete(mpi_world.Ibarrier())
        WAITS.leave()
    offsets = [0.0] * size
    if rank == 0:
        for other in range(1, size):
            best = None
            for _ in range(PING_ROUNDS):
                sent = clock()
                mpi_world.send(None, dest=other, tag=_TAG)
                theirs = mpi_world.recv(source=other, tag=_TAG)
                back = clock()
                if best is None or back - sent < best[0]:
                    best = (back - sent, theirs - (sent + back) / 2)
            offsets[other] = best[1]
    elif size > 1:
        for _ in range(PING_ROUNDS):
            mpi_world.recv(source=0, tag=_TAG)
            mpi_world.send(clock(), dest=0, tag=_TAG)
    offset = mpi_world.scatter(offsets, root=0) if size > 1 else 0.0
    origin = mpi_world.bcast(clock(), root=0) if size > 1 else clock()
    return offset, origin
