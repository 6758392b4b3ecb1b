"""Local kernels: forward/backward pairs with no communication of their own.

Where a kernel needs a sum over a dimension that a layout may have split
across ranks (the hidden size for LayerNorm, the vocabulary for the softmax),
it takes the reduction as a callable (``allsum``, ``allmax``); serial code
passes the identity. Backward functions return input gradients and add
parameter gradients into the buffers they are given (``+=``), as in llm.c.

Shapes: B batch rows held locally, T sequence, C local hidden width,
nh local heads, hd head size, V local vocabulary.
"""

from __future__ import annotations

import math

import numpy as np

from . import fused


def identity(x):
    return x


# Elementwise chains (GELU, softmax) make several passes over arrays far larger
# than the CPU caches. On NumPy they run block by block, so that all passes over
# a block hit the cache; on a GPU one block is the whole array (one kernel each).
CACHE_ELEMS = 1 << 15


def row_blocks(xp, n_rows: int, row_elems: int):
    """Slices of the first axis, each about CACHE_ELEMS elements (NumPy), or
    one slice of everything (CuPy)."""
    step = n_rows if xp.__name__ != "numpy" else max(1, CACHE_ELEMS // max(1, row_elems))
    for lo in range(0, n_rows, step):
        yield slice(lo, min(n_rows, lo + step))


# --- LayerNorm ---------------------------------------------------------------
def layernorm_forward(x, gamma, beta, n_hidden, eps=1e-5, allsum=identity):
    """x (B, T, C) -> y (B, T, C); statistics over the full hidden size
    ``n_hidden``, of which this rank holds C columns. Two passes (mean, then
    centred variance) keep float32 accurate."""
    if fused.active(x, gamma, beta):
        return _layernorm_forward_fused(x, gamma, beta, n_hidden, eps, allsum)
    mean = allsum(x.sum(-1, keepdims=True)) / n_hidden               # (B, T, 1)
    xc = x - mean                                                    # (B, T, C)
    var = allsum(rowdot(xc, xc)[..., None]) / n_hidden               # (B, T, 1)
    rstd = 1.0 / (var + eps) ** 0.5                                  # (B, T, 1)
    xhat = xc
    xhat *= rstd                                                     # (B, T, C)
    y = xhat * gamma                                                 # (B, T, C)
    y += beta
    return y, (xhat, rstd)


def layernorm_backward(dy, cache, gamma, dgamma, dbeta, n_hidden, allsum=identity):
    """dy (B, T, C) -> dx (B, T, C); adds into dgamma, dbeta (C,)."""
    xhat, rstd = cache
    xp = _xp(dy)
    C = dy.shape[-1]
    dgamma += xp.einsum("ij,ij->j", dy.reshape(-1, C), xhat.reshape(-1, C))   # one pass, no temporary
    dbeta += dy.sum((0, 1))
    if fused.active(dy, xhat, gamma):
        return _layernorm_backward_fused(dy, xhat, rstd, gamma, n_hidden, allsum)
    dxhat = dy * gamma                                               # (B, T, C)
    sums = allsum(_stack_last(dxhat.sum(-1), rowdot(dxhat, xhat)))  # (B, T, 2)
    mean_dxhat = sums[..., 0:1] / n_hidden
    mean_dxhat_xhat = sums[..., 1:2] / n_hidden
    dx = dxhat
    dx -= mean_dxhat
    dx -= xhat * mean_dxhat_xhat
    dx *= rstd
    return dx


def _layernorm_forward_fused(x, gamma, beta, n_hidden, eps, allsum):
    """layernorm_forward in three threaded passes, split at its two all-reduces."""
    C = x.shape[-1]
    x2 = x.reshape(-1, C)                                            # (n, C)
    stats = np.empty(x2.shape[0], dtype=x.dtype)                     # (n,)
    fused.row_sums(x2, stats)
    mean = allsum(stats) / n_hidden                                  # (n,)
    xhat = np.empty_like(x2)                                         # (n, C) centred, then normalised
    fused.center_rows(x2, mean, xhat, stats)
    rstd = 1.0 / (allsum(stats) / n_hidden + eps) ** 0.5             # (n,)
    y = np.empty_like(x2)                                            # (n, C)
    fused.normalize_rows(xhat, rstd, gamma, beta, y)
    return y.reshape(x.shape), (xhat.reshape(x.shape), rstd.reshape(x.shape[:-1] + (1,)))


def _layernorm_backward_fused(dy, xhat, rstd, gamma, n_hidden, allsum):
    """The input gradient of layernorm_backward: one threaded pass for the two
    row sums, one all-reduce, one threaded pass for dx."""
    C = dy.shape[-1]
    dy2, xhat2 = dy.reshape(-1, C), xhat.reshape(-1, C)              # (n, C)
    sums = np.empty((dy2.shape[0], 2), dtype=dy.dtype)               # (n, 2)
    fused.layernorm_grad_sums(dy2, gamma, xhat2, sums)
    means = allsum(sums) / n_hidden                                  # (n, 2)
    dx = np.empty_like(dy2)                                          # (n, C)
    fused.layernorm_grad_input(dy2, gamma, xhat2, np.ascontiguousarray(rstd.reshape(-1)), means, dx)
    return dx.reshape(dy.shape)


def rowdot(a, b):
    """sum(a * b, axis=-1) in one pass, without the product temporary."""
    xp = _xp(a)
    if hasattr(xp, "vecdot"):
        return xp.vecdot(a, b)
    return (a * b).sum(-1)  # pragma: no cover - array modules without vecdot


def _stack_last(a, b):
    xp = _xp(a)
    return xp.stack([a, b], axis=-1)


def _xp(a):
    """The array module of ``a`` (numpy or cupy)."""
    mod = type(a).__module__
    if mod.startswith("cupy"):
        import cupy

        return cupy
    import numpy

    return numpy


# --- GELU (tanh approximation, as GPT-2) --------------------------------------
_GELU_S = math.sqrt(2.0 / math.pi)


def gelu_forward(x):
    """x (..., C) -> y (..., C); keeps x and tanh(...) for backward."""
    xp = _xp(x)
    x2 = x.reshape(-1, x.shape[-1])                                  # (n, C)
    y, t = xp.empty_like(x2), xp.empty_like(x2)
    if fused.active(x2):
        fused.gelu_tanh_argument(x2.reshape(-1), t.reshape(-1))
        xp.tanh(t, out=t)
        fused.gelu_from_tanh(x2.reshape(-1), t.reshape(-1), y.reshape(-1))
        return y.reshape(x.shape), (x2, t)
    for rows in row_blocks(xp, *x2.shape):
        xb, tb, yb = x2[rows], t[rows], y[rows]
        xp.multiply(xb, xb, out=tb)                                  # t = tanh(s (x + 0.044715 x^3))
        tb *= 0.044715
        tb += 1.0
        tb *= xb
        tb *= _GELU_S
        xp.tanh(tb, out=tb)
        xp.add(tb, 1.0, out=yb)                                      # y = 0.5 x (1 + t)
        yb *= xb
        yb *= 0.5
    return y.reshape(x.shape), (x2, t)


def gelu_backward(dy, cache):
    """dy (..., C) -> dx (..., C):
    dx = dy (0.5 (1 + t) + 0.5 x (1 - t^2) s (1 + 3 * 0.044715 x^2))."""
    xp = _xp(dy)
    x2, t = cache
    dy2 = dy.reshape(x2.shape)
    dx = xp.empty_like(x2)
    if fused.active(dy2, x2, t):
        fused.gelu_backward(dy2.reshape(-1), x2.reshape(-1), t.reshape(-1), dx.reshape(-1))
        return dx.reshape(dy.shape)
    work = xp.empty(min(x2.size, max(CACHE_ELEMS, x2.shape[1])), dtype=x2.dtype)
    for rows in row_blocks(xp, *x2.shape):
        xb, tb, out = x2[rows], t[rows], dx[rows]
        w = work[: xb.size].reshape(xb.shape)
        xp.multiply(xb, xb, out=w)
        w *= 3 * 0.044715
        w += 1.0
        w *= xb
        w *= _GELU_S * 0.5                                           # 0.5 s x (1 + 3c x^2)
        xp.multiply(tb, tb, out=out)
        xp.subtract(1.0, out, out=out)                               # 1 - t^2
        out *= w
        out += 0.5
        xp.multiply(tb, 0.5, out=w)
        out += w                                                     # + 0.5 (1 + t)
        out *= dy2[rows]
    return dx.reshape(dy.shape)


# --- causal multi-head attention ---------------------------------------------
def attention_forward(qkv, n_head, keep_mask=None, keep_prob=1.0):
    """qkv (B, T, 3*nh*hd), columns [q | k | v] with heads contiguous in each
    -> y (B, T, nh*hd). ``keep_mask`` (B, nh, T, T) is the dropout mask on the
    attention probabilities (None: no dropout)."""
    B, T, C3 = qkv.shape
    hd = C3 // (3 * n_head)
    qkv5 = qkv.reshape(B, T, 3, n_head, hd).transpose(2, 0, 3, 1, 4)  # (3, B, nh, T, hd)
    q, k, v = qkv5[0], qkv5[1], qkv5[2]                               # (B, nh, T, hd)
    scale = 1.0 / math.sqrt(hd)
    q = q * scale                      # scaling q is T/hd times cheaper than scaling the scores
    probs = batched_matmul(q, k.swapaxes(-1, -2))                     # (B, nh, T, T) scores
    causal_softmax(probs.reshape(-1, T, T))
    used = probs if keep_mask is None else probs * keep_mask * (1.0 / keep_prob)
    y = _xp(qkv).empty((B, T, n_head, hd), dtype=qkv.dtype)           # (B, T, nh, hd)
    batched_matmul(used, v, out=y.transpose(0, 2, 1, 3))             # written in place: no transpose copy
    return y.reshape(B, T, n_head * hd), (q, k, v, probs, used, keep_mask, keep_prob, scale)   # q already scaled


def attention_backward(dy, cache):
    """dy (B, T, nh*hd) -> dqkv (B, T, 3*nh*hd)."""
    xp = _xp(dy)
    q, k, v, probs, used, keep_mask, keep_prob, scale = cache
    B, nh, T, hd = q.shape
    dy4 = dy.reshape(B, T, nh, hd).transpose(0, 2, 1, 3)             # (B, nh, T, hd)
    dqkv5 = xp.empty((B, T, 3, nh, hd), dtype=dy.dtype)              # the layout of qkv's columns
    dqkv = dqkv5.transpose(2, 0, 3, 1, 4)                             # (3, B, nh, T, hd) view, GEMMs write into it
    bmm = batched_matmul
    bmm(used.swapaxes(-1, -2), dy4, out=dqkv[2])                      # dv
    dscores = bmm(dy4, v.swapaxes(-1, -2))                            # (B, nh, T, T) d probs
    if keep_mask is not None:
        dscores *= keep_mask
        dscores *= 1.0 / keep_prob
    causal_softmax_backward(dscores.reshape(-1, T, T), probs.reshape(-1, T, T))
    bmm(dscores, k, out=dqkv[0])                                      # dq = ds k scale
    dqkv[0] *= scale
    bmm(dscores.swapaxes(-1, -2), q, out=dqkv[1])                     # dk = ds^T (q scale)
    return dqkv5.reshape(B, T, 3 * nh * hd)


def batched_matmul(a, b, out=None):
    """a (B, nh, n, k) @ b (B, nh, k, m) -> (B, nh, n, m): attention's many
    small GEMMs, split over threads where fused.splits_batch says so."""
    if fused.splits_batch(a, b):
        return fused.batched_matmul(a, b, out)
    xp = _xp(a)
    if out is None or xp.__name__ == "numpy":
        return xp.matmul(a, b, out=out)
    out[...] = xp.matmul(a, b)           # CuPy: ``out`` here is a strided view, which its matmul may refuse
    return out


def causal_softmax(s):
    """s (M, T, T) scores -> causal softmax probabilities, in place."""
    if fused.active(s):
        fused.softmax_causal(s)
        return
    xp = _xp(s)
    bias = causal_bias(xp, s.shape[-1], s.dtype)
    for mats in row_blocks(xp, s.shape[0], s.shape[1] * s.shape[2]):   # cache block by block
        block = s[mats]
        block += bias
        block -= block.max(-1, keepdims=True)
        xp.exp(block, out=block)
        block /= block.sum(-1, keepdims=True)


def causal_softmax_backward(d, p):
    """d (M, T, T) gradient w.r.t. probabilities p -> w.r.t. the scores, in
    place: ds = p (dp - sum(dp p))."""
    if fused.active(d, p):
        fused.softmax_causal_backward(d, p)
        return
    xp = _xp(d)
    for mats in row_blocks(xp, d.shape[0], d.shape[1] * d.shape[2]):
        dm, pm = d[mats], p[mats]
        dm -= rowdot(dm, pm)[..., None]
        dm *= pm


_CAUSAL = {}


def causal_bias(xp, T, dtype):
    """(T, T) additive mask: 0 on and below the diagonal, -inf above."""
    key = (xp.__name__, T, dtype)
    if key not in _CAUSAL:
        bias = xp.zeros((T, T), dtype=dtype)
        bias[xp.triu_indices(T, 1)] = -xp.inf
        _CAUSAL[key] = bias
    return _CAUSAL[key]


# --- softmax cross-entropy over a (possibly split) vocabulary -----------------
def cross_entropy_forward(logits, targets, vocab_start, vocab_size, allmax=identity, allsum=identity):
    """logits (n, V) hold vocabulary columns [vocab_start, vocab_start + V) of
    a vocabulary of ``vocab_size`` real entries (columns past it are padding
    and masked out). targets (n,) global ids. Returns per-row loss (n,).
    Three reductions over the vocabulary split: max, sum of exp, target logit."""
    xp = _xp(logits)
    n, V = logits.shape
    n_real = max(0, min(V, vocab_size - vocab_start))
    z = logits.copy()                                                 # (n, V)
    if n_real < V:
        z[:, n_real:] = -xp.inf
    row_max = allmax(z.max(-1))                                       # (n,)
    z -= row_max[:, None]
    probs = xp.exp(z, out=z)                                          # (n, V) unnormalised
    sum_exp = allsum(probs.sum(-1))                                   # (n,)
    probs /= sum_exp[:, None]
    local_t = targets - vocab_start                                   # (n,)
    mine = (local_t >= 0) & (local_t < V)                             # (n,)
    rows = xp.arange(n)
    t_clip = xp.clip(local_t, 0, V - 1)
    target_logit = allsum(xp.where(mine, logits[rows, t_clip], 0.0))  # (n,)
    loss = xp.log(sum_exp) + row_max - target_logit                   # (n,)
    return loss, (probs, mine, t_clip)


def cross_entropy_backward(scale, cache):
    """d(scale * sum(loss))/dlogits (n, V); no communication needed."""
    xp = _xp(cache[0])
    probs, mine, t_clip = cache
    dlogits = probs * scale                                           # (n, V)
    rows = xp.arange(probs.shape[0])
    dlogits[rows[mine], t_clip[mine]] -= scale
    return dlogits


# --- token embedding lookup over a vocabulary block ---------------------------
def embedding_forward(ids, weight, vocab_start):
    """ids (B, T) global -> (B, T, C): rows of ``weight`` (V, C), which holds
    vocabulary [vocab_start, vocab_start + V); ids outside give zeros (another
    rank adds them)."""
    xp = _xp(weight)
    V = weight.shape[0]
    local = ids - vocab_start
    mine = (local >= 0) & (local < V)                                 # (B, T)
    out = weight[xp.clip(local, 0, V - 1)]                           # (B, T, C)
    if not bool(mine.all()):
        out *= mine[..., None]
    return out, (local, mine)


def embedding_backward(dy, cache, dweight):
    """Adds dy (B, T, C) into the rows of dweight (V, C) its ids selected."""
    local, mine = cache
    scatter_add(dweight, local[mine], dy[mine])


def scatter_add(target, rows, values):
    """target[rows] += values, summing repeated rows."""
    xp = _xp(target)
    if target.ndim == 2 and fused.active(values, target):
        fused.scatter_add_rows(target, xp.ascontiguousarray(rows), values)
    elif xp.__name__ == "numpy":
        xp.add.at(target, rows, values)
    else:  # pragma: no cover - GPU only
        import cupyx

        cupyx.scatter_add(target, rows, values)
