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
"""

from __future__ import annotations

import math

import numpy as np

from ..device.arrays import array_module


class KVCache:
    """Keys and values of one block for positions 0 .. n_ctx-1:
    (B_m, nh, n_ctx, hd) each, for this rank's sequences and heads, in
    the activations' dtype."""

    def __init__(self, xp, n_seqs: int, n_heads: int, n_ctx: int, head_dim: int, dtype):
        self.k = xp.zeros((n_seqs, n_heads, n_ctx, head_dim), dtype=dtype)   # (B_m, nh, n_ctx, hd)
        self.v = xp.zeros_like(self.k)                                        # (B_m, nh, n_ctx, hd)


def cached_attention(qkv, n_head: int, cache: KVCache, pos: int):
    """qkv (B, t, 3*nh*hd) of positions pos .. pos+t-1, columns [q | k | v]
    with heads contiguous -> y (B, t, nh*hd). Stores this call's keys and
    values in ``cache`` first; position pos+i attends to positions 0 ..
    pos+i (causal within the new block, everything before it)."""
    xp = array_module(qkv)
    B, t, C3 = qkv.shape
    hd = C3 // (3 * n_head)
    end = pos + t
    qkv5 = qkv.reshape(B, t, 3, n_head, hd).transpose(2, 0, 3, 1, 4)     # (3, B, nh, t, hd)
    cache.k[:, :, pos:end] = qkv5[1]
    cache.v[:, :, pos:end] = qkv5[2]
    wide = np.promote_types(qkv.dtype, np.float32)          # 16-bit activations: scores in float32
    q = qkv5[0].astype(wide) * (1.0 / math.sqrt(hd))                      # (B, nh, t, hd)
    keys = cache.k[:, :, :end].astype(wide, copy=False)                   # (B, nh, end, hd)
    values = cache.v[:, :, :end].astype(wide, copy=False)                 # (B, nh, end, hd)
    scores = xp.matmul(q, keys.swapaxes(-1, -2))                         # (B, nh, t, end)
    if t > 1:                                                             # the new block is causal
        later = xp.arange(end)[None, :] > (pos + xp.arange(t))[:, None]   # (t, end)
        scores[..., later] = -xp.inf
    scores -= scores.max(-1, keepdims=True)
    xp.exp(scores, out=scores)
    scores /= scores.sum(-1, keepdims=True)                               # probabilities
    y = xp.matmul(scores, values)                                         # (B, nh, t, hd)
    return xp.ascontiguousarray(y.transpose(0, 2, 1, 3), dtype=qkv.dtype).reshape(B, t, n_head * hd)

