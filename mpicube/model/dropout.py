"""The dropout masks of every block and of the embeddings, and the
global positions of a micro-batch's rows. The masks are a function of
(seed, step, site, global index), so every layout, split of the sequence
and pipeline stage drops the same elements as the serial model.
"""

from __future__ import annotations

import numpy as np

from .. import ops
from ..ops import rng
from ..parallel.layouts.base import Layout
from .tape import Micro


class Dropout:
    """Masks that are a pure function of (seed, step, site, global index), so
    every layout drops the same elements (docs/design.md section 2). They are
    drawn where the activations live: on a GPU the hash runs on the device
    and nothing is copied per step but a few small index vectors, once.
    Which step, micro-batch and positions come with each call (``Micro``);
    the object keeps only the rate, the seed and those index vectors."""

    def __init__(self, p: float, seed: int, layout: Layout, grad_accum: int = 1):
        self.p, self.seed, self.layout = p, seed, layout
        self.keep = 1.0 - p
        cfg = layout.cfg
        self.grad_accum = grad_accum
        step_batch = layout.batch_size * grad_accum               # the layout holds one micro-batch
        self.canonical_shape = (step_batch, cfg.n_ctx, cfg.n_embd)
        self._indices = {}                                        # (kind, T, micro) -> index vectors on the device

    def first_seq(self, micro: int) -> int:
        """Global index of this replica's first sequence in micro-batch
        ``micro``: replica r holds rows [r*b, (r+1)*b) of the step's batch
        (b = B/dp), micro-batch m the rows r*b + m*b/N onwards, so the
        masks are those of the same step without accumulation."""
        b_micro = self.layout.local_batch
        return (self.layout.axes.dp.rank * self.grad_accum + micro) * b_micro

    def _mask(self, ctx: Micro, site, global_shape, kind, T, index):
        """(block shape) keep mask: 1.0 where kept, 0.0 where dropped."""
        backend = self.layout.backend
        if (kind, T, ctx.micro) not in self._indices:
            first, seqs = self.first_seq(ctx.micro), index[0]
            index = (first + np.asarray(seqs),) + tuple(index[1:])   # global sequence ids
            self._indices[kind, T, ctx.micro] = tuple(backend.xp.asarray(ix, dtype=np.uint64) for ix in index)
        counter = rng.block_index(global_shape, self._indices[kind, T, ctx.micro], backend.xp)   # per-dim terms
        return ops.keep_mask(rng.make_key(self.seed, "dropout", ctx.step, site), counter, self.p, backend.dtype)

    def on(self, ctx: Micro) -> bool:
        return self.p > 0.0 and ctx.train

    def canonical(self, ctx: Micro, site, T):
        """(B_c, T, C_c) keep mask for an activation in canonical form, or None."""
        if not self.on(ctx):
            return None
        index = (self.layout.canonical_seqs, positions(ctx, T), self.layout.canonical_cols)
        mask = self._mask(ctx, site, self.canonical_shape, "canonical", T, index)
        mask *= 1.0 / self.keep
        return mask

    def attention(self, ctx: Micro, site, T):
        """(B_m, nh, T, T) keep mask on attention probabilities, or None."""
        if not self.on(ctx):
            return None
        cfg = self.layout.cfg
        shape = (self.canonical_shape[0], cfg.n_head, cfg.n_ctx, cfg.n_ctx)
        index = (self.layout.mid_seqs, self.layout.head_ids, np.arange(T), np.arange(T))
        return self._mask(ctx, site, shape, "attention", T, index)

    def attention_blocks(self, ctx: Micro, site, T):
        """A callable (rows, cols) -> (B_m, nh, rows, cols) block of the
        keep mask ``attention`` draws, or None: blockwise attention draws
        each block where it uses it (forward, and again in backward), at
        the same global indices, so no (T, T) mask is ever held, and its
        counters are per-dimension terms (``rng.BlockIndex``), never a
        uint64 array of the block's size. ``rows`` and ``cols`` are slices
        of global positions (a context-parallel rank asks for blocks of its
        chunks and of chunks it is passed)."""
        if not self.on(ctx):
            return None
        cfg, xp = self.layout.cfg, self.layout.backend.xp
        shape = (self.canonical_shape[0], cfg.n_head, cfg.n_ctx, cfg.n_ctx)
        key = rng.make_key(self.seed, "dropout", ctx.step, site)
        first = self.first_seq(ctx.micro)
        seqs = xp.asarray(first + np.asarray(self.layout.mid_seqs), dtype=np.uint64)     # (B_m,) on the device
        heads = xp.asarray(self.layout.head_ids, dtype=np.uint64)                     # (nh,)
        pos = xp.asarray(np.arange(cfg.n_ctx), dtype=np.uint64)                       # (n_ctx,)
        dtype, p = self.layout.backend.dtype, self.p

        def block(rows, cols):
            counter = rng.block_index(shape, (seqs, heads, pos[rows], pos[cols]), xp)   # (B_m, nh, r, c) terms
            return ops.keep_mask(key, counter, p, dtype)
        return block


def positions(ctx: Micro, T: int):
    """(T,) global positions of T local rows: the rows the step driver gave
    this rank (``Micro.positions``) or its tp group (``Micro.gathered``,
    what --sequence-parallel's linears gather) when they are T of them,
    else 0 .. T-1."""
    for pos in (ctx.positions, ctx.gathered):
        if pos is not None and len(pos) == T:
            return pos
    return np.arange(T)
