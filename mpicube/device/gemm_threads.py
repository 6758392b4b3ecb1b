"""How a rank's GEMMs use its threads: OpenBLAS's own split, or a batch split.

Why this module exists: the rank's BLAS threads (``threads``) serve every
GEMM, and two kinds of product want something other than OpenBLAS's
default of splitting each GEMM over all of them:

* attention's batched products, B*nh GEMMs too small to split, which run
  faster as whole GEMMs side by side, half the batch per thread
  (``batched_matmul``);
* a float32 GEMM too small to repay waking the second thread, which runs
  on one (``one_thread_if_small``).

threadpoolctl switches the BLAS's thread count around such a call.
"""

from __future__ import annotations

import numpy as np

from . import fused

# Attention multiplies B*nh small matrices (T x hd by hd x T, ...). NumPy
# hands them to OpenBLAS one by one, and OpenBLAS splits each small GEMM
# over its threads for almost nothing: 48 GEMMs of 256 x 64 x 256 take
# 2.8 ms on two BLAS threads and 3.0 ms on one. Splitting the *batch*
# instead, each thread running whole GEMMs on a one-thread BLAS, takes
# 1.7 ms. The pool's threads run only NumPy: numba's workqueue layer must
# never be entered from two threads at once. (Splitting a whole attention
# so, products and softmax passes together, lost: at T = 64 its dozens of
# short NumPy calls per half hand the GIL back and forth.)
_pool = None           # ThreadPoolExecutor, made on first use
_blas = None           # threadpoolctl controllers of NumPy's BLAS


def blas_controllers() -> list:
    """threadpoolctl's controllers of NumPy's BLAS (made once; [] without threadpoolctl)."""
    global _blas
    if _blas is None:
        try:
            from threadpoolctl import ThreadpoolController
            _blas = ThreadpoolController().select(user_api="blas").lib_controllers
        except ImportError:  # pragma: no cover - part of the fast extra
            _blas = []
    return _blas


# Handing half a batch to another Python thread costs about 0.2 ms here;
# below this many multiply-adds the split loses (the 144-wide model's QK^T,
# 5M, does; the 768-wide one's, 200M, gains 1.2 ms). Scales with
# fused.PARALLEL_MIN_ELEMS (1 << 19 by default).
SPLIT_MIN_MACS = 128 * fused.PARALLEL_MIN_ELEMS
# Below this many multiply-adds one float32 GEMM runs on one BLAS thread
# (``one_thread_if_small``) instead of OpenBLAS's split over the rank's.
# With OpenBLAS's workers kept spinning between GEMMs (mpicube/__init__.py)
# the split wins from about 0.5M on the 2-core machines (512 x 144 x 8: 19
# us on one thread, 12 on two); smaller ones OpenBLAS keeps on one anyway.
GEMM_SPLIT_MIN_MACS = 1 << 19


def splits_batch(a, b) -> bool:
    """Whether batched_matmul should split a @ b: NumPy operands of shape
    (B, nh, n, k) and (B, nh, k, m), this rank has threads, and the product
    is at least SPLIT_MIN_MACS multiply-adds."""
    return (fused.threads() > 1 and isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.ndim == 4
            and a.shape[0] * a.shape[1] > 1 and a.size * b.shape[3] >= SPLIT_MIN_MACS and bool(blas_controllers()))


def batched_matmul(a, b, out=None):
    """a (B, nh, n, k) @ b (B, nh, k, m) -> (B, nh, n, m), the batch split
    over this rank's threads (along B, or along nh when B is 1), each
    running whole GEMMs on a one-thread BLAS."""
    n = fused.threads()
    axis = 0 if a.shape[0] > 1 else 1
    global _pool
    if _pool is None:
        from concurrent.futures import ThreadPoolExecutor
        _pool = ThreadPoolExecutor(max_workers=n - 1, thread_name_prefix="mpicube-bmm")
    if out is None:
        out = np.empty(a.shape[:-1] + b.shape[-1:], dtype=np.result_type(a, b))
    cut = np.linspace(0, a.shape[axis], min(n, a.shape[axis]) + 1).astype(int)
    parts = [(slice(None),) * axis + (slice(lo, hi),) for lo, hi in zip(cut, cut[1:])]
    saved = [c.num_threads for c in _blas]
    for c in _blas:
        c.set_num_threads(1)
    try:
        futures = [_pool.submit(np.matmul, a[p], b[p], out=out[p]) for p in parts[1:]]
        np.matmul(a[parts[0]], b[parts[0]], out=out[parts[0]])       # this thread takes the first share
        for f in futures:
            f.result()
    finally:
        for c, k in zip(_blas, saved):
            c.set_num_threads(k)
    return out


def one_thread_if_small(a, b, out):
    """a @ b for float32 NumPy operands, on one BLAS thread when the product
    is smaller than GEMM_SPLIT_MIN_MACS multiply-adds. The split of a GEMM
    changes how its float32 sums round, not float64's: float64 keeps the
    rank's share (its runs verify layouts bit for bit against a fixed thread
    count)."""
    if a.ndim != 2 or a.shape[0] * a.shape[1] * b.shape[1] >= GEMM_SPLIT_MIN_MACS:
        return np.matmul(a, b, out=out)
    blas = blas_controllers()
    saved = [c.num_threads for c in blas]
    if not any(k > 1 for k in saved):
        return np.matmul(a, b, out=out)
    for c in blas:
        c.set_num_threads(1)
    try:
        return np.matmul(a, b, out=out)
    finally:
        for c, k in zip(blas, saved):
            c.set_num_threads(k)
