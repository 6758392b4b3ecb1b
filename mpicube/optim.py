"""AdamW on the flat parameter buffer, gradient synchronisation and
clipping, and the learning-rate schedule.

Everything works on ``ParamStore.flat``/``flat_grad``: the optimizer is a
handful of in-place vector operations whatever the model size, and the
data-parallel all-reduce is one call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .comm import Comm
from .params import ParamStore


def sync_gradients(store: ParamStore, dp: Comm) -> None:
    """Sum partial gradients over each parameter's replica group inside the
    tensor-parallel group, then over data-parallel replicas (one flat
    all-reduce). The loss is already normalised by the global token count,
    so these are sums, not means."""
    for comm, flat_slice in store.grad_groups:
        store.flat_grad[flat_slice] = comm.allreduce(store.flat_grad[flat_slice])
    if dp.size > 1:
        store.flat_grad[...] = dp.allreduce(store.flat_grad)


def global_grad_norm(store: ParamStore, tp: Comm) -> float:
    """L2 norm of the logical gradient: each block counted once however many
    tensor-parallel ranks replicate it (gradients are identical across dp
    after sync_gradients)."""
    xp = store.backend.xp
    local = 0.0
    for spec in store.specs:
        g = store.grad[spec.name].reshape(-1)
        local += float(g @ g) / spec.replicas
    total = tp.allreduce(xp.asarray([local], dtype=xp.float64))
    return math.sqrt(float(total[0]))


@dataclass
class Schedule:
    """Linear warmup to ``lr`` over ``warmup`` steps, then cosine decay to
    ``min_lr_ratio * lr`` at ``steps``. Steps are 1-based."""

    lr: float
    warmup: int
    steps: int
    min_lr_ratio: float = 0.1

    def __call__(self, step: int) -> float:
        if self.warmup > 0 and step <= self.warmup:
            return self.lr * step / self.warmup
        span = max(1, self.steps - self.warmup)
        progress = min(1.0, (step - self.warmup) / span)
        floor = self.lr * self.min_lr_ratio
        return floor + 0.5 * (self.lr - floor) * (1.0 + math.cos(math.pi * progress))


class AdamW:
    """Adam with decoupled weight decay applied only to ``decl.decay``
    parameters (the matrices of the linears; biases, LayerNorm and
    embeddings are not decayed unless ``decay_all``)."""

    def __init__(self, store: ParamStore, weight_decay: float = 0.1, betas=(0.9, 0.95), eps: float = 1e-8,
                 decay_all: bool = False):
        xp = store.backend.xp
        self.store = store
        self.m = xp.zeros_like(store.flat)      # (P_local,) first moment
        self.v = xp.zeros_like(store.flat)      # (P_local,) second moment
        self.t = 0                              # updates taken
        self.weight_decay = weight_decay
        self.beta1, self.beta2 = betas
        self.eps = eps
        self.decay_slices = [slice(None)] if decay_all else store.decay_slices
        self._work = xp.empty_like(store.flat)  # scratch, reused every step

    def step(self, lr: float, grad_scale: float = 1.0) -> None:
        """One update with learning rate ``lr``; gradients are multiplied by
        ``grad_scale`` first (clipping)."""
        xp = self.store.backend.xp
        p, g, m, v, w = self.store.flat, self.store.flat_grad, self.m, self.v, self._work
        self.t += 1
        if grad_scale != 1.0:
            g *= grad_scale
        m *= self.beta1
        m += (1.0 - self.beta1) * g
        xp.multiply(g, g, out=w)
        v *= self.beta2
        w *= 1.0 - self.beta2
        v += w
        if self.weight_decay:
            for sl in self.decay_slices:
                p[sl] *= 1.0 - lr * self.weight_decay
        bias1 = 1.0 - self.beta1 ** self.t
        bias2 = 1.0 - self.beta2 ** self.t
        xp.sqrt(v, out=w)
        w *= 1.0 / math.sqrt(bias2)
        w += self.eps
        xp.divide(m, w, out=w)
        w *= lr / bias1
        p -= w
