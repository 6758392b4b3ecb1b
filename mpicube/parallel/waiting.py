"""How a rank waits for the others, and the record of what it waits in
(part of the comm layer: ``comm`` and ``watchdog`` use it).

Waiting without eating the node. A blocking MPICH call spins on its core
until the others arrive: with one rank stopped (SIGSTOP) the other seven of
an 8-rank job kept a core and a half busy for as long as it stayed stopped,
and on an oversubscribed node the spinning ranks take the core from the
rank that has work. So every collective of ``Comm`` is started nonblocking
and completed by ``complete``: ``Test`` in a loop, as MPI's own wait does,
for the first ``SPIN_S`` seconds (a balanced step's collectives finish
within that and pay nothing), then between tests a sleep of a tenth of the
time waited so far, at most ``NAP_MAX_S``, so that a long wait costs
almost no CPU. The price is latency after a wait beyond ``SPIN_S``: each
round of the collective's algorithm may find its partner asleep, for up to
a tenth of what that partner had waited (and at most ``NAP_MAX_S``).
Measured on this project's 2-core (and busy) test machine, a 4-rank 1-D
``mpicube train`` with rank 2 stopped: the 3 waiting ranks used 0.44 cores
in MPICH's blocking wait, 0.26 with ``MPIR_CVAR_ENABLE_HEAVY_YIELD=1``, and
0.016 in ``complete`` (tests/test_watchdog.py prints the figure). MPICH's own
settings cannot do as well: its yield (``MPIR_CVAR_ENABLE_HEAVY_YIELD``, a
nanosleep every ``MPIR_CVAR_POLLS_BEFORE_YIELD`` polls) and progress throttle
(``MPIR_CVAR_CH4_PROGRESS_THROTTLE``) still poll thousands of times a
second; the command line sets the first when the user has not (it helps the
few blocking calls left: the checkpoint's agreement, setup).

What a rank waits in. ``Waits`` is written by the rank's main thread (a
tuple and two attribute writes per collective: see tools/comm_overhead.py
for the cost) and read by the watchdog thread (``watchdog``): which
collective over which axis since when, the time of the last progress (a
collective started or finished, or the trainer's step boundary), and the
step and phase of the run, for the watchdog's message.
"""

from __future__ import annotations

import time

SPIN_S = 0.001          # seconds of pure Test polling before the first sleep
NAP_FRACTION = 0.1      # each sleep is this fraction of the time waited so far ...
NAP_MAX_S = 0.01        # ... and at most this long


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


def complete(request, clock=time.perf_counter, sleep=time.sleep) -> None:
    """Wait for an MPI request: poll, then sleep between polls (module docstring)."""
    if request.Test():
        return
    t0 = clock()
    while not request.Test():
        waited = clock() - t0
        if waited > SPIN_S:
            sleep(min(NAP_MAX_S, NAP_FRACTION * waited))
