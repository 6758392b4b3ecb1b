"""Incremental decoding: a key/value cache per block and the attention of
new positions against it.

Training attention (``ops.attention_forward``) recomputes every position's
keys and values. When text is generated one token at a time, the keys and
values of earlier positions never change, so each block keeps them: a new
token then costs one position's linears plus one row of attention scores
against the cached keys, instead of a forward pass over the whole prefix.
Heads are local to a rank in every layout (sequences are never split), so
the cache needs no communication: each rank keeps its own heads of its own
sequences.

Grouped-query attention (Llama): the cache holds the kv heads only, n_kv
of them, not one copy per query head; the n_head / n_kv query heads of a
group are scored against their kv head by broadcasting (query head i reads
kv head i // (n_head / n_kv), as ``rotary.RotaryAttention`` repeats them in
training). That is GQA's memory saving: the cache is n_kv / n_head of
multi-head attention's.
"""

from __future__ import annotations

import math

import numpy as np

from ..device.arrays import array_module


class KVCache:
    """Keys and values of one block for positions 0 .. n_ctx-1 (``n_ctx``:
    the positions a generation uses, at most the model's context):
    (B_m, nkv, n_ctx, hd) each, for this rank's sequences and kv heads
    (its query heads under multi-head attention), in the activations' dtype."""

    def __init__(self, xp, n_seqs: int, n_kv_heads: int, n_ctx: int, head_dim: int, dtype):
        self.k = xp.zeros((n_seqs, n_kv_heads, n_ctx, head_dim), dtype=dtype)   # (B_m, nkv, n_ctx, hd)
        self.v = xp.zeros_like(self.k)                                           # (B_m, nkv, n_ctx, hd)


def cached_attention(qkv, n_head: int, cache: KVCache, pos: int, n_kv: int = None):
    """qkv (B, t, (nh + 2 nkv) hd) of positions pos .. pos+t-1, columns
    [q | k | v] with nh query heads and ``n_kv`` (default nh) kv heads,
    heads contiguous -> y (B, t, nh*hd). Stores this call's keys and values
    in ``cache`` first; position pos+i attends to positions 0 .. pos+i
    (causal within the new block, everything before it)."""
    xp = array_module(qkv)
    nkv = n_head if n_kv is None else n_kv
    rep = n_head // nkv                                  # query heads per kv head
    B, t, C = qkv.shape
    hd = C // (n_head + 2 * nkv)
    end = pos + t
    q = qkv[..., :n_head * hd].reshape(B, t, nkv, rep, hd).transpose(0, 2, 3, 1, 4)   # (B, nkv, rep, t, hd)
    kv = qkv[..., n_head * hd:].reshape(B, t, 2, nkv, hd).transpose(2, 0, 3, 1, 4)    # (2, B, nkv, t, hd)
    cache.k[:, :, pos:end] = kv[0]
    cache.v[:, :, pos:end] = kv[1]
    wide = np.promote_types(qkv.dtype, np.float32)          # 16-bit activations: scores in float32
    q = q.astype(wide) * (1.0 / math.sqrt(hd))                            # (B, nkv, rep, t, hd)
    keys = cache.k[:, :, None, :end].astype(wide, copy=False)             # (B, nkv, 1, end, hd): shared by the group
    values = cache.v[:, :, None, :end].astype(wide, copy=False)           # (B, nkv, 1, end, hd)
    scores = xp.matmul(q, keys.swapaxes(-1, -2))                         # (B, nkv, rep, t, end)
    if t > 1:                                                             # the new block is causal
        later = xp.arange(end)[None, :] > (pos + xp.arange(t))[:, None]   # (t, end)
        scores[..., later] = -xp.inf
    scores -= scores.max(-1, keepdims=True)
    xp.exp(scores, out=scores)
    scores /= scores.sum(-1, keepdims=True)                               # probabilities
    y = xp.matmul(scores, values)                                         # (B, nkv, rep, t, hd): head g rep + r
    return xp.ascontiguousarray(y.transpose(0, 3, 1, 2, 4), dtype=qkv.dtype).reshape(B, t, n_head * hd)

