"""The softmax steps of blockwise attention in single passes (numba, CPU).

Why this module exists: ``ops.attention_blocks`` leaves each block's
products to BLAS, which runs even 64 x 12 x 64 GEMMs at a good fraction
of its peak, but wrote everything between them as NumPy passes over the
(B, nh, bq, bk) scores: a causal bias built and added, the row maximum
(NumPy's slowest reduction at short rows, 0.47 ms for 96 x 64 rows of 64
on this project's CPUs), the shift, the row sums, each a pass of its own.
On the 144-wide benchmark model attention took a third of the serial step
for under 2% of its FLOPs. Each kernel here does one of those chains in a
single pass, skipping the keys after each query instead of adding -inf to
them; ``exp`` stays NumPy's, whose SIMD code is four times numba's scalar
one.

Every kernel takes the blocks in the shapes ``attention_blocks`` holds
them, (B, nh, bq, bk) scores and (B, nh, bq, 1) row statistics (views are
fine), and the global positions q0, k0 of the blocks' first query and key,
so the same kernels serve context parallelism's chunk pairs.
"""

from __future__ import annotations

import numpy as np

from . import fused
from .fused import _FLOATS, _jit, prange


def takes(*arrays) -> bool:
    """Whether the kernels apply: fused kernels on, NumPy float32 or
    float64 arrays of one dtype (strided views included)."""
    return (fused.enabled() and all(isinstance(a, np.ndarray) for a in arrays)
            and arrays[0].dtype in _FLOATS and all(a.dtype == arrays[0].dtype for a in arrays))


if fused.numba is not None:
    _helper = fused.numba.njit(cache=True, nogil=True, error_model="numpy")

    # The running maximum only steadies the exponentials (any value near the
    # true one gives the same softmax), so its loop may drop IEEE semantics
    # and run as SIMD max: a NaN score still reaches the row through s - m.
    @fused.numba.njit(cache=True, nogil=True, error_model="numpy", fastmath={"reassoc", "nnan", "ninf", "nsz"})
    def _row_max(row, n, start):
        """max(start, row[0], ..., row[n-1])."""
        top = start
        for j in range(n):
            top = max(top, row[j])
        return top

    @_helper
    def _visible(q0, i, k0, bk):
        """How many of a block's bk keys, from global position k0 on, query
        q0 + i sees (causal: key <= query)."""
        return min(bk, max(0, q0 + i - k0 + 1))

    @_helper
    def _shift_visible_row(row, shift, visible):
        """row (bk,) <- row - shift for its first ``visible`` keys, -inf after."""
        for j in range(row.size):
            row[j] = row[j] - shift if j < visible else -np.inf
else:  # pragma: no cover - without numba ``takes`` is False and nothing calls these
    _row_max = _visible = _shift_visible_row = None


# The rows are short (one block, 64 or 128 keys), so each loop runs over the
# whole row and selects on j < visible: a loop of variable length would
# spend more time in its scalar remainder than in its SIMD body.
@_jit(sums=True)
def online_max(s, m, alpha, q0, k0):
    """One step of the online softmax's maximum, in place: for each row of
    s (B, nh, bq, bk) the running maximum m (B, nh, bq, 1) grows to cover
    the keys visible to the row's query (global key k0 + j <= query q0 + i),
    alpha (B, nh, bq, 1) gets exp(m_old - m_new), the rescale of what was
    summed before, and s becomes s - m_new there and -inf after them."""
    B, nh, bq, bk = s.shape
    for bh in prange(B * nh):
        b, h = bh // nh, bh % nh
        for i in range(bq):
            row = s[b, h, i]                                  # (bk,)
            visible = _visible(q0, i, k0, bk)
            old = m[b, h, i, 0]
            top = _row_max(row, visible, old)
            alpha[b, h, i, 0] = 1.0 if top == -np.inf else np.exp(old - top)
            m[b, h, i, 0] = top
            _shift_visible_row(row, top, visible)


@_jit(sums=True)
def fold_row_sums(p, l, alpha):
    """l (B, nh, bq, 1) <- l alpha + the row sums of p (B, nh, bq, bk)."""
    B, nh, bq, bk = p.shape
    for bh in prange(B * nh):
        b, h = bh // nh, bh % nh
        for i in range(bq):
            row = p[b, h, i]                                  # (bk,)
            total = 0.0
            for j in range(bk):
                total += row[j]
            l[b, h, i, 0] = l[b, h, i, 0] * alpha[b, h, i, 0] + total


@_jit()
def shift_visible(s, lse, q0, k0):
    """s (B, nh, bq, bk) <- s - lse (B, nh, bq, 1) where the key is visible
    to the query (as in ``online_max``), -inf after: exp of it is the
    probabilities backward recomputes."""
    B, nh, bq, bk = s.shape
    for bh in prange(B * nh):
        b, h = bh // nh, bh % nh
        for i in range(bq):
            _shift_visible_row(s[b, h, i], lse[b, h, i, 0], _visible(q0, i, k0, bk))


@_jit()
def scores_grad(dp, p, d):
    """dp (B, nh, bq, bk) <- p (dp - d): the gradient of the scores from
    that of the probabilities p, d (B, nh, bq, 1) = rowdot(dy, y)."""
    B, nh, bq, bk = dp.shape
    for bh in prange(B * nh):
        b, h = bh // nh, bh % nh
        for i in range(bq):
            drow, prow, di = dp[b, h, i], p[b, h, i], d[b, h, i, 0]   # (bk,), (bk,), scalar
            for j in range(bk):
                drow[j] = prow[j] * (drow[j] - di)


@_jit(sums=True)
def row_dots(a, b, out):
    """out (B, nh, T, 1) = the row sums of a * b, a and b (B, nh, T, hd)
    (backward's D = rowdot(dy, y), whose views are strided)."""
    B, nh, T, hd = a.shape
    for bh in prange(B * nh):
        n, h = bh // nh, bh % nh
        for t in range(T):
            total = 0.0
            for c in range(hd):
                total += a[n, h, t, c] * b[n, h, t, c]
            out[n, h, t, 0] = total


@_jit()
def interleave_grads(grads, scale, dqkv5):
    """dqkv5 (B, T, 3, nh, hd) <- grads (3, B, nh, T, hd), dq scaled by
    ``scale``: the gradients back in qkv's column layout in one pass."""
    _, B, nh, T, hd = grads.shape
    for n in prange(B):
        for t in range(T):
            for h in range(nh):
                dq, dk, dv = dqkv5[n, t, 0, h], dqkv5[n, t, 1, h], dqkv5[n, t, 2, h]   # (hd,) each
                for c in range(hd):
                    dq[c] = grads[0, n, h, t, c] * scale
                    dk[c] = grads[1, n, h, t, c]
                    dv[c] = grads[2, n, h, t, c]


def warm() -> None:
    """Compile each kernel, both variants, for float32 and float64, with
    the argument layouts ``attention_blocks`` passes: whole blocks, and the
    strided views of a sequence of several blocks (``fused.warm``)."""
    for variant in ("threaded", "one_thread"):
        with fused.forced_build(variant):
            for dt in _FLOATS:
                s = np.zeros((2, 2, 2, 2), dt)                        # (B, nh, bq, bk) scores
                whole = np.zeros((2, 2, 2, 1), dt)                    # (B, nh, bq, 1) row statistics
                part = np.zeros((2, 2, 4, 1), dt)[:, :, 2:]           # a block's rows of them (strided)
                heads = np.zeros((2, 2, 2, 2), dt)                    # (B, nh, T, hd)
                for rows, view in ((whole, heads), (part, heads.transpose(0, 2, 1, 3))):
                    online_max(s, whole.copy(), whole.copy(), 0, 0)
                    fold_row_sums(s, whole.copy(), whole)
                    shift_visible(s, rows, 0, 0)
                    scores_grad(s.copy(), s, rows)
                    row_dots(view, view, whole.copy())
                interleave_grads(np.zeros((3, 2, 2, 2, 2), dt), dt.type(0.5), np.empty((2, 2, 3, 2, 2), dt))


if __name__ == "__main__":  # python -m mpicube.device.fused_attention: fill the compile cache (make install does)
    if fused.numba is None:
        print("numba is not installed: mpicube uses its NumPy kernels")
    else:
        fused.warm()
        warm()
        print(f"fused kernels compiled and cached ({fused.describe()})")
