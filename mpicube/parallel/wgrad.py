"""The seam between a backward's two phases: the input gradient dX, which
the stage below waits for, and the weight gradient dW, which nobody waits
for until the optimizer step.

Why a seam and not two model passes: a linear's backward already computes
dX = dY W^T and dW += X^T dY from the same two operands, so the split is a
question of *when* the second GEMM runs, not of what the model does. Every
layout's linear hands its weight work to ``store.wgrads.add(fn, *operands)``
(the bias's column sums go with it): outside a zero-bubble schedule that
runs ``fn`` at once, in the place the fused backward ran it; inside the
input phase of one (``collect``) it files the call with the operands it
needs (the saved input X and the output gradient dY, as the linear holds
them) and returns, so the backward returns dX as soon as the GEMMs of the
input path are done. The schedule's ``backward_weight`` action later
``run``s the calls filed for that (micro-batch, chunk), in the order the
backward filed them. The model never learns which happened.

Sum order: a parameter's gradient gets one contribution per micro-batch
from its linear (a chunk's parameters belong to that chunk alone), and a
schedule runs a chunk's weight phases in the order of its input phases,
which is micro-batch order, as the unsplit backward adds them. So every
dW buffer receives the same additions in the same order: zero-bubble
gradients are bitwise those of the same schedule unsplit (1F1B), and
equal to serial to 1e-10 in float64 (tests/pipeline_check.py).

Norm weights, the embeddings and the LM head keep their gradients in the
input phase: their dW is a column sum or a scatter over the same rows dX
reads (no GEMM worth moving), and the head's wte is shared with the lookup.
"""

from __future__ import annotations

from contextlib import contextmanager


class WeightGrads:
    """Run weight-gradient work now, or file it while ``collect`` is open."""

    def __init__(self):
        self.filed = None                       # the open list of (fn, operands), or None: run at once

    @property
    def deferring(self) -> bool:
        return self.filed is not None

    def add(self, fn, *operands) -> None:
        """``fn(*operands)`` now, or filed for ``run`` inside ``collect``."""
        if self.filed is None:
            fn(*operands)
        else:
            self.filed.append((fn, operands))

    @contextmanager
    def collect(self):
        """Inside: every ``add`` is filed in the yielded list (one backward's
        weight phase), not run."""
        if self.filed is not None:
            raise RuntimeError("weight-gradient collection is already open")
        self.filed = filed = []
        try:
            yield filed
        finally:
            self.filed = None

    @staticmethod
    def run(filed: list) -> None:
        """One weight phase: the filed calls in the order the backward filed them."""
        for fn, operands in filed:
            fn(*operands)
        filed.clear()
