"""Dropout masks at global indices: the elements a layout drops are those
the serial model drops, whatever the layout holds (DESIGN.md section 2)."""

from __future__ import annotations

import numpy as np

from .. import ops
from ..ops import rng
from ..parallel.layouts.base import Layout


class Dropout:
    """Masks that are a pure function of (seed, step, site, global index), so
    every layout drops the same elements (DESIGN.md section 2). They are
    drawn where the activations live: on a GPU the hash runs on the device
    and nothing is copied per step but a few small index vectors, once."""

    def __init__(self, p: float, seed: int, layout: Layout, grad_accum: int = 1):
        self.p, self.seed, self.layout = p, seed, layout
        self.keep = 1.0 - p
        cfg = layout.cfg
        self.grad_accum = grad_accum
        self.micro = 0                                            # which micro-batch of the step runs
        step_batch = layout.batch_size * grad_accum               # the layout holds one micro-batch
        self.canonical_shape = (step_batch, cfg.n_ctx, cfg.n_embd)
        self._indices = {}                                        # (kind, T, micro) -> index vectors on the device
        self.global_positions = None                              # (T_l,) under context parallelism (GPT.forward)

    def first_seq(self, micro: int) -> int:
        """Global index of this replica's first sequence in micro-batch
        ``micro``: replica r holds rows [r*b, (r+1)*b) of the step's batch
        (b = B/dp), micro-batch m the rows r*b + m*b/N onwards, so the
        masks are those of the same step without accumulation."""
        b_micro = self.layout.local_batch
        return (self.layout.axes.dp.rank * self.grad_accum + micro) * b_micro

    def _mask(self, step, site, global_shape, kind, T, index):
        """(block shape) keep mask: 1.0 where kept, 0.0 where dropped."""
        backend = self.layout.backend
        if (kind, T, self.micro) not in self._indices:
            first, seqs = self.first_seq(self.micro), index[0]
            index = (first + np.asarray(seqs),) + tuple(index[1:])   # global sequence ids
            self._indices[kind, T, self.micro] = tuple(backend.xp.asarray(ix, dtype=np.uint64) for ix in index)
        counter = rng.block_index(global_shape, self._indices[kind, T, self.micro], backend.xp)   # per-dim terms
        return ops.keep_mask(rng.make_key(self.seed, "dropout", step, site), counter, self.p, backend.dtype)

    def canonical(self, step, site, T):
        """(B_c, T, C_c) keep mask for an activation in canonical form, or None."""
        if self.p == 0.0:
            return None
        index = (self.layout.canonical_seqs, self.positions(T), self.layout.canonical_cols)
        mask = self._mask(step, site, self.canonical_shape, "canonical", T, index)
        mask *= 1.0 / self.keep
        return mask

    def attention(self, step, site, T):
        """(B_m, nh, T, T) keep mask on attention probabilities, or None."""
        if self.p == 0.0:
            return None
        cfg = self.layout.cfg
        shape = (self.canonical_shape[0], cfg.n_head, cfg.n_ctx, cfg.n_ctx)
        index = (self.layout.mid_seqs, self.layout.head_ids, np.arange(T), np.arange(T))
        return self._mask(step, site, shape, "attention", T, index)

    def positions(self, T):
        """(T,) global positions of the T local rows: 0 .. T-1, or a
        context-parallel rank's two chunks (``global_positions``)."""
        pos = self.global_positions
        return np.arange(T) if pos is None or len(pos) != T else pos

    def attention_blocks(self, step, site, T):
        """A callable (rows, cols) -> (B_m, nh, rows, cols) block of the
        keep mask ``attention`` draws, or None: blockwise attention draws
        each block where it uses it (forward, and again in backward), at
        the same global indices, so no (T, T) mask is ever held. ``rows``
        and ``cols`` are slices of global positions (a context-parallel
        rank asks for blocks of its chunks and of chunks it is passed)."""
        if self.p == 0.0:
            return None
        cfg, xp = self.layout.cfg, self.layout.backend.xp
        shape = (self.canonical_shape[0], cfg.n_head, cfg.n_ctx, cfg.n_ctx)
        pos = np.arange(cfg.n_ctx)
        key = rng.make_key(self.seed, "dropout", step, site)
        first = self.first_seq(self.micro)
        seqs = xp.asarray(first + np.asarray(self.layout.mid_seqs), dtype=np.uint64)
        heads = xp.asarray(self.layout.head_ids, dtype=np.uint64)
        pos_d = xp.asarray(pos, dtype=np.uint64)
        dtype, p = self.layout.backend.dtype, self.p

        def block(rows, cols):
            counter = rng.flat_index(shape, (seqs, heads, pos_d[rows], pos_d[cols]), xp)   # (B_m, nh, r, c)
            return ops.keep_mask(key, counter, p, dtype)
        return block
