"""The attention branch of a block: the column-parallel c_attn, an
attention core between them, the row-parallel c_proj (``SelfAttention``),
and GPT-2's core (``PlainAttention``). A family picks the core (Llama's is
``rotary.RotaryAttention``) and whether the linears have biases; a family
whose attention is shaped otherwise (latent projections, say) supplies
its own module with the same calls: ``forward(h, ctx)``,
``backward(dy, saved)``, ``new_cache(xp, positions, dtype)``,
``decode(h, cache, pos)`` and ``n_local_kv``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import ops
from ..parallel.layouts.base import COLUMN, ROW, Layout
from ..parallel.params import ParamStore
from . import kvcache
from .dropout import Dropout, positions
from .tape import Micro, Saved


@dataclass
class AttentionTape(Saved):
    """What ``SelfAttention`` keeps for backward."""

    c_attn: object          # c_attn's saved input (B_c, T, C_c), or its row shard
    core: object            # the attention core's own (the op's, and rotary's positions)
    c_proj: object          # c_proj's saved input (B_m, T, C_m)


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


class SelfAttention:
    """h (B_c, T, C_c) -> c_attn -> core -> c_proj -> (B_c, T, C_c), before
    the block's residual dropout. ``attention`` is the op pair the build
    chose (``ops`` for the one that holds T x T, ``ops.attention_blocks``,
    or a ring over the sequence's chunks: the same calls); the core wraps
    it (``PlainAttention``, ``rotary.RotaryAttention``)."""

    def __init__(self, layout: Layout, store: ParamStore, prefix: str, core, attention, dropout: Dropout,
                 site: str, bias: bool):
        self.c_attn = layout.linear(store, prefix + ".c_attn", COLUMN, bias=bias)
        self.c_proj = layout.linear(store, prefix + ".c_proj", ROW, bias=bias)
        self.core, self.dropout, self.site = core, dropout, site
        self.n_local_heads, self.n_local_kv = core.n_local_heads, core.n_local_kv   # GQA: fewer kv heads
        self.full_masks = attention is ops                  # the T x T op takes whole masks, the others blocks
        self.n_seqs, self.head_dim = len(layout.mid_seqs), layout.cfg.head_dim

    def forward(self, h, ctx: Micro):
        """h (B_c, T, C_c) -> (y (B_c, T, C_c), AttentionTape)."""
        drop = self.dropout
        qkv, s_attn = self.c_attn.forward(h)                                  # (B_m, T, 3 C_m)
        T = qkv.shape[1]                    # the intermediate form holds whole sequences
        masks = drop.attention if self.full_masks else drop.attention_blocks  # (B_m, nh, T, T), or blocks of it
        a, s_core = self.core.attention_forward(qkv, positions(ctx, T), masks(ctx, self.site + ".attn", T),
                                                drop.keep)                                        # (B_m, T, C_m)
        y, s_proj = self.c_proj.forward(a)                                    # (B_c, T, C_c)
        return y, AttentionTape(s_attn, s_core, s_proj)

    def backward(self, dy, saved: AttentionTape):
        """dy (B_c, T, C_c) -> dh (B_c, T, C_c)."""
        da = self.c_proj.backward(dy, saved.c_proj)
        dqkv = self.core.attention_backward(da, saved.core)
        return self.c_attn.backward(dqkv, saved.c_attn)

    def new_cache(self, xp, positions: int, dtype):
        """An empty key/value cache of this rank's sequences and kv heads over ``positions`` positions."""
        return kvcache.KVCache(xp, self.n_seqs, self.n_local_kv, positions, self.head_dim, dtype)

    def decode(self, h, cache, pos: int):
        """Inference on positions pos .. pos+t-1 with a key/value cache
        (``kvcache``), no dropout: h (B_c, t, C_c) -> (B_c, t, C_c)."""
        qkv, _ = self.c_attn.forward(h)                                       # (B_m, t, (nh + 2 nkv) hd)
        qkv = self.core.rotate(qkv, np.arange(pos, pos + qkv.shape[1]))       # q and k rotated; kv heads once
        a = kvcache.cached_attention(qkv, self.n_local_heads, cache, pos, self.n_local_kv)   # (B_m, t, C_m)
        return self.c_proj.forward(a)[0]
