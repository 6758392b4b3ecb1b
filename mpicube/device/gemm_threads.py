"""How a rank's GEMMs use its threads: fixed panels, never the BLAS's own split.

Why this module exists: a reference must give the same numbers at any
thread count and under any load. OpenBLAS's threaded GEMM does not: under
its Haswell kernels (every AVX2-only CPU, and any machine that sets
``OPENBLAS_CORETYPE=Haswell``) a float32 product of 512 x 144 x 576
differs in its last bits between one thread and two, because the threads'
shares of the output reach the kernel's edge cases differently. Its
threaded dot product (a float64 gradient norm) splits the sum itself.

So the BLAS always runs on one thread (``threads.apply``), and the rank's
threads are spent here instead:

* ``gemm``: a 2-D product is cut into panels along its longer output side.
  The cut depends on the shape alone (``panel_cuts``), so each panel is the
  same one-thread BLAS call whatever the number of threads; the threads
  only decide who computes which panel. One thread computes them in turn.
* ``batched_matmul``: attention's B*nh small GEMMs, whole GEMMs side by
  side, a share of the batch per thread.

The load watch (``core_load``) changes how many threads take panels
(``threads.active``), never a number. The pool's threads run only NumPy
(which releases the GIL inside the BLAS): numba's workqueue layer must
never be entered from two threads at once.
"""

from __future__ import annotations

import numpy as np

from . import fused, threads

# A panel is at least this many multiply-adds (about 20 us of one core's
# sgemm), so that a panel repays the call and the packing of the operand
# every panel reads whole; a GEMM below twice this is one call.
PANEL_MIN_MACS = 1 << 22
# ... and at least this wide, so that OpenBLAS's kernels run on full tiles.
PANEL_MIN_WIDTH = 64
# At most this many panels: a power of two, so 2, 4, 8, ... threads share
# them evenly.
MAX_PANELS = 64

# Handing half a batch to another Python thread costs about 0.2 ms here;
# below this many multiply-adds the split loses (the 144-wide model's QK^T,
# 5M, does; the 768-wide one's, 200M, gains 1.2 ms). Scales with
# fused.PARALLEL_MIN_ELEMS (1 << 19 by default).
SPLIT_MIN_MACS = 128 * fused.PARALLEL_MIN_ELEMS

_pool = None           # ThreadPoolExecutor, made on first use
_pool_workers = 0      # its threads (the rank's share less the calling thread)


def _floor_pow2(x: float) -> int:
    """The largest power of two <= x (1 for x < 2)."""
    return 1 << max(0, int(x).bit_length() - 1) if x >= 1 else 1


def panel_cuts(m: int, k: int, n: int) -> tuple:
    """How ``gemm`` cuts an (m, k) @ (k, n) product: (axis, cuts) with axis
    0 (rows of the output) or 1 (its columns) and cuts the panel bounds
    along it. A function of the shape alone: this is what makes a product's
    numbers independent of the thread count."""
    axis = 0 if m >= n else 1
    side = m if axis == 0 else n
    count = min(MAX_PANELS, _floor_pow2(side / PANEL_MIN_WIDTH), _floor_pow2(m * k * n / PANEL_MIN_MACS))
    # panel bounds on multiples of 16 (OpenBLAS's register tiles), the last panel taking the rest
    cuts = [0] + [min(side, (side * i // count + 8) // 16 * 16) for i in range(1, count)] + [side]
    return axis, tuple(cuts)


def _run(tasks) -> None:
    """Run the zero-argument callables ``tasks``: the calling thread takes
    every t-th from the first, the pool's threads the others."""
    workers = min(threads.active(), len(tasks))
    if workers <= 1:
        for task in tasks:
            task()
        return
    global _pool, _pool_workers
    if _pool_workers < workers - 1:
        from concurrent.futures import ThreadPoolExecutor
        _pool_workers = max(workers, threads.budget() or 1) - 1
        _pool = ThreadPoolExecutor(max_workers=_pool_workers, thread_name_prefix="mpicube-gemm")
    shares = [tasks[w::workers] for w in range(workers)]
    futures = [_pool.submit(lambda share=share: [task() for task in share]) for share in shares[1:]]
    for task in shares[0]:
        task()
    for f in futures:
        f.result()


def gemm(a, b, out=None):
    """a (m, k) @ b (k, n) -> (m, n) for 2-D NumPy operands of one float
    format, in fixed panels (``panel_cuts``) over the rank's threads; into
    ``out`` when given."""
    m, k = a.shape
    n = b.shape[1]
    if out is None:
        out = np.empty((m, n), dtype=np.result_type(a, b))
    axis, cuts = panel_cuts(m, k, n)
    if len(cuts) == 2:
        return np.matmul(a, b, out=out)
    if axis == 0:
        tasks = [lambda r=slice(lo, hi): np.matmul(a[r], b, out=out[r]) for lo, hi in zip(cuts, cuts[1:])]
    else:
        tasks = [lambda c=slice(lo, hi): np.matmul(a, b[:, c], out=out[:, c]) for lo, hi in zip(cuts, cuts[1:])]
    _run(tasks)
    return out


def splits_batch(a, b) -> bool:
    """Whether batched_matmul should split a @ b: NumPy operands of shape
    (B, nh, n, k) and (B, nh, k, m), this rank has threads, and the product
    is at least SPLIT_MIN_MACS multiply-adds."""
    return (threads.active() > 1 and isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.ndim == 4
            and a.shape[0] * a.shape[1] > 1 and a.size * b.shape[3] >= SPLIT_MIN_MACS)


def batched_matmul(a, b, out=None):
    """a (B, nh, n, k) @ b (B, nh, k, m) -> (B, nh, n, m), the batch split
    over this rank's threads (along B, or along nh when B is 1), each
    running whole GEMMs on the one-thread BLAS: every matrix of the batch is
    the same call whatever the split."""
    if out is None:
        out = np.empty(a.shape[:-1] + b.shape[-1:], dtype=np.result_type(a, b))
    axis = 0 if a.shape[0] > 1 else 1
    n = min(threads.active(), a.shape[axis])
    cut = np.linspace(0, a.shape[axis], n + 1).astype(int)
    parts = [(slice(None),) * axis + (slice(lo, hi),) for lo, hi in zip(cut, cut[1:])]
    _run([lambda p=p: np.matmul(a[p], b[p], out=out[p]) for p in parts])
    return out
