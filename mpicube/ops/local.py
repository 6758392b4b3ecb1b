"""Local kernels: forward/backward pairs with no communication of their own.

Where a kernel needs a sum over a dimension that a layout may have split
across ranks (the hidden size for LayerNorm, the vocabulary for the softmax),
it takes the reduction as a callable (``allsum``, ``allmax``); serial code
passes the identity. Backward functions return input gradients and add
parameter gradients into the buffers they are given (``+=``), as in llm.c.

Shapes: B batch rows held locally, T sequence, C local hidden width,
nh local heads, hd head size, V local vocabulary.

Every function runs on NumPy or CuPy arrays (the array module is the
inputs'). Where a fused kernel module applies (``fused``: numba on the CPU;
``cuda_kernels``: CuPy kernels on a GPU; both offer the same functions with
the same output arguments), it does the work in fewer passes; otherwise the
plain array code below runs, which is also what MPICUBE_KERNELS=numpy
forces on either device. Nothing here copies data to the host, so a GPU
step never waits on a device-to-host transfer inside an op.

16-bit inputs (mixed precision, ``mpicube.device.precision``): each op upcasts what
it reads to float32, computes there (statistics, softmax and cross-entropy
included, and the fused kernels apply to the float32 copies), and returns
and caches its results rounded to the input's format; LayerNorm's
per-row statistics stay float32. Parameter gradients are added into the
float32 gradient buffers without a 16-bit rounding.
"""

from __future__ import annotations

import math

import numpy as np

from ..device import cuda_kernels, fused, gemm_threads, precision
from ..device.arrays import array_module, identity  # noqa: F401 (identity: part of the ops API)
from . import rng
from ..device.kernels import kernels_for
from ..device.precision import compute_dtype, is_half, narrow, up


# Elementwise chains (GELU, softmax) make several passes over arrays far larger
# than the CPU caches. On NumPy they run block by block, so that all passes over
# a block hit the cache; on a GPU one block is the whole array (one kernel each).
CACHE_ELEMS = 1 << 15


def block_rows(xp, n_rows: int, row_elems: int) -> int:
    """Rows per block: about CACHE_ELEMS elements on NumPy, all of them on a GPU."""
    return max(1, CACHE_ELEMS // max(1, row_elems)) if xp is np else max(1, n_rows)


def row_blocks(xp, n_rows: int, row_elems: int):
    """Slices of the first axis, ``block_rows`` rows each."""
    step = block_rows(xp, n_rows, row_elems)
    for lo in range(0, n_rows, step):
        yield slice(lo, min(n_rows, lo + step))


def column_sums(a):
    """a (n, C) -> (C,) sums over the rows, in a's compute format (float32
    for 16-bit a). Narrow types are accumulated in float64: a running
    float32 sum over millions of rows (a bias gradient of a large batch)
    loses about 4% where float64 loses nothing visible."""
    if a.dtype.itemsize >= 8:
        return a.sum(0)
    if fused.active(a):
        sums = np.empty(a.shape[1])                                      # (C,) float64
        fused.column_sums(a, sums)
        return sums.astype(a.dtype)
    return a.sum(0, dtype=np.float64).astype(compute_dtype(a.dtype))


def column_dots(a, b):
    """a, b (n, C) -> (C,) sums over the rows of a * b, accumulated as in column_sums."""
    xp = array_module(a)
    if a.dtype.itemsize >= 8:
        return xp.einsum("ij,ij->j", a, b)          # one pass, no temporary
    if fused.active(a, b):
        sums = np.empty(a.shape[1])                                      # (C,) float64
        fused.column_dots(a, b, sums)
        return sums.astype(a.dtype)
    return (up(a) * up(b)).sum(0, dtype=np.float64).astype(compute_dtype(a.dtype))


# --- LayerNorm ---------------------------------------------------------------
def layernorm_forward(x, gamma, beta, n_hidden, eps=1e-5, allsum=identity):
    """x (B, T, C) -> y (B, T, C); statistics over the full hidden size
    ``n_hidden``, of which this rank holds C columns. Two passes (mean, then
    centred variance) keep float32 accurate. The cache is (xhat, rstd):
    xhat in x's format, rstd (B, T, 1) in the compute format."""
    if is_half(x.dtype):
        y, (xhat, rstd) = layernorm_forward(up(x), up(gamma), up(beta), n_hidden, eps, allsum)
        return narrow(y, x.dtype), (narrow(xhat, x.dtype), rstd)
    k = kernels_for(x, gamma, beta)
    if k is not None:
        return _layernorm_forward_fused(k, x, gamma, beta, n_hidden, eps, allsum)
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
    if is_half(dy.dtype):
        dx = layernorm_backward(up(dy), (up(xhat), rstd), up(gamma), dgamma, dbeta, n_hidden, allsum)
        return narrow(dx, dy.dtype)
    C = dy.shape[-1]
    dgamma += column_dots(dy.reshape(-1, C), xhat.reshape(-1, C))
    dbeta += column_sums(dy.reshape(-1, C))
    k = kernels_for(dy, xhat, gamma)
    if k is not None:
        return _layernorm_backward_fused(k, dy, xhat, rstd, gamma, n_hidden, allsum)
    dxhat = dy * gamma                                               # (B, T, C)
    sums = allsum(_stack_last(dxhat.sum(-1), rowdot(dxhat, xhat)))  # (B, T, 2)
    mean_dxhat = sums[..., 0:1] / n_hidden
    mean_dxhat_xhat = sums[..., 1:2] / n_hidden
    dx = dxhat
    dx -= mean_dxhat
    dx -= xhat * mean_dxhat_xhat
    dx *= rstd
    return dx


def _layernorm_forward_fused(k, x, gamma, beta, n_hidden, eps, allsum):
    """layernorm_forward in three passes of kernel module ``k``, split at
    its two all-reduces."""
    xp = array_module(x)
    C = x.shape[-1]
    x2 = x.reshape(-1, C)                                            # (n, C)
    stats = xp.empty(x2.shape[0], dtype=x.dtype)                     # (n,)
    k.row_sums(x2, stats)
    mean = allsum(stats) / n_hidden                                  # (n,)
    xhat = xp.empty_like(x2)                                         # (n, C) centred, then normalised
    k.center_rows(x2, mean, xhat, stats)
    rstd = 1.0 / (allsum(stats) / n_hidden + eps) ** 0.5             # (n,)
    y = xp.empty_like(x2)                                            # (n, C)
    k.normalize_rows(xhat, rstd, gamma, beta, y)
    return y.reshape(x.shape), (xhat.reshape(x.shape), rstd.reshape(x.shape[:-1] + (1,)))


def _layernorm_backward_fused(k, dy, xhat, rstd, gamma, n_hidden, allsum):
    """The input gradient of layernorm_backward: one pass of kernel module
    ``k`` for the two row sums, one all-reduce, one pass for dx."""
    xp = array_module(dy)
    C = dy.shape[-1]
    dy2, xhat2 = dy.reshape(-1, C), xhat.reshape(-1, C)              # (n, C)
    sums = xp.empty((dy2.shape[0], 2), dtype=dy.dtype)               # (n, 2)
    k.layernorm_grad_sums(dy2, gamma, xhat2, sums)
    means = allsum(sums) / n_hidden                                  # (n, 2)
    dx = xp.empty_like(dy2)                                          # (n, C)
    k.layernorm_grad_input(dy2, gamma, xhat2, xp.ascontiguousarray(rstd.reshape(-1)), means, dx)
    return dx.reshape(dy.shape)


def rowdot(a, b):
    """sum(a * b, axis=-1) in one pass, without the product temporary."""
    xp = array_module(a)
    if hasattr(xp, "vecdot"):
        return xp.vecdot(a, b)
    return (a * b).sum(-1)  # pragma: no cover - array modules without vecdot


def _stack_last(a, b):
    xp = array_module(a)
    return xp.stack([a, b], axis=-1)


# --- GELU (tanh approximation, as GPT-2) --------------------------------------
_GELU_S = math.sqrt(2.0 / math.pi)


def gelu_forward(x):
    """x (..., C) -> y (..., C); keeps x and tanh(...) for backward."""
    if is_half(x.dtype):
        y, (_, t) = gelu_forward(up(x))
        return narrow(y, x.dtype), (x.reshape(-1, x.shape[-1]), narrow(t, x.dtype))
    xp = array_module(x)
    x2 = x.reshape(-1, x.shape[-1])                                  # (n, C)
    y, t = xp.empty_like(x2), xp.empty_like(x2)
    k = kernels_for(x2)
    if k is not None:
        k.gelu_forward(x2.reshape(-1), t.reshape(-1), y.reshape(-1))
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
    xp = array_module(dy)
    x2, t = cache
    if is_half(dy.dtype):
        return narrow(gelu_backward(up(dy), (up(x2), up(t))), dy.dtype)
    dy2 = dy.reshape(x2.shape)
    dx = xp.empty_like(x2)
    k = kernels_for(dy2, x2, t)
    if k is not None:
        k.gelu_backward(dy2.reshape(-1), x2.reshape(-1), t.reshape(-1), dx.reshape(-1))
        return dx.reshape(dy.shape)
    work = xp.empty((min(x2.shape[0], block_rows(xp, *x2.shape)), x2.shape[1]), dtype=x2.dtype)  # (rows, C)
    for rows in row_blocks(xp, *x2.shape):
        xb, tb, out = x2[rows], t[rows], dx[rows]
        w = work[: xb.shape[0]]
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
    q = q * q.dtype.type(scale)        # scaling q is T/hd times cheaper than scaling the scores; keeps q's format
    probs = batched_matmul(q, k.swapaxes(-1, -2))                     # (B, nh, T, T) scores
    causal_softmax(probs.reshape(-1, T, T))
    used = probs if keep_mask is None else probs * keep_mask * (1.0 / keep_prob)
    if is_half(qkv.dtype):                   # scores and softmax ran in float32; store 16 bits
        probs, used = narrow(probs, qkv.dtype), (None if keep_mask is None else narrow(used, qkv.dtype))
        used = probs if used is None else used
    y = array_module(qkv).empty((B, T, n_head, hd), dtype=qkv.dtype)           # (B, T, nh, hd)
    batched_matmul(used, v, out=y.transpose(0, 2, 1, 3))             # written in place: no transpose copy
    return y.reshape(B, T, n_head * hd), (q, k, v, probs, used, keep_mask, keep_prob, scale)   # q already scaled


def attention_backward(dy, cache):
    """dy (B, T, nh*hd) -> dqkv (B, T, 3*nh*hd)."""
    xp = array_module(dy)
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
    causal_softmax_backward(dscores.reshape(-1, T, T), up(probs).reshape(-1, T, T))
    bmm(dscores, k, out=dqkv[0])                                      # dq = ds k scale
    dqkv[0] *= scale
    bmm(dscores.swapaxes(-1, -2), q, out=dqkv[1])                     # dk = ds^T (q scale)
    return dqkv5.reshape(B, T, 3 * nh * hd)


def batched_matmul(a, b, out=None):
    """a (B, nh, n, k) @ b (B, nh, k, m) -> (B, nh, n, m): attention's many
    small GEMMs, split over threads where gemm_threads.splits_batch says so. With
    a 16-bit operand: accumulated in float32, returned in float32 or
    rounded into ``out``."""
    if is_half(a.dtype) or is_half(b.dtype):
        return precision.matmul(a, b, out=out, dtype=None if out is not None else np.float32)
    if gemm_threads.splits_batch(a, b):
        return gemm_threads.batched_matmul(a, b, out)
    xp = array_module(a)
    if xp.__name__ == "numpy":
        return xp.matmul(a, b, out=out)
    return precision.matmul(a, b, out=out)   # a GPU: cuBLAS with TF32 under --tf32, else CuPy


def causal_softmax(s):
    """s (M, T, T) scores -> causal softmax probabilities, in place."""
    k = kernels_for(s)
    if k is not None:
        k.softmax_causal(s)
        return
    xp = array_module(s)
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
    k = kernels_for(d, p)
    if k is not None:
        k.softmax_causal_backward(d, p)
        return
    xp = array_module(d)
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


# --- dropout ------------------------------------------------------------------
def keep_mask(key, counter, p: float, dtype, chunk_elems: int = 1 << 22):
    """1.0 where the counter-based uniform of the global element index is
    at least ``p``, else 0.0: a dropout keep mask drawn where it is used,
    bit-identical on every device (mpicube.ops.rng). ``counter`` is an
    rng.BlockIndex (the block's indices as per-dimension terms: the CUDA
    kernel adds them per element, the array path builds them
    ``chunk_elems`` at a time, so no uint64 array of the mask's size
    exists) or a uint64 array of the indices themselves."""
    if not isinstance(counter, rng.BlockIndex):                       # indices already built: hash them as a row
        flat = counter.reshape(-1).astype(np.uint64, copy=False)      # (size,)
        return keep_mask(key, rng.BlockIndex([flat]), p, dtype, chunk_elems).reshape(counter.shape)
    xp = array_module(counter.terms[0])
    out = xp.empty(counter.shape, dtype=dtype)                        # (block shape)
    if cuda_kernels.active(out):
        cuda_kernels.dropout_keep(int(key), counter.terms, p, out)
    else:
        for index, flat in counter.chunks(chunk_elems):
            out[index] = rng.uniform(key, flat) >= p
    return out
