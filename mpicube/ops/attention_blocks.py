"""Blockwise causal attention: flash-attention's algorithm in array code.

``local.attention_forward`` materialises every head's (T, T) scores and
keeps the probabilities for backward, so attention memory grows with T^2.
Here queries and keys go in blocks of ``block`` positions: for each query
block an online softmax walks the key blocks at or below the diagonal,
keeping each row's running maximum ``m`` and sum ``l`` and rescaling the
running output when the maximum grows. Blocks entirely above the diagonal
are never computed (about half the FLOPs at long T). Forward keeps only
q, k, v, the output y and the per-row log-sum-exp (O(T) per head);
backward recomputes each block's probabilities from that log-sum-exp
(p = exp(s - lse)) and uses D = rowdot(dy, y), which equals
rowsum(dp * p) even under dropout (the dropped probabilities times v are
what produced y), so no T x T array ever exists.

Equal blocks for queries and keys (aligned at multiples of ``block``) keep
every row of a computed block with at least one visible key, so the
running maximum is finite from the first block on.

The same pair step serves context parallelism (``parallel.context``): a
rank's query chunk against a key chunk that arrives over the ring, with
global positions for the causal test and for the dropout mask; partial
results of separate chunks merge with ``merge`` by their log-sum-exps.

Dropout: ``keep_mask`` is None, a full (B, nh, T, T) array (tests: the same
mask the reference op takes), or a callable ``mask(rows, cols)`` that
draws the (B, nh, rows, cols) block of the mask at its global indices
(``model.block.Dropout.attention_blocks``): the same elements as the full
mask, drawn block by block in forward and again in backward, never held.
"""

from __future__ import annotations

import math

from ..device import fused_attention
from ..device.arrays import array_module
from ..device.precision import compute_dtype, narrow, up
from .local import batched_matmul

BLOCK = 128   # positions per query and key block (fastest of 64..256 on CPU at T = 256 and 2048)


def n_blocks(T: int, block: int = BLOCK) -> int:
    """Query (and key) blocks of a sequence of T."""
    return -(-T // block)


def computed_pairs(T: int, block: int = BLOCK) -> int:
    """(query block, key block) pairs at or below the diagonal, the ones
    computed: nb (nb + 1) / 2 of nb^2 (the cost model's attention FLOPs)."""
    nb = n_blocks(T, block)
    return nb * (nb + 1) // 2


def computed_scores(T: int, block: int = BLOCK) -> int:
    """Score elements one head of one sequence computes (each pair's bq x bk,
    the masked half of the diagonal blocks included): T^2/2 + T block/2
    for T a multiple of the block, against T^2 for the full op."""
    full, rest = divmod(T, block)
    squares = full * block * block + rest * rest                       # sum of size_i^2 over the blocks
    return (T * T + squares) // 2                                      # sum over i >= j of size_i size_j


def _mask_source(keep_mask):
    """A callable (rows, cols) -> (B, nh, rows, cols) keep mask, or None."""
    if keep_mask is None or callable(keep_mask):
        return keep_mask
    return lambda rows, cols: keep_mask[:, :, rows, cols]


def _split(qkv, n_head):
    B, T, C3 = qkv.shape
    hd = C3 // (3 * n_head)
    qkv5 = qkv.reshape(B, T, 3, n_head, hd).transpose(2, 0, 3, 1, 4)  # (3, B, nh, T, hd)
    return qkv5[0], qkv5[1], qkv5[2], hd


def _hide_unseen(s, q0, k0):
    """s (B, nh, bq, bk) scores of queries at global positions q0.. and keys
    at k0.. <- -inf where a key lies after its query (the array path; the
    fused kernels skip those keys instead)."""
    bq, bk = s.shape[-2:]
    if k0 + bk - 1 > q0:                                                # the block crosses the diagonal
        xp = array_module(s)
        rows = xp.arange(q0, q0 + bq).reshape(-1, 1)
        cols = xp.arange(k0, k0 + bk).reshape(1, -1)
        s += xp.where(cols > rows, -xp.inf, 0.0).astype(s.dtype)       # (bq, bk)


def pair_forward(state, qb, kb, vb, q0, k0, mask, keep_prob, store_dtype, out=None):
    """One online-softmax step: fold key block (kb, vb) at k0 into the
    running ``state`` = [m (B, nh, bq, 1), l (B, nh, bq, 1), acc (B, nh, bq,
    hd)] of query block qb at q0 (all in the compute format; m starts at
    -inf, l and acc at 0). ``mask`` (B, nh, bq, bk) or None. ``out`` (B, nh,
    bq, hd) in the compute format, for a block's only pair: p v is written
    there instead of added to acc (what adding it to zeros gives)."""
    xp = array_module(qb)
    m, l, acc = state
    s = batched_matmul(qb, kb.swapaxes(-1, -2))                         # (B, nh, bq, bk) scores, in the compute format
    if fused_attention.takes(qb, kb, m):                                # one pass each, NumPy's SIMD exp between
        alpha = xp.empty_like(m)                                        # (B, nh, bq, 1)
        fused_attention.online_max(s, m, alpha, q0, k0)                 # m grows in place; s -= m, -inf if unseen
        p = xp.exp(s, out=s)                                            # (B, nh, bq, bk) unnormalised
        fused_attention.fold_row_sums(p, l, alpha)                      # l = l alpha + rowsum(p)
    else:
        _hide_unseen(s, q0, k0)
        m_new = xp.maximum(m, s.max(-1, keepdims=True))                 # (B, nh, bq, 1)
        alpha = xp.exp(m - m_new)                                       # (B, nh, bq, 1)
        s -= m_new
        p = xp.exp(s, out=s)                                            # (B, nh, bq, bk) unnormalised
        l *= alpha
        l += p.sum(-1, keepdims=True)
        state[0] = m_new
    if mask is not None:
        p *= mask
        p *= 1.0 / keep_prob
    if out is not None:
        batched_matmul(narrow(p, store_dtype), vb, out=out)             # (B, nh, bq, hd)
        return
    acc *= alpha
    acc += batched_matmul(narrow(p, store_dtype), vb)                   # (B, nh, bq, hd)


def attention_forward(qkv, n_head, keep_mask=None, keep_prob=1.0, block=BLOCK):
    """qkv (B, T, 3*nh*hd), columns [q | k | v], heads contiguous in each
    -> y (B, T, nh*hd), the same numbers as ``local.attention_forward``.
    The cache keeps q (scaled), k, v, y and lse (B, nh, T)."""
    xp = array_module(qkv)
    B, T, _ = qkv.shape
    q, k, v, hd = _split(qkv, n_head)                                   # (B, nh, T, hd)
    scale = 1.0 / math.sqrt(hd)
    q = q * q.dtype.type(scale)                                         # (B, nh, T, hd) scaled copy
    mask = _mask_source(keep_mask)
    cd = compute_dtype(qkv.dtype)
    y = xp.empty((B, T, n_head, hd), dtype=qkv.dtype)                   # (B, T, nh, hd)
    y4 = y.transpose(0, 2, 1, 3)                                        # (B, nh, T, hd) view
    lse = xp.empty((B, n_head, T), dtype=cd)                            # (B, nh, T)
    if T <= block and qkv.dtype == cd and fused_attention.takes(q, k, v):   # one pair, written into y
        m, l = xp.full((B, n_head, T, 1), -xp.inf, dtype=cd), xp.zeros((B, n_head, T, 1), dtype=cd)
        mb = None if mask is None else mask(slice(0, T), slice(0, T))
        pair_forward([m, l, None], q, k, v, 0, 0, mb, keep_prob, qkv.dtype, out=y4)
        y4 /= l
        lse[...] = (m + xp.log(l))[..., 0]
        y = y.reshape(B, T, n_head * hd)
        return y, (q, k, v, y, lse, mask, keep_prob, scale, block)
    for i0 in range(0, T, block):
        i1 = min(T, i0 + block)
        qb = q[:, :, i0:i1]                                             # (B, nh, bq, hd)
        state = [xp.full((B, n_head, i1 - i0, 1), -xp.inf, dtype=cd), xp.zeros((B, n_head, i1 - i0, 1), dtype=cd),
                 xp.zeros((B, n_head, i1 - i0, hd), dtype=cd)]
        for j0 in range(0, i1, block):                                  # key blocks above the diagonal: skipped
            j1 = min(T, j0 + block)
            mb = None if mask is None else mask(slice(i0, i1), slice(j0, j1))
            pair_forward(state, qb, k[:, :, j0:j1], v[:, :, j0:j1], i0, j0, mb, keep_prob, qkv.dtype)
        m, l, acc = state
        acc /= l
        y4[:, :, i0:i1] = narrow(acc, qkv.dtype)
        lse[:, :, i0:i1] = (m + xp.log(l))[..., 0]
    y = y.reshape(B, T, n_head * hd)
    return y, (q, k, v, y, lse, mask, keep_prob, scale, block)


def pair_backward(qb, kb, vb, dyb, lse_b, d_b, q0, k0, mask, keep_prob, store_dtype, out=None):
    """Gradients of one (query block, key block) pair from the recomputed
    probabilities: -> (dq_b (B, nh, bq, hd) unscaled, dk_b, dv_b (B, nh,
    bk, hd)), all in the compute format, written into ``out`` (three
    arrays or views of those shapes) if given. lse_b, d_b (B, nh, bq, 1)."""
    out = (None, None, None) if out is None else out
    xp = array_module(qb)
    s = batched_matmul(qb, kb.swapaxes(-1, -2))                         # (B, nh, bq, bk) scores
    if fused_attention.takes(qb, kb, lse_b):
        fused_attention.shift_visible(s, lse_b, q0, k0)                 # s - lse, -inf where unseen
    else:
        _hide_unseen(s, q0, k0)
        s -= lse_b
    p = xp.exp(s, out=s)                                                # (B, nh, bq, bk) probabilities
    dp = batched_matmul(dyb, vb.swapaxes(-1, -2))                       # (B, nh, bq, bk)
    if mask is not None:
        used = p * mask
        used *= 1.0 / keep_prob
        dp *= mask
        dp *= 1.0 / keep_prob
    else:
        used = p
    if q0 == 0 and k0 == 0:
        d_b = first_query_exact(d_b, dp)
    dv = batched_matmul(narrow(used, store_dtype).swapaxes(-1, -2), dyb, out=out[2])   # (B, nh, bk, hd)
    if fused_attention.takes(dp, p, d_b):
        fused_attention.scores_grad(dp, p, d_b)                         # ds = p (dp - D)
    else:
        dp -= d_b
        dp *= p
    ds = narrow(dp, store_dtype)
    return batched_matmul(ds, kb, out=out[0]), batched_matmul(ds.swapaxes(-1, -2), qb, out=out[1]), dv


def first_query_exact(d_b, dp):
    """d_b (B, nh, bq, 1) with its first row replaced by dp_00, for the pair
    at global position (0, 0).

    The sequence's first query sees key 0 only, so its probability there is
    exactly 1, D = rowsum(dp * p) is exactly dp_00, and its score gradient
    p (dp - D) is exactly zero. D = rowdot(dy, y) sums the same products as
    dp_00 in another order, which leaves float64 noise (about 1e-22) that
    differs between layouts whose dy differ in their last bits; a
    tile-scaled FP8 quantizer blows that noise up to full codes (docs/fp8.md,
    "Across layouts"). With D = dp_00 (the exact value, whatever rounding p_00
    carries from the recomputed score) the row's gradient is an exact zero
    on every layout, as the full op's is."""
    d_b = d_b.copy()
    d_b[:, :, :1] = dp[:, :, :1, :1]                                    # (B, nh, 1, 1): the one visible key
    return d_b


def attention_backward(dy, cache):
    """dy (B, T, nh*hd) -> dqkv (B, T, 3*nh*hd)."""
    xp = array_module(dy)
    q, k, v, y, lse, mask, keep_prob, scale, block = cache
    B, nh, T, hd = q.shape
    cd = compute_dtype(dy.dtype)
    dy4 = dy.reshape(B, T, nh, hd).transpose(0, 2, 1, 3)                # (B, nh, T, hd)
    y4 = y.reshape(B, T, nh, hd).transpose(0, 2, 1, 3)                  # (B, nh, T, hd)
    fused = fused_attention.takes(dy4, y4, q)
    if fused:
        d = xp.empty((B, nh, T, 1), dtype=cd)                           # (B, nh, T, 1) = rowsum(dp * p)
        fused_attention.row_dots(dy4, y4, d)
    else:
        d = (up(dy4) * up(y4)).sum(-1, keepdims=True)                   # (B, nh, T, 1) = rowsum(dp * p)
    lse4 = lse[..., None]                                               # (B, nh, T, 1)
    dqkv5 = xp.empty((B, T, 3, nh, hd), dtype=dy.dtype)                 # the layout of qkv's columns
    if fused and T <= block and dy.dtype == cd:   # one pair: its products write into qkv's layout, as the full op's
        g = dqkv5.transpose(2, 0, 3, 1, 4)                              # (3, B, nh, T, hd) views
        mb = None if mask is None else mask(slice(0, T), slice(0, T))
        pair_backward(q, k, v, dy4, lse4, d, 0, 0, mb, keep_prob, dy.dtype, out=g)
        g[0] *= cd.type(scale)
        return dqkv5.reshape(B, T, 3 * nh * hd)
    grads = xp.zeros((3, B, nh, T, hd), dtype=cd)                       # dq, dk, dv in the compute format
    for i0 in range(0, T, block):
        i1 = min(T, i0 + block)
        rows = slice(i0, i1)
        for j0 in range(0, i1, block):
            j1 = min(T, j0 + block)
            cols = slice(j0, j1)
            mb = None if mask is None else mask(rows, cols)
            dq, dk, dv = pair_backward(q[:, :, rows], k[:, :, cols], v[:, :, cols], dy4[:, :, rows],
                                       lse4[:, :, rows], d[:, :, rows], i0, j0, mb, keep_prob, dy.dtype)
            grads[0, :, :, rows] += dq
            grads[1, :, :, cols] += dk
            grads[2, :, :, cols] += dv
    if fused:
        fused_attention.interleave_grads(grads, cd.type(scale), dqkv5)
    else:
        grads[0] *= scale
        dqkv5[...] = narrow(grads.transpose(1, 3, 0, 2, 4), dy.dtype)
    return dqkv5.reshape(B, T, 3 * nh * hd)


def merge(y1, lse1, y2, lse2):
    """Two normalised partial attentions of the same queries over disjoint
    key sets -> the attention over their union: y (..., T, hd), lse (..., T).
    Weights exp(lse_i - lse) are the share of each part's softmax mass."""
    xp = array_module(y1)
    lse = xp.logaddexp(lse1, lse2)                                      # (..., T)
    return y1 * xp.exp(lse1 - lse)[..., None] + y2 * xp.exp(lse2 - lse)[..., None], lse

