"""AdamW (and plain SGD, a reference mode) on the flat parameter buffer,
and the learning-rate schedule.

Everything works on ``ParamStore.master``/``flat_grad``: the optimizer is a
handful of in-place vector operations whatever the model size. The
gradient sums before it are ``parallel.gradients``; the step object that
puts the two together, replicated or sharded over dp (--zero 1), is
``training.step``.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass

from ..device.kernels import kernels_for
from ..parallel.params import ParamStore


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

    With fused kernels (``mpicube.device.kernels``) the update is one pass per run
    of decayed or undecayed parameters. Otherwise it is a dozen
    array passes; done on the whole buffer, each would stream every parameter
    through memory again, so they run block by block and a block's p, g, m
    and v stay in cache for all of them.
    """

    BLOCK = 1 << 15     # elements per cache block (128 KiB of float32 per array)
    DEVICE_BLOCK = 1 << 24  # on a GPU: a few kernels per 16 Mi elements, and a bounded scratch buffer

    def __init__(self, store: ParamStore, weight_decay: float = 0.1, betas=(0.9, 0.95), eps: float = 1e-8,
                 decay_all: bool = False):
        xp = store.backend.xp
        self.store = store
        # the buffer this rank updates: the whole (P_local,), or its chunk (C,) under --zero 1
        master = store.master
        self.m = xp.zeros_like(master)          # (C,) first moment
        self.v = xp.zeros_like(master)          # (C,) second moment
        self.t = 0                              # updates taken
        self.weight_decay = weight_decay
        self.beta1, self.beta2 = betas
        self.eps = eps
        decayed = [slice(0, master.size)] if decay_all else store.partition.local(store.decay_slices)
        self.runs = self._runs(master.size, decayed)
        # cache blocks on the CPU; on a GPU large blocks (a kernel per pass, not thousands)
        self.block = self.BLOCK if xp.__name__ == "numpy" else self.DEVICE_BLOCK
        self._work = None       # the array path's scratch (at most one block), made when it first runs

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
        self._adam(self.runs, lr, grad_scale)
        self.store.params_changed()

    def _adam(self, runs: list, lr: float, grad_scale: float) -> None:
        """AdamW on the (slice, decayed?) ``runs`` of the chunk, at step ``self.t``."""
        b1, b2 = self.beta1, self.beta2
        # lr m_hat / (sqrt(v_hat) + eps) = step * m / (sqrt(v) + eps'), folding both bias corrections
        sqrt_bias2 = math.sqrt(1.0 - b2 ** self.t)
        step = lr * sqrt_bias2 / (1.0 - b1 ** self.t)
        eps = self.eps * sqrt_bias2
        keep = 1.0 - lr * self.weight_decay
        flat, flat_grad = self.store.master, self.store.grad_chunk                      # (C,) each
        kernels = kernels_for(flat, flat_grad, self.m, self.v)
        for run, decays in runs:
            run_keep = keep if decays else 1.0
            if kernels is not None:
                kernels.adamw(flat[run], flat_grad[run], self.m[run], self.v[run], b1, b2, step, eps,
                              run_keep, grad_scale)
                continue
            for lo in range(run.start, run.stop, self.block):
                block = slice(lo, min(run.stop, lo + self.block))
                self._update_block(flat[block], flat_grad[block], self.m[block], self.v[block],
                                   b1, b2, step, eps, run_keep, grad_scale)

    # --- the whole moments, for checkpoints ------------------------------------
    # Under --zero 1 each replica holds the moments of its chunk only. A
    # checkpoint holds full logical tensors (format version 1, readable on
    # any layout, world size and zero setting), so a save gathers them over
    # dp and a load keeps this replica's chunk of full ones. That costs each
    # rank temporaries of 2 P_pad elements (and P_pad of master weights under
    # mixed precision, ParamStore.full_master) while it saves or loads. It is
    # acceptable here: it happens between steps, it is never more than what
    # --zero 0 holds all the time, and it keeps one format that every reader,
    # layout and zero setting takes. A model too large for it would have each
    # replica write its own chunk instead.

    def full_moments(self) -> tuple:
        """(m, v) over the rank's whole flat buffer: the moments themselves,
        or under --zero 1 gathered over dp (collective)."""
        store = self.store
        if not store.partition.sharded:
            return self.m, self.v
        return store.gather_chunks(self.m), store.gather_chunks(self.v)     # (P_pad,) each

    @contextmanager
    def writing_moments(self):
        """Yields (m, v) over the whole flat buffer for the caller to fill;
        under --zero 1 temporaries of which this replica keeps its chunk."""
        store = self.store
        if not store.partition.sharded:
            yield self.m, self.v
            return
        xp, n = store.backend.xp, store.partition.padded
        m, v = xp.zeros(n, dtype=self.m.dtype), xp.zeros(n, dtype=self.v.dtype)   # (P_pad,) each
        yield m, v
        self.m[...] = store.partition.take(xp, m)
        self.v[...] = store.partition.take(xp, v)

    def _update_block(self, p, g, m, v, b1, b2, step, eps, keep, grad_scale) -> None:
        """The NumPy/CuPy update of one cache block, pass by pass."""
        xp = self.store.backend.xp
        if self._work is None:
            self._work = xp.empty(max(1, min(self.block, self.m.size)), dtype=self.m.dtype)   # (block,)
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


class SGD(AdamW):
    """Plain SGD, ``p <- p - lr g`` (g after clipping): no momentum, no
    weight decay, no bias correction (``--optimizer sgd``).

    Why a trainer that has AdamW needs it: AdamW divides each gradient by
    its own running magnitude, so a gradient scaled by a parallel size (a
    loss averaged over the wrong group, a norm counting replicas twice)
    moves the parameters hardly at all - it hides the bugs a checker looks
    for. Under SGD an update is proportional to the gradient, and a trace
    shows every such scale in the parameters. It keeps AdamW's buffers
    (zero moments, the step count), so checkpoints, --zero 1 and resuming
    treat both alike.
    """

    def __init__(self, store: ParamStore, weight_decay: float = 0.0, **_):
        super().__init__(store, weight_decay=0.0)

    def step(self, lr: float, grad_scale: float = 1.0) -> None:
        """One update on this rank's buffer (its chunk under --zero 1)."""
        self.store.settle()
        self.t += 1
        flat, flat_grad = self.store.master, self.store.grad_chunk                      # (C,) each
        rate = lr * grad_scale
        for lo in range(0, flat.size, self.block):
            block = slice(lo, min(flat.size, lo + self.block))
            flat[block] -= rate * flat_grad[block]
        self.store.params_changed()


OPTIMIZERS = {"adamw": AdamW, "sgd": SGD}
