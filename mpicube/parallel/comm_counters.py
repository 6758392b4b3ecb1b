"""What communication is counted in: the per-axis tallies every call adds to
(``Counters``) and the handle of a started nonblocking call whose wait is
tallied too (``Pending``).

``Comm`` (``comm.py``) and its function-shaped helpers (``comm_start``,
``comm_p2p``, ``comm_wire``, ``comm_alltoall``) add each call's elements,
bytes, messages and seconds here, with the conventions of docs/design.md section
4 listed in ``comm.py``; the cost model, ``bench`` and the profiler read
them back. Counts are exact ``Fraction``s so the analytic cost model can be
compared with ``==``.
"""

from __future__ import annotations

import time
from collections import defaultdict
from fractions import Fraction

from .waiting import WAITS


class Totals:
    """The sums over every axis of per-axis ``elems``, ``bytes`` and
    ``msgs``: what this rank's ``Counters`` measured and what the cost
    model's ``analysis.costbase.Traffic`` predicts are read alike."""

    def total_elems(self) -> Fraction:
        return sum(self.elems.values(), Fraction(0))

    def total_bytes(self) -> Fraction:
        return sum(self.bytes.values(), Fraction(0))

    def total_msgs(self) -> int:
        return sum(self.msgs.values())


class Counters(Totals):
    """Elements, bytes, messages and seconds of communication, per axis name."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.elems = defaultdict(Fraction)   # axis -> elements moved by this rank
        self.bytes = defaultdict(Fraction)   # axis -> bytes moved by this rank
        self.msgs = defaultdict(int)         # axis -> messages (ring steps)
        self.seconds = defaultdict(float)    # axis -> wall time inside MPI calls

    def add(self, axis: str, elems, msgs: int, seconds: float, width: int = 0):
        """Count ``elems`` elements of ``width`` bytes each."""
        self.elems[axis] += Fraction(elems)
        self.bytes[axis] += Fraction(elems) * width
        self.msgs[axis] += msgs
        self.seconds[axis] += seconds

    def total_seconds(self) -> float:
        return sum(self.seconds.values())


class Pending:
    """A started collective: ``wait()`` completes it and returns its result
    (the time spent waiting is added to the axis's seconds). Holds the send
    buffer so it outlives the operation. Made right after the start call's
    ``Comm._count``, so ``WAITS.progress`` is then the time that call
    returned: a profile's flight starts there. ``comm`` is the ``Comm``
    that started it (None: nothing to count, e.g. a group of one)."""

    def __init__(self, finish, comm=None, send=None, kind: str = "wait"):
        self._finish, self._comm, self._send, self._kind = finish, comm, send, kind
        self._since = WAITS.progress        # when the start call returned (Comm._count), for --profile

    def wait(self):
        if self._comm is None:
            return self._finish()
        t0 = WAITS.enter(self._kind, self._comm.axis)
        out = self._finish()
        t1 = time.perf_counter()
        self._comm.counters.add(self._comm.axis, 0, 0, t1 - t0)
        rec = self._comm.recorder
        if rec is not None and rec.on:
            rec.wait(self._comm, self._kind, self._since, t0, t1)
        WAITS.leave(t1)
        self._send = None
        return out
