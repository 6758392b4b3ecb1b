"""Observers of the training step: how ``mpicube trace`` and ``--profile``
see a step without running a copy of it, and where the test suite's
deliberate faults go in (``Faults``), so that the trainer has no code that
exists only for tests.

The trainer calls each observer at fixed points of every step, on every
rank, with the trainer itself (``trainer.parts`` holds the layout, store
and model; ``trainer.opts`` the options). An observer reads; it must not
change what the step computes, so a traced or profiled run follows the
same trajectory as a plain one, with every option and every axis the
trainer has. Collectives an observer makes must be the same on every rank
(they run at the same point of the same step everywhere). ``Faults`` is
the one exception, and only when a test asks for it.

The points, in the order one step meets them::

    run_started(trainer)                      parameters initialised or restored
    step_started(trainer, s, x, y)            x, y (B, T): the global batch
    forward_done(trainer, s, micro)           each micro-batch, before its backward
    gradients_synced(trainer, s)              gradients summed over every axis,
                                              before their norm
    gradients_ready(trainer, s, loss, norm, loss_scale, skipped)
                                              summed gradients (still times
                                              loss_scale), before the update
    step_done(trainer, s, rec)                parameters updated; rec: the
                                              step's metrics record
    save_started(trainer, s)                  a checkpoint of step s begins
"""

from __future__ import annotations

import math
import os
import signal


class StepHooks:
    """The observer protocol; every method does nothing, so an observer
    overrides only the points it watches."""

    def run_started(self, trainer) -> None:
        pass

    def step_started(self, trainer, s: int, x, y) -> None:
        pass

    def forward_done(self, trainer, s: int, micro: int) -> None:
        pass

    def gradients_synced(self, trainer, s: int) -> None:
        pass

    def gradients_ready(self, trainer, s: int, loss: float, norm: float, loss_scale: float, skipped: bool) -> None:
        pass

    def step_done(self, trainer, s: int, rec: dict) -> None:
        pass

    def save_started(self, trainer, s: int) -> None:
        pass


# The environment variables of the test suite's faults (``Faults``):
OVERFLOW = "MPICUBE_TEST_OVERFLOW_STEP"  # STEP: the last world rank's gradient gets an inf after the sync
SIGNAL_IN_SAVE = "MPICUBE_TEST_SIGNAL_IN_SAVE"  # RANK:STEP:SIGNAL: that rank signals itself as that save starts
CRASH = "MPICUBE_TEST_CRASH_RANK"        # RANK: that world rank raises an unexpected exception at step 2


class Faults(StepHooks):
    """Deliberate faults for the test suite, which runs ``mpicube train``
    as a job and so can reach a step only through the environment (read
    in ``from_environment``, by the command line only):

    * ``overflow`` (tests/test_precision.py): at that step the last world
      rank puts an inf into its gradient after the gradient
      synchronisation, as a float16 overflow on one rank would; the step
      must be skipped on every rank alike;
    * ``signal_in_save`` (tests/test_rundir.py, tests/test_ckpt_faults.py):
      (rank, step, signal name): that rank sends itself the signal as it
      starts saving that step (SIGUSR1: a scheduler's warning landing
      mid-save; SIGSTOP: a rank frozen with the save half done, for a test
      to kill);
    * ``crash`` (tests/test_cli.py, tests/test_jobs_slurm.py): that world
      rank raises an unexpected exception from step 2 on, to check that an
      exception on one rank ends the whole job instead of leaving it
      hanging."""

    def __init__(self, overflow: int = None, signal_in_save: tuple = None, crash: int = None):
        self.overflow, self.signal_in_save, self.crash = overflow, signal_in_save, crash

    @classmethod
    def from_environment(cls, environ=os.environ):
        """The faults the environment asks for; None when it asks for none."""
        overflow, in_save, crash = (environ.get(k) for k in (OVERFLOW, SIGNAL_IN_SAVE, CRASH))
        if overflow is None and not in_save and crash is None:
            return None
        if in_save:
            rank, step, name = in_save.split(":")
            in_save = (int(rank), int(step), name)
        return cls(None if overflow is None else int(overflow), in_save or None,
                   None if crash is None else int(crash))

    def step_started(self, trainer, s, x, y) -> None:
        if self.crash is not None and s >= 2 and self.crash == trainer.rank:
            raise RuntimeError(f"{CRASH}={self.crash}: deliberate failure at step {s} (test hook)")

    def gradients_synced(self, trainer, s) -> None:
        if self.overflow == s and trainer.rank == trainer.world.Get_size() - 1:
            store = trainer.parts.store
            store.grad_chunk[0] = math.inf        # in the part this rank's norm reads

    def save_started(self, trainer, s) -> None:
        if self.signal_in_save is not None:
            rank, step, name = self.signal_in_save
            if rank == trainer.rank and step == s:
                os.kill(os.getpid(), getattr(signal, f"SIG{name}"))
