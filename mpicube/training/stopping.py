"""When a run stops early, agreed by every rank at step boundaries.

Four things end a run before ``--steps``: SIGTERM, SIGUSR1 (a scheduler's
warning) or SIGINT (Ctrl-C: the first one; a second one interrupts at once,
exit status 130, losing the steps since the last checkpoint) on any rank, ``--time-limit`` (judged on rank 0's and every
rank's own clock, with room for one more step and one more checkpoint),
an I/O failure of the run directory on rank 0 (metrics.jsonl on a full
disk), and ``--stop-after`` (the loop's own bound). All but the last are
agreed with one tiny uncounted all-reduce of the largest reason, so all
ranks stop at the same step, checkpoint together and exit with the same
status.
"""

from __future__ import annotations

import signal
import time
from contextlib import contextmanager
from typing import Optional

from ..parallel.comm_agree import agree_max

GO_ON, TIME_LIMIT, SIGNAL, IO_FAILURE = 0, 1, 2, 3


class EarlyStop:
    """The stop reasons of one rank, and their agreement over ``world``."""

    def __init__(self, world, time_limit: Optional[float] = None):
        self.world = world
        self.time_limit = time_limit
        self.t_start = time.monotonic()
        self.signalled = GO_ON         # set by the signal handler
        self.slowest_step = 0.0        # seconds: room kept for one more step ...
        self.ckpt_seconds = 0.0        # ... and one more checkpoint before the time limit
        self.io_failure = None         # rank 0: what it could not write in the run directory

    def agree(self) -> int:
        """GO_ON, TIME_LIMIT, SIGNAL or IO_FAILURE: the same on every rank."""
        code = IO_FAILURE if self.io_failure is not None else self.signalled
        if self.time_limit is not None:
            elapsed = time.monotonic() - self.t_start
            if elapsed + self.slowest_step + self.ckpt_seconds >= self.time_limit:
                code = max(code, TIME_LIMIT)
        return agree_max(self.world, code)

    def on_signal(self, signum, frame) -> None:
        if signum == signal.SIGINT and self.signalled == SIGNAL:    # Ctrl-C twice: stop now, no checkpoint
            raise KeyboardInterrupt
        self.signalled = SIGNAL

    @contextmanager
    def signal_handlers(self):
        """SIGTERM, SIGUSR1 and a first SIGINT (Ctrl-C, which a user presses
        as a cluster's scheduler sends SIGTERM) ask for a checkpoint and exit
        at the next step boundary."""
        previous = {}
        for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
            try:
                previous[sig] = signal.signal(sig, self.on_signal)
            except ValueError:      # not the main thread: no handlers
                pass
        try:
            yield
        finally:
            # After a signal-driven stop the job is on its way out (requeued);
            # a scheduler that repeats its warning must not kill a rank in
            # MPI_Finalize with SIGUSR1's default action, so such signals are
            # ignored from here on instead of handed back. After a normal
            # finish SIGTERM goes back to its previous handler (a cancel still
            # ends the process), but SIGUSR1 is a scheduler's "time is nearly
            # up" warning: its default action would kill a rank that has
            # finished and turn a good job into a failed one (status 138), so
            # a default SIGUSR1 becomes ignored; a caller's own handler is
            # handed back.
            for sig, handler in previous.items():
                if sig == signal.SIGINT:            # Ctrl-C while finalising: interrupt as usual
                    signal.signal(sig, handler)
                    continue
                late_warning = sig == signal.SIGUSR1 and handler in (signal.SIG_DFL, None)
                signal.signal(sig, signal.SIG_IGN if self.signalled or late_warning else handler)
