"""Llama's attention core: rotary embeddings on q and k and grouped-query
heads around any of the block's attention ops (``families/llama.py``
plugs it into ``attention.SelfAttention``; a later family with rotary
positions can reuse it).

Grouped-query attention: c_attn's output columns are [q | k | v] with
n_head, n_kv_head and n_kv_head heads of head_dim columns, declared with
those three group sizes (``ParamDecl.groups``), so every layout's split of
the columns gives each rank the same share of each: whole query heads and
the kv heads they read (query head i reads kv head i // (n_head /
n_kv_head)). A split finer than the kv heads (``heads`` on the decl)
gives each rank its whole query heads and a copy of the one kv head they
read, shared with the other ranks whose queries read it: the layout sums
those columns' gradients over exactly those ranks (``params.SharedColumns``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import ops
from ..core.config import ModelConfig
from ..device.arrays import array_module
from ..parallel.layouts.base import check_head_split
from .tape import Saved


@dataclass
class RotaryTape(Saved):
    """What ``RotaryAttention`` keeps for backward."""

    core: object            # the attention op's own saved activations
    positions: object       # (T,) the global positions q and k were rotated at


class RotaryAttention:
    """Causal attention with rotary embeddings on q and k and grouped-query
    heads, around any of the block's attention ops (T x T, blockwise, the
    context-parallel ring): q and k are rotated at their rows' global
    positions, each kv head is repeated for the query heads that read it,
    and the op runs on the ordinary [q | k | v] of n_local_heads heads. Its
    backward sums the repeats' gradients into their kv head and rotates
    back. ``n_local_heads`` query heads and their ``n_local_kv`` kv heads
    are this rank's (``layout.head_ids``)."""

    def __init__(self, cfg: ModelConfig, attention, head_ids):
        nh = len(head_ids)
        split = cfg.n_head // nh
        check_head_split(cfg, split)
        self.attention, self.n_local_heads = attention, nh
        self.n_local_kv = max(1, cfg.kv_heads // split)   # one shared kv head when the split exceeds them
        self.hd, self.theta = cfg.head_dim, cfg.rope_theta
        self.scaling = None if cfg.rope_scaling is None else cfg.rope_scaling.as_tuple()   # Llama 3's
        self._tables = {}                                 # positions -> (cos, sin) on the device

    def tables(self, positions, like):
        """(cos, sin) (T, hd) in like's format and array module, for ``positions`` (T,)."""
        key = (tuple(np.asarray(positions).tolist()), like.dtype)
        if key not in self._tables:
            xp = array_module(like)
            self._tables[key] = tuple(xp.asarray(t, dtype=like.dtype)
                                      for t in ops.rope_tables(positions, self.hd, self.theta, self.scaling))
        return self._tables[key]

    def rotate(self, qkv, positions):
        """qkv (B, T, (nh + 2 nkv) hd) -> the same columns with q and k rotated
        (kv heads not repeated: what the KV cache stores)."""
        xp = array_module(qkv)
        B, T, _ = qkv.shape
        nh, nkv, hd = self.n_local_heads, self.n_local_kv, self.hd
        q = qkv[..., :nh * hd].reshape(B, T, nh, hd)                        # (B, T, nh, hd)
        k = qkv[..., nh * hd:(nh + nkv) * hd].reshape(B, T, nkv, hd)        # (B, T, nkv, hd)
        cos, sin = self.tables(positions, qkv)                              # (T, hd) each
        q, k = ops.rope_forward(q, cos, sin), ops.rope_forward(k, cos, sin)
        return xp.concatenate([q.reshape(B, T, nh * hd), k.reshape(B, T, nkv * hd), qkv[..., (nh + nkv) * hd:]],
                              axis=-1)

    def pack(self, qkv, positions):
        """qkv (B, T, (nh + 2 nkv) hd) -> (B, T, 3 nh hd): q and k rotated, k and v repeated."""
        xp = array_module(qkv)
        B, T, _ = qkv.shape
        nh, nkv, hd = self.n_local_heads, self.n_local_kv, self.hd
        rotated = self.rotate(qkv, positions)
        q = rotated[..., :nh * hd]                                          # (B, T, nh hd)
        k = rotated[..., nh * hd:(nh + nkv) * hd].reshape(B, T, nkv, hd)    # (B, T, nkv, hd)
        v = rotated[..., (nh + nkv) * hd:].reshape(B, T, nkv, hd)           # (B, T, nkv, hd)
        rep = nh // nkv
        k, v = xp.repeat(k, rep, axis=2), xp.repeat(v, rep, axis=2)         # (B, T, nh, hd): head i reads i // rep
        return xp.concatenate([q, k.reshape(B, T, nh * hd), v.reshape(B, T, nh * hd)], axis=-1)

    def unpack_backward(self, dpacked, positions):
        """dpacked (B, T, 3 nh hd) -> dqkv (B, T, (nh + 2 nkv) hd)."""
        xp = array_module(dpacked)
        B, T, _ = dpacked.shape
        nh, nkv, hd = self.n_local_heads, self.n_local_kv, self.hd
        rep = nh // nkv
        dq, dk, dv = (dpacked[..., g * nh * hd:(g + 1) * nh * hd].reshape(B, T, nh, hd) for g in range(3))
        dk = dk.reshape(B, T, nkv, rep, hd).sum(3)                          # (B, T, nkv, hd)
        dv = dv.reshape(B, T, nkv, rep, hd).sum(3)
        cos, sin = self.tables(positions, dpacked)
        dq, dk = ops.rope_backward(dq, cos, sin), ops.rope_backward(dk, cos, sin)
        return xp.concatenate([dq.reshape(B, T, nh * hd), dk.reshape(B, T, nkv * hd), dv.reshape(B, T, nkv * hd)],
                              axis=-1)

    def attention_forward(self, qkv, positions, mask, keep_prob):
        """qkv (B_m, T, (nh + 2 nkv) hd) -> (y (B_m, T, nh hd), saved)."""
        y, s_core = self.attention.attention_forward(self.pack(qkv, positions), self.n_local_heads, mask, keep_prob)
        return y, RotaryTape(s_core, positions)

    def attention_backward(self, dy, saved):
        """dy (B_m, T, nh hd) -> dqkv (B_m, T, (nh + 2 nkv) hd)."""
        return self.unpack_backward(self.attention.attention_backward(dy, saved.core), saved.positions)
