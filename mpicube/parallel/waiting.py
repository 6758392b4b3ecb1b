"""How a rank waits for the others, and the record of what it waits in
(part of the comm layer: ``comm`` and ``watchdog`` use it).

Waiting without eating the node, and without stalling the others.
A blocking MPICH call spins on its core until the others arrive: with one
rank stopped (SIGSTOP) the other seven of an 8-rank job kept a core and a
half busy for as long as it stayed stopped. So every collective of
``Comm`` is started nonblocking and completed by ``complete``, in two
phases:

* *young* (the first ``YIELD_S`` seconds): a burst of ``BURST`` tests
  (a partner running on another core answers within microseconds), then
  ``os.sched_yield()``, in a loop. On a core of its own the yield returns at
  once and this is MPI's own spinning wait. On a core shared with other
  ranks (8 ranks on a 2-core laptop, CI's tests, any oversubscribed node)
  the yield hands the core to a rank that has work, and this rank is back
  as soon as that rank yields or its time slice ends. It never sleeps, so
  each round of the collective's algorithm (which MPICH progresses only
  inside an MPI call of every member) finds it awake.
* *old* (beyond ``YIELD_S``): between tests a sleep of a tenth of the time
  waited so far, at most ``NAP_MAX_S``: a rank stopped or gone costs its
  peers almost no CPU, and the watchdog's thread gets the GIL.

Why not sleep while young, as this module did from 35159ec on (``Test``
for 1 ms, then naps): with more ranks than cores nearly every wait outlasts
1 ms (the partner is descheduled, not late), so nearly every collective
slept, and every round of its algorithm waited for a sleeper to wake:
``mpiexec -n 8 mpicube train`` on 2 cores fell from about 2,500 to 800
tok/s. Why not MPI's blocking wait: MPICH spins (or, with
``MPIR_CVAR_ENABLE_HEAVY_YIELD``, polls thousands of times a second) for as
long as the wait lasts, 0.44 (0.26) cores for 3 ranks waiting on a
stopped one, and it holds the main thread where the watchdog cannot see
the wait begin. ``tools/wait_bench.py`` times the three (``--wait``) on 8
ranks beside the serial run; ``tests/test_watchdog.py`` prints the stopped
case's cores.

``MODE`` is "yield" (the above) or "block" (MPI's own ``Wait``: the
baseline the benchmark compares against); the command line sets it once
(``set_mode``) from ``MPICUBE_WAIT``.

What a rank waits in. ``Waits`` is written by the rank's main thread (a
tuple and two attribute writes per collective: see tools/comm_overhead.py
for the cost) and read by the watchdog thread (``watchdog``): which
collective over which axis since when, the time of the last progress (a
collective started or finished, or the trainer's step boundary), and the
step and phase of the run, for the watchdog's message.
"""

from __future__ import annotations

import os
import time

YIELD_S = 1.0           # seconds of Test + sched_yield before the first sleep (a "young" wait)
NAP_FRACTION = 0.1      # each later sleep is this fraction of the time waited so far ...
NAP_MAX_S = 0.01        # ... and at most this long
BURST = 20              # tests between two yields of a young wait (tens of microseconds)
WAIT_MODES = ("yield", "block")
MODE = "yield"


class Waits:
    """What this process's main thread is waiting in, for the watchdog.

    ``current`` is None or (collective kind, axis name, since), ``since``
    and ``progress`` are ``time.perf_counter()`` readings. One object per
    process (``WAITS``): each rank is one process whose main thread makes
    every MPI call on model data."""

    __slots__ = ("current", "progress", "step", "phase")

    def __init__(self):
        self.current = None
        self.progress = time.perf_counter()
        self.step = None            # the trainer's step, once it runs one
        self.phase = "setup"        # setup, step, evaluation, checkpoint save, ...

    def enter(self, kind: str, axis: str) -> float:
        """A collective starts (counts as progress); returns its start time."""
        now = time.perf_counter()
        self.current = (kind, axis, now)
        return now

    def leave(self, now: float = None) -> None:
        """The collective that ``enter`` named has finished."""
        self.current = None
        self.progress = time.perf_counter() if now is None else now

    def at_step(self, step: int) -> None:
        """The trainer starts ``step``: progress, whatever the step's collectives do."""
        self.step, self.phase = step, "step"
        self.progress = time.perf_counter()

    def in_phase(self, phase: str) -> None:
        """The run moves to ``phase`` (an evaluation, a checkpoint save): progress."""
        self.phase = phase
        self.progress = time.perf_counter()

    def context(self) -> str:
        """Where the run is, for a message: "step 12", "checkpoint save, step 12", "setup"."""
        if self.step is None:
            return self.phase
        return f"step {self.step}" if self.phase == "step" else f"{self.phase}, step {self.step}"


WAITS = Waits()


class WaitStats:
    """How this process's waits went, for ``bench``: the completions that
    did not finish at their first test (``waited``), the ones that outlived
    ``YIELD_S`` and slept (``slept``), and the seconds spent in both."""

    __slots__ = ("waited", "slept", "seconds")

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.waited = self.slept = 0
        self.seconds = 0.0


STATS = WaitStats()


def set_mode(mode: str) -> None:
    """Choose how ``complete`` waits for this process: "yield" (the module
    docstring) or "block" (MPI's blocking ``Wait``, for comparison)."""
    global MODE
    if mode not in WAIT_MODES:
        raise ValueError(f"unknown wait mode {mode!r}; choose one of {', '.join(WAIT_MODES)}")
    MODE = mode


def complete(request, clock=time.perf_counter, sleep=time.sleep, yield_core=os.sched_yield) -> None:
    """Wait for an MPI request: test and yield while the wait is young,
    then test and sleep (module docstring)."""
    if request.Test():
        return
    t0 = clock()
    STATS.waited += 1
    if MODE == "block":
        request.Wait()
        STATS.seconds += clock() - t0
        return
    waited, slept = 0.0, False
    while not request.Test():
        waited = clock() - t0
        if waited < YIELD_S:
            for _ in range(BURST):         # a partner on another core answers within microseconds
                if request.Test():
                    break
            yield_core()
        else:
            slept = True
            sleep(min(NAP_MAX_S, NAP_FRACTION * waited))
    STATS.slept += slept
    STATS.seconds += waited
