"""Observers of the training step: how ``mpicube trace`` (and any later
profiler) sees a step without running a copy of it.

The trainer calls each observer at fixed points of every step, on every
rank, with the trainer itself (``trainer.parts`` holds the layout, store
and model; ``trainer.opts`` the options). An observer reads; it must not
change what the step computes, so a traced or profiled run follows the
same trajectory as a plain one, with every option and every axis the
trainer has. Collectives an observer makes must be the same on every rank
(they run at the same point of the same step everywhere).

The points, in the order one step meets them::

    run_started(trainer)                      parameters initialised or restored
    step_started(trainer, s, x, y)            x, y (B, T): the global batch
    forward_done(trainer, s, micro)           each micro-batch, before its backward
    gradients_ready(trainer, s, loss, norm, loss_scale, skipped)
                                              summed gradients (still times
                                              loss_scale), before the update
    step_done(trainer, s, rec)                parameters updated; rec: the
                                              step's metrics record
"""

from __future__ import annotations


class StepHooks:
    """The observer protocol; every method does nothing, so an observer
    overrides only the points it watches."""

    def run_started(self, trainer) -> None:
        pass

    def step_started(self, trainer, s: int, x, y) -> None:
        pass

    def forward_done(self, trainer, s: int, micro: int) -> None:
        pass

    def gradients_ready(self, trainer, s: int, loss: float, norm: float, loss_scale: float, skipped: bool) -> None:
        pass

    def step_done(self, trainer, s: int, rec: dict) -> None:
        pass
