"""The watchdog: a rank that stops or vanishes must not hang the others
(docs/design.md section 7, ``--collective-timeout``).

MPI has no timeout of its own. A rank stopped with SIGSTOP, swapped out,
or cut off with its node leaves the others waiting in their next
collective for ever (the job's time limit, hours later, is the only end),
and a rank that has died is noticed by the launcher only if its process
exits. So each rank runs a daemon thread (mpi4py releases the GIL in every
MPI call, so it runs while the main thread waits) that reads, once per
``poll`` seconds, what the main thread waits in (``waiting.WAITS``: written
by every collective of ``Comm``, the agreements of ``comm``, and the
trainer at its step boundary and phases). When one collective has waited
``timeout`` seconds, or nothing at all has moved for that long (a rank
stuck outside communication, or in the checkpoint's own agreement), the
rank reports and aborts the whole job with ``MPI_Abort`` and exit status
``EXIT_NO_PROGRESS`` (76). Checkpoints are committed atomically, so the
last one stays intact; a half-written one is tidied by the next start.

One line from the first rank that notices. Every waiting rank notices at
about the same moment, so they agree through a duplicate of the world
communicator (used by these threads only, with MPI_THREAD_MULTIPLE, which
mpi4py asks for): the rank that notices sends a claim to every other rank
and listens for ``grace`` seconds. A rank that already holds a claim when
it notices stays silent, and so does one that hears a claim from a lower
rank while it listens (two ranks that notice together: the lower one
speaks). Every watchdog answers a claim with what its rank waits in, so the
speaker also names the ranks that did not answer: stopped, dead or
unreachable, the ones to look at. A silent rank that is still alive long
after the claim (the speaker itself was cut off) reports and aborts on its
own. Without MPI_THREAD_MULTIPLE each rank that notices reports, with
nobody named.

``timeout`` must be longer than the longest legitimate wait: a checkpoint
save or load of the largest model, a slow first step (kernel compilation);
the default, ``DEFAULT_TIMEOUT``, is ten minutes.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from contextlib import contextmanager

from mpi4py import MPI

from .waiting import WAITS

EXIT_NO_PROGRESS = 76       # sysexits.h's EX_PROTOCOL, after 74 (EX_IOERR: I/O errors) and 75 (EX_TEMPFAIL: preempted)
DEFAULT_TIMEOUT = 600.0     # seconds
ABORT_PAUSE = 0.5           # seconds for the line to pass through the launcher before MPI_Abort
LAST_RESORT = 10.0          # seconds after MPI_Abort before the rank ends itself (its launcher is unreachable)
SILENT_WAIT = 15.0          # seconds a silent rank waits for the speaker's abort before it speaks itself
_CLAIM, _ANSWER = 76, 77    # message tags on the watchdogs' own communicator


def ranks_text(ranks) -> str:
    """"rank 5", "ranks 0-3, 6": a sorted list of ranks, in ranges."""
    ranks = sorted(ranks)
    runs, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            runs.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(runs)


def describe_wait(current, step, phase, now: float) -> tuple:
    """(seconds, words) for what a rank waits in: "in allreduce over axis
    tp (step 12)", or "outside communication (step 12)" when it is in no
    collective (seconds then count from its last progress)."""
    where = phase if step is None else (f"step {step}" if phase == "step" else f"{phase}, step {step}")
    if current is not None:
        kind, axis, since = current
        return now - since, f"in {kind} over axis {axis} ({where})"
    if phase == "step":
        return None, f"outside communication ({where})"
    return None, f"in the {phase}" + ("" if step is None else f" (step {step})")


class Watchdog:
    """Watches this rank's ``waits``; ``start()`` and ``stop()`` it around
    a command. Building it is collective over ``world`` (a duplicate
    communicator for the watchdogs' messages)."""

    def __init__(self, world, timeout: float, waits=WAITS, abort=None, err=None):
        self.world, self.waits = world, waits
        self.rank, self.size = world.Get_rank(), world.Get_size()
        self.timeout = float(timeout)
        self.poll = min(1.0, self.timeout / 10)
        self.grace = 2 * self.poll + 0.5            # every other watchdog polls at least twice meanwhile
        self.talk = MPI.Query_thread() >= MPI.THREAD_MULTIPLE
        self.peers = world.Dup() if self.talk else None
        self.abort = abort or self._abort
        self.err = err or sys.stderr
        self.claims = set()          # ranks that announced they report a stall
        self.answers = {}            # rank -> what it waits in, answering this rank's claim
        self.sends = []              # requests of the messages sent (their buffers must live)
        self.deferred_at = None      # when this rank chose to stay silent
        self.reported = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mpicube-watchdog", daemon=True)

    def start(self) -> "Watchdog":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(self.poll + 1.0)

    # --- the thread ------------------------------------------------------
    def _run(self) -> None:
        while not self.reported and not self._stop.wait(self.poll):
            self._drain()
            stall = self.stall(time.perf_counter())
            if self.deferred_at is not None:
                if time.perf_counter() - self.deferred_at > self.grace + SILENT_WAIT:
                    self._report(stall or "was left waiting after another rank's report")
            elif stall is not None:
                self._noticed(stall)

    def stall(self, now: float):
        """The words for this rank's stall ("waited 15 s in allreduce over
        axis tp (step 12)"), or None while it makes progress."""
        w = self.waits
        waited, words = describe_wait(w.current, w.step, w.phase, now)
        if waited is None:
            idle = now - w.progress
            return f"made no progress for {idle:.0f} s {words}" if idle >= self.timeout else None
        return f"waited {waited:.0f} s {words}" if waited >= self.timeout else None

    def _noticed(self, stall: str) -> None:
        if not self.talk:
            self._report(stall)
            return
        if self.claims:                              # another rank noticed first and reports
            self.deferred_at = time.perf_counter()
            return
        for r in range(self.size):
            if r != self.rank:
                self.sends.append(self.peers.isend(None, dest=r, tag=_CLAIM))
        deadline = time.perf_counter() + self.grace
        while time.perf_counter() < deadline:
            time.sleep(min(0.05, self.poll))
            self._drain()
            if any(q < self.rank for q in self.claims):   # noticed together: the lower rank speaks
                self.deferred_at = time.perf_counter()
                return
        self._report(stall)

    def _drain(self) -> None:
        """Receive the other watchdogs' claims (answer each) and answers."""
        if not self.talk:
            return
        status = MPI.Status()
        while self.peers.iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG, status):
            source, tag = status.Get_source(), status.Get_tag()
            message = self.peers.recv(source=source, tag=tag)
            if tag == _CLAIM:
                self.claims.add(source)
                w = self.waits
                state = describe_wait(w.current, w.step, w.phase, time.perf_counter())[1]
                self.sends.append(self.peers.isend(state, dest=source, tag=_ANSWER))
            elif tag == _ANSWER:
                self.answers[source] = message

    def culprits(self) -> str:
        """Who the others are, from their answers."""
        if not self.talk:
            return "a rank stopped, died or cannot be reached"
        silent = [r for r in range(self.size) if r != self.rank and r not in self.answers]
        if silent:
            return f"no answer from {ranks_text(silent)} (stopped, dead or unreachable)"
        by_state = {}
        for r, state in self.answers.items():
            by_state.setdefault(state, []).append(r)
        shown = [f"{ranks_text(rs)} {state}" for state, rs in sorted(by_state.items(), key=lambda kv: kv[1])[:3]]
        more = "" if len(by_state) <= 3 else f" and {len(by_state) - 3} more"
        return "every rank answered: " + "; ".join(shown) + more

    def _report(self, stall: str) -> None:
        line = (f"error: rank {self.rank} {stall}: no progress; {self.culprits()}; aborting the job "
                f"(exit status {EXIT_NO_PROGRESS})")
        self.reported = True
        self.err.write(line + "\n")
        self.err.flush()
        self.abort()

    def _abort(self) -> None:
        """MPI_Abort the job; end this process if that cannot reach the launcher."""
        def last_resort():
            time.sleep(LAST_RESORT)
            os._exit(EXIT_NO_PROGRESS)

        sys.stdout.flush()
        threading.Thread(target=last_resort, daemon=True).start()
        time.sleep(ABORT_PAUSE)                 # the line on its way through the launcher first
        self.world.Abort(EXIT_NO_PROGRESS)
        os._exit(EXIT_NO_PROGRESS)


@contextmanager
def watching(world, timeout: float, phase: str = "setup", waits=WAITS):
    """Run the body with a watchdog on every rank of ``world`` (collective),
    in ``phase`` (for the message) until the body names another; ``timeout``
    0 or None, or a single rank, runs it without one."""
    if not timeout or world is None or world.Get_size() == 1:
        yield None
        return
    waits.step = None
    waits.in_phase(phase)
    dog = Watchdog(world, timeout, waits).start()
    try:
        yield dog
    finally:
        dog.stop()
