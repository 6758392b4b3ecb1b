"""One transformer block and the dropout masks it draws, written against
the layout protocol (layouts/base.py) as the GPT that strings the blocks
together (``gpt.py``) is. The masks are a function of (seed, step, site,
global index), so every layout, context-parallel split and pipeline stage
drops the same elements as the serial model.
"""

from __future__ import annotations

import numpy as np

from . import kvcache
from .. import ops
from ..ops import attention_blocks, rng
from ..parallel import context
from ..parallel.layouts.base import Layout, LayerNorm
from ..parallel.params import ParamStore


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


class Block:
    """Pre-LN transformer block: x += attn(ln_1(x)); x += mlp(ln_2(x)).

    Under ``--recompute blocks`` (``layout.recompute``) forward keeps only
    the block's input (as ``layout.save_block_input`` stores it) and lets go
    of every cache and dropout mask; ``rerun`` repeats the forward inside
    backward with the same step, so the masks come again from the same hash
    and the caches are the same numbers, before ``backward`` uses them."""

    def __init__(self, layout: Layout, store: ParamStore, i: int):
        p, h = f"h.{i}.", layout.cfg.n_embd
        self.site = f"h.{i}"
        self.layout = layout
        self.checkpoint = layout.recompute == "blocks"
        self.replay = None                   # (saved input, dropout, step) under --recompute blocks
        self.ln_1 = LayerNorm(store, p + "ln_1", h, layout.hidden_comm)
        self.c_attn = layout.linear(store, p + "attn.c_attn", "first")
        self.c_proj = layout.linear(store, p + "attn.c_proj", "second")
        self.ln_2 = LayerNorm(store, p + "ln_2", h, layout.hidden_comm)
        self.c_fc = layout.linear(store, p + "mlp.c_fc", "first")
        self.mlp_proj = layout.linear(store, p + "mlp.c_proj", "second")
        self.n_local_heads = len(layout.head_ids)
        ring = layout.axes.cp
        # Blockwise attention (O(T) kept per head) unless the plan's attention is "full", the op that
        # holds T x T (the reference; bench compares the two; the memory model counts blockwise only).
        self.attention = ops if layout.attention_kind == "full" else attention_blocks
        if ring.size > 1:                   # this rank's chunks attend to the whole sequence over the cp ring
            self.attention = context.RingAttention(ring)

    def modules(self) -> list:
        """The block and its layers: everything that holds a cache."""
        return [self, self.ln_1, self.c_attn, self.c_proj, self.ln_2, self.c_fc, self.mlp_proj]

    def forward(self, x, dropout: Dropout, step: int):
        """x (B_c, T, C_c) -> (B_c, T, C_c)."""
        if not self.checkpoint:
            return self._forward(x, dropout, step)
        self.replay = (self.layout.save_block_input(x), dropout, step)
        y = self._forward(x, dropout, step)                                    # (B_c, T, C_c)
        self._release()
        return y

    def rerun(self) -> None:
        """--recompute blocks: rebuild the caches backward needs from the
        saved input (the same arithmetic as the first forward)."""
        saved, dropout, step = self.replay
        self.replay = None
        self._forward(self.layout.load_block_input(saved), dropout, step)

    def _release(self) -> None:
        self.keep_attn = self.keep_resid_attn = self.keep_resid_mlp = None
        self.attn_cache = self.gelu_cache = None
        for layer in self.modules()[1:]:
            layer.release()

    def _forward(self, x, dropout: Dropout, step: int):
        """x (B_c, T, C_c) -> (B_c, T, C_c), keeping what backward needs."""
        T = x.shape[1]                      # canonical rows: T/tp under --sequence-parallel
        self.keep_resid_attn = dropout.canonical(step, self.site + ".resid_attn", T)
        self.keep_resid_mlp = dropout.canonical(step, self.site + ".resid_mlp", T)

        qkv = self.c_attn.forward(self.ln_1.forward(x))                       # (B_m, T, 3 C_m)
        T = qkv.shape[1]                    # the intermediate form holds whole sequences
        if self.attention is ops:
            self.keep_attn = dropout.attention(step, self.site + ".attn", T)       # (B_m, nh, T, T)
        else:
            self.keep_attn = dropout.attention_blocks(step, self.site + ".attn", T)   # a callable: never (T, T)
        a, self.attn_cache = self.attention.attention_forward(qkv, self.n_local_heads, self.keep_attn,
                                                              dropout.keep)                   # (B_m, T, C_m)
        y = self.c_proj.forward(a)                                             # (B_c, T, C_c)
        if self.keep_resid_attn is not None:
            y *= self.keep_resid_attn
        x = x + y
        f = self.c_fc.forward(self.ln_2.forward(x))                           # (B_m, T, 4 C_m)
        g, self.gelu_cache = ops.gelu_forward(f)
        y = self.mlp_proj.forward(g)                                           # (B_c, T, C_c)
        if self.keep_resid_mlp is not None:
            y *= self.keep_resid_mlp
        return x + y

    def backward(self, dx):
        """dx (B_c, T, C_c) -> (B_c, T, C_c)."""
        dy = dx if self.keep_resid_mlp is None else dx * self.keep_resid_mlp
        dg = self.mlp_proj.backward(dy)
        df = ops.gelu_backward(dg, self.gelu_cache)
        dx = dx + self.ln_2.backward(self.c_fc.backward(df))
        dy = dx if self.keep_resid_attn is None else dx * self.keep_resid_attn
        da = self.c_proj.backward(dy)
        dqkv = self.attention.attention_backward(da, self.attn_cache)
        dx = dx + self.ln_1.backward(self.c_attn.backward(dqkv))
        self.attn_cache = self.gelu_cache = None
        self.keep_attn = self.keep_resid_attn = self.keep_resid_mlp = None   # masks: no longer needed
        return dx

    def decode(self, x, cache, pos: int):
        """Inference on positions pos .. pos+t-1 with a key/value cache
        (mpicube.model.kvcache), no dropout: x (B_c, t, C_c) -> (B_c, t, C_c)."""
        qkv = self.c_attn.forward(self.ln_1.forward(x))                       # (B_m, t, 3 C_m)
        x = x + self.c_proj.forward(kvcache.cached_attention(qkv, self.n_local_heads, cache, pos))
        g, _ = ops.gelu_forward(self.c_fc.forward(self.ln_2.forward(x)))      # (B_m, t, 4 C_m)
        return x + self.mlp_proj.forward(g)
