"""Forward and backward over a step's micro-batches (``--grad-accum N``).

Why: the saved activations of a step grow with its batch; running the
batch as N micro-batches of B/N sequences, each forward followed at once by
its backward, keeps only one micro-batch's activations alive while the
optimizer still sees the gradient of the whole batch. The trajectory is
that of the same step without accumulation: replica r's rows of the global
batch are [r*b, (r+1)*b) (b = B/dp) as always, micro-batch m takes the m-th
run of b/N of them, dropout masks are drawn at global sequence indices, the
model divides every micro-batch's loss by the whole step's token count, and
backward adds into the gradient buffers (the store's first contribution of
the step overwrites, later ones add). Gradient synchronisation, the norm,
clipping and the optimizer then run once per step, outside.

The trainer, the validation loss and tests/parallel_check.py all call these
functions, so the check tests the trainer's code.
"""

from __future__ import annotations


def forward_backward(parts, x, y, step: int, loss_scale: float = 1.0, after_forward=None) -> float:
    """x, y (B, T): the step's global batch. Runs this replica's N
    micro-batches, forward then backward each, adding every micro-batch's
    gradient into the store (zero_grad is the caller's, once per step).
    Returns the step's mean loss, the same on every rank.
    ``after_forward(m)``, if given, runs between micro-batch m's forward
    and its backward (tests/parallel_check.py measures memory there)."""
    if parts.layout.fp8 is not None:    # --fp8 delayed: last step's amaxes join the histories
        parts.layout.fp8.begin_step(step)
    if parts.pipeline is not None:      # stages: the schedule runs the micro-batches (training.pipeline)
        return parts.pipeline.forward_backward(parts, x, y, step, loss_scale,
                                               None if after_forward is None else lambda m, v: after_forward(m))
    model, loss = parts.model, 0.0
    for m in range(parts.grad_accum):
        rows = parts.micro_rows(m)
        loss += model.forward(x[rows], y[rows], step=step, micro=m)     # x[rows]: (B_dp / N, T)
        if after_forward is not None:
            after_forward(m)
        model.backward(loss_scale=loss_scale)
    return loss


def forward_loss(parts, model, x, y, step: int = 0) -> float:
    """The step's mean loss of ``model`` (a GPT on ``parts``' layout, e.g.
    the dropout-free view evaluation uses) over the global batch x, y
    (B, T), forward only, one micro-batch at a time. Under pipeline
    stages ``model`` is the Pipeline, run without dropout. Under --fp8
    its amaxes stay out of delayed's histories."""
    fp8 = parts.layout.fp8
    if fp8 is not None:
        fp8.recording = False
    try:
        if parts.pipeline is not None:
            return parts.pipeline.forward_loss(parts, x, y, step)
        return sum(model.forward(x[parts.micro_rows(m)], y[parts.micro_rows(m)], step=step, micro=m)
                   for m in range(parts.grad_accum))
    finally:
        if fp8 is not None:
            fp8.recording = True
