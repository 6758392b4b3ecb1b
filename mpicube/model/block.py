"""One transformer block, the dropout masks it draws, and the wrapper that
recomputes a block in backward, written against the layout protocol
(layouts/base.py) as the GPT that strings the blocks together (``gpt.py``)
is. The masks are a function of (seed, step, site, global index), so every
layout, split of the sequence and pipeline stage drops the same elements as
the serial model.
"""

from __future__ import annotations

import numpy as np

from . import kvcache, llama
from .moe import MoE
from .. import ops
from ..ops import rng
from ..parallel.layouts.base import Layout
from ..parallel.layouts.modules import make_norm
from ..parallel.params import ParamStore
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


class PlainAttention:
    """GPT-2's attention core: the op pair as it is (no positions in it)."""

    def __init__(self, attention, n_local_heads: int):
        self.attention, self.n_local_heads = attention, n_local_heads
        self.n_local_kv = n_local_heads                  # every head its own keys and values

    def attention_forward(self, qkv, positions, mask, keep_prob):
        """qkv (B_m, T, 3 C_m) -> (y (B_m, T, C_m), saved)."""
        return self.attention.attention_forward(qkv, self.n_local_heads, mask, keep_prob)

    def attention_backward(self, dy, saved):
        return self.attention.attention_backward(dy, saved)

    def rotate(self, qkv, positions):
        """qkv as the KV cache's decode takes it: as it is."""
        return qkv


class Gelu:
    """GPT-2's MLP activation between c_fc and c_proj."""

    forward = staticmethod(ops.gelu_forward)         # (B_m, T, 4 C_m) -> (B_m, T, 4 C_m)
    backward = staticmethod(ops.gelu_backward)


class Block:
    """Pre-norm transformer block: x += attn(norm_1(x)); x += mlp(norm_2(x)),
    one skeleton for both families, whose differences are pieces chosen
    from the configuration's ``arch``: the norm (LayerNorm or RMSNorm), the
    attention core (``PlainAttention``, or ``llama.RotaryAttention`` with
    rotary embeddings and grouped-query heads), the MLP's activation
    (``Gelu`` or ``llama.SwiGLU``) and whether the linears have biases.

    ``attention`` is the op pair the build chose (``ops`` for the one that
    holds T x T, ``ops.attention_blocks``, or a ring over the sequence's
    chunks: the same calls). Forward returns its output and the tape entry
    backward takes."""

    def __init__(self, layout: Layout, store: ParamStore, i: int, attention, dropout: Dropout):
        p, cfg = f"h.{i}.", layout.cfg
        bias = not cfg.llama
        self.site = f"h.{i}"
        self.ln_1 = make_norm(store, p + "ln_1", cfg, layout.hidden_comm)
        self.c_attn = layout.linear(store, p + "attn.c_attn", "first", bias=bias)
        self.c_proj = layout.linear(store, p + "attn.c_proj", "second", bias=bias)
        self.ln_2 = make_norm(store, p + "ln_2", cfg, layout.hidden_comm)
        self.moe = MoE(layout, store, i) if cfg.moe else None     # a mixture of experts in the MLP's place
        if self.moe is None:
            self.c_fc = layout.linear(store, p + "mlp.c_fc", "first", bias=bias)
            self.mlp_proj = layout.linear(store, p + "mlp.c_proj", "second", bias=bias)
        self.n_local_heads = len(layout.head_ids)
        self.core = (llama.RotaryAttention(cfg, attention, layout.head_ids) if cfg.llama
                     else PlainAttention(attention, self.n_local_heads))
        self.act = llama.SwiGLU if cfg.llama else Gelu
        self.n_local_kv = self.core.n_local_kv              # the kv heads a KV cache holds (GQA: fewer)
        self.attention, self.dropout = attention, dropout
        self.full_masks = attention is ops                  # the T x T op takes whole masks, the others blocks

    def forward(self, x, ctx: Micro):
        """x (B_c, T, C_c) -> (y (B_c, T, C_c), saved)."""
        T = x.shape[1]                      # canonical rows: T/tp under --sequence-parallel
        drop = self.dropout
        keep_resid_attn = drop.canonical(ctx, self.site + ".resid_attn", T)
        keep_resid_mlp = drop.canonical(ctx, self.site + ".resid_mlp", T)

        h, s_ln1 = self.ln_1.forward(x)                                       # (B_c, T, C_c)
        qkv, s_attn = self.c_attn.forward(h)                                  # (B_m, T, 3 C_m)
        T = qkv.shape[1]                    # the intermediate form holds whole sequences
        masks = drop.attention if self.full_masks else drop.attention_blocks  # (B_m, nh, T, T), or blocks of it
        a, s_core = self.core.attention_forward(qkv, positions(ctx, T), masks(ctx, self.site + ".attn", T),
                                                drop.keep)                                        # (B_m, T, C_m)
        y, s_proj = self.c_proj.forward(a)                                    # (B_c, T, C_c)
        if keep_resid_attn is not None:
            y *= keep_resid_attn
        x = x + y
        h, s_ln2 = self.ln_2.forward(x)                                       # (B_c, T, C_c)
        y, s_mlp = self.mlp_forward(h, ctx)                                   # (B_c, T, C_c)
        if keep_resid_mlp is not None:
            y *= keep_resid_mlp
        saved = (s_ln1, s_attn, s_core, s_proj, keep_resid_attn, s_ln2, s_mlp, keep_resid_mlp)
        return x + y, saved

    def mlp_forward(self, h, ctx: Micro):
        """The MLP, or the mixture of experts: h (B_c, T, C_c) -> (y (B_c, T, C_c), saved)."""
        if self.moe is not None:
            return self.moe.forward(h, ctx)
        f, s_fc = self.c_fc.forward(h)                                        # (B_m, T, 4 C_m) or 2 F_m
        g, s_gelu = self.act.forward(f)                                       # (B_m, T, 4 C_m) or F_m
        y, s_mlp = self.mlp_proj.forward(g)                                   # (B_c, T, C_c)
        return y, (s_fc, s_gelu, s_mlp)

    def mlp_backward(self, dy, saved):
        """dy (B_c, T, C_c) -> dh (B_c, T, C_c)."""
        if self.moe is not None:
            return self.moe.backward(dy, saved)
        s_fc, s_gelu, s_mlp = saved
        dg = self.mlp_proj.backward(dy, s_mlp)
        return self.c_fc.backward(self.act.backward(dg, s_gelu), s_fc)

    def backward(self, dx, saved):
        """dx (B_c, T, C_c) -> (B_c, T, C_c)."""
        s_ln1, s_attn, s_core, s_proj, keep_resid_attn, s_ln2, s_mlp, keep_resid_mlp = saved
        dy = dx if keep_resid_mlp is None else dx * keep_resid_mlp
        dx = dx + self.ln_2.backward(self.mlp_backward(dy, s_mlp), s_ln2)
        dy = dx if keep_resid_attn is None else dx * keep_resid_attn
        da = self.c_proj.backward(dy, s_proj)
        dqkv = self.core.attention_backward(da, s_core)
        return dx + self.ln_1.backward(self.c_attn.backward(dqkv, s_attn), s_ln1)

    def decode(self, x, cache, pos: int):
        """Inference on positions pos .. pos+t-1 with a key/value cache
        (mpicube.model.kvcache), no dropout: x (B_c, t, C_c) -> (B_c, t, C_c)."""
        qkv, _ = self.c_attn.forward(self.ln_1.forward(x)[0])                 # (B_m, t, (nh + 2 nkv) hd)
        qkv = self.core.rotate(qkv, np.arange(pos, pos + qkv.shape[1]))       # q and k rotated; kv heads once
        a = kvcache.cached_attention(qkv, self.n_local_heads, cache, pos, self.core.n_local_kv)   # (B_m, t, C_m)
        x = x + self.c_proj.forward(a)[0]
        return x + self.mlp_forward(self.ln_2.forward(x)[0], None)[0]


class Recomputed:
    """``--recompute blocks``: a block whose tape entry is only its input
    (as the layout keeps it: ``save_block_input``, a row shard on 1-D);
    backward reruns its forward with the same ``Micro`` (so the same
    dropout masks, from the same hash) and then its backward. ``probe``,
    when set by an observer, sees each rebuilt tape entry (the memory a
    rerun holds at its peak)."""

    def __init__(self, block: Block, layout: Layout):
        self.block, self.layout = block, layout
        self.site, self.n_local_kv = block.site, block.n_local_kv
        self.probe = None

    def forward(self, x, ctx: Micro):
        """x (B_c, T, C_c) -> (y, (the kept input, ctx))."""
        return self.block.forward(x, ctx)[0], (self.layout.save_block_input(x), ctx)

    def backward(self, dx, saved):
        kept, ctx = saved
        _, rebuilt = self.block.forward(self.layout.load_block_input(kept), ctx)
        if self.probe is not None:
            self.probe(rebuilt)
        return self.block.backward(dx, rebuilt)

    def decode(self, x, cache, pos: int):
        return self.block.decode(x, cache, pos)
