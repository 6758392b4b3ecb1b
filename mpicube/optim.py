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
from .kernels import kernels_for
from .params import ParamStore


def sync_gradients(store: ParamStore, dp: Comm) -> None:
    """Sum partial gradients over each parameter's replica group inside the
    tensor-parallel group, then over data-parallel replicas (one flat
    all-reduce). The loss is already normalised by the global token count,
    so these are sums, not means."""
    store.settle()
    for comm, flat_slice in store.grad_groups:
        store.flat_grad[flat_slice] = comm.allreduce(store.flat_grad[flat_slice])
    if dp.size > 1:
        store.flat_grad[...] = dp.allreduce(store.flat_grad)


def global_grad_norm(store: ParamStore, tp: Comm) -> float:
    """L2 norm of the logical gradient: each block counted once however many
    tensor-parallel ranks replicate it (gradients are identical across dp
    after sync_gradients). One dot product per run of the flat buffer that
    shares a replica count, summed on the device; the only copy to the host
    is the final number."""
    xp = store.backend.xp
    store.settle()
    local = xp.zeros(1, dtype=xp.float64)                # (1,) on the device
    for replicas, run in store.replica_runs:
        g = store.flat_grad[run]                         # (n,)
        local += xp.dot(g, g).astype(xp.float64) / replicas
    total = tp.allreduce(local)
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
    embeddings are not decayed unless ``decay_all``), as PyTorch's AdamW:
    p <- p (1 - lr wd) - lr m_hat / (sqrt(v_hat) + eps).

    With fused kernels (``mpicube.kernels``) the update is one pass per run
    of decayed or undecayed parameters. Otherwise it is a dozen
    array passes; done on the whole buffer, each would stream every parameter
    through memory again, so they run block by block and a block's p, g, m
    and v stay in cache for all of them.
    """

    BLOCK = 1 << 15     # elements per cache block (128 KiB of float32 per array)

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
        decayed = [slice(0, store.flat.size)] if decay_all else store.decay_slices
        self.runs = self._runs(store.flat.size, decayed)
        # cache blocks on the CPU; on a GPU one block (a kernel per pass, not thousands)
        self.block = self.BLOCK if xp.__name__ == "numpy" else max(1, store.flat.size)
        self._work = xp.empty(min(self.block, store.flat.size), dtype=store.flat.dtype)  # scratch

    @staticmethod
    def _runs(size: int, decayed: list) -> list:
        """(slice, decayed?) runs covering the buffer, alternating."""
        runs, at = [], 0
        for d in sorted(decayed, key=lambda d: d.start):
            if d.start > at:
                runs.append((slice(at, d.start), False))
            runs.append((d, True))
            at = d.stop
        if at < size:
            runs.append((slice(at, size), False))
        return runs

    def step(self, lr: float, grad_scale: float = 1.0) -> None:
        """One update with learning rate ``lr``; gradients count multiplied by
        ``grad_scale`` (clipping), without being changed in the buffer."""
        self.store.settle()
        self.t += 1
        b1, b2 = self.beta1, self.beta2
        # lr m_hat / (sqrt(v_hat) + eps) = step * m / (sqrt(v) + eps'), folding both bias corrections
        sqrt_bias2 = math.sqrt(1.0 - b2 ** self.t)
        step = lr * sqrt_bias2 / (1.0 - b1 ** self.t)
        eps = self.eps * sqrt_bias2
        keep = 1.0 - lr * self.weight_decay
        flat, flat_grad = self.store.flat, self.store.flat_grad
        kernels = kernels_for(flat, flat_grad, self.m, self.v)
        for run, decays in self.runs:
            run_keep = keep if decays else 1.0
            if kernels is not None:
                kernels.adamw(flat[run], flat_grad[run], self.m[run], self.v[run], b1, b2, step, eps,
                              run_keep, grad_scale)
                continue
            for lo in range(run.start, run.stop, self.block):
                block = slice(lo, min(run.stop, lo + self.block))
                self._update_block(flat[block], flat_grad[block], self.m[block], self.v[block],
                                   b1, b2, step, eps, run_keep, grad_scale)
        self.store.params_changed()

    def _update_block(self, p, g, m, v, b1, b2, step, eps, keep, grad_scale) -> None:
        """The NumPy/CuPy update of one cache block, pass by pass."""
        xp = self.store.backend.xp
        w = self._work[: p.size]
        m *= b1                                       # m = b1 m + (1 - b1) s g   (s = grad_scale)
        xp.multiply(g, (1.0 - b1) * grad_scale, out=w)
        m += w
        v *= b2                                       # v = b2 v + (1 - b2) s^2 g^2
        xp.multiply(g, g, out=w)
        w *= (1.0 - b2) * grad_scale * grad_scale
        v += w
        if keep != 1.0:
            p *= keep                                 # decoupled weight decay
        xp.sqrt(v, out=w)                             # p -= step m / (sqrt(v) + eps')
        w += eps
        xp.divide(m, w, out=w)
        w *= step
        p -= w
