"""Fused, threaded CPU kernels for the work between the GEMMs (numba).

Why this module exists: NumPy runs every elementwise operation as its own
single-threaded pass over an array that is far larger than the caches. On
the 768-wide benchmark model those passes (softmax, GELU backward,
LayerNorm, AdamW, clearing the gradients) took a third of the step while
the GEMMs ran on every core. A kernel here does a whole chain in one pass,
on every core, and the causal softmax skips the masked upper triangle.

They are optional. Without numba, or with ``MPICUBE_KERNELS=numpy``,
``mpicube.ops`` and the optimizer run their NumPy code, which is also the
code CuPy runs on GPUs, and so does work too small to repay waking the
threads. The two paths agree up to rounding (tests compare them). Row sums
are computed in float64 whatever the storage dtype; the AdamW update in the
buffers' format, as the array path's.
GELU's tanh stays NumPy's, whose SIMD code beats numba's scalar call.

Threads: the workqueue layer, because OpenMP worker threads spin after each
kernel and would take the core OpenBLAS's next GEMM needs. The count is
this rank's share of the node's cores, the same for BLAS and numba
(``mpicube.device.threads``, applied by ``configure_threads``).

Every kernel takes C-contiguous arrays; ``active`` says whether the fused
path applies to a set of arrays.
"""

from __future__ import annotations

import math
import os
import types
from contextlib import contextmanager

import numpy as np

from ..core.errors import UserError
from . import threads as _share

CHOICES = ("auto", "numba", "numpy")

try:  # numba is an optional extra: pip install 'mpicube[fast]'
    os.environ.setdefault("NUMBA_THREADING_LAYER", "workqueue")
    import numba
    from numba import prange
except ImportError:  # pragma: no cover - depends on the install
    numba = None
    prange = range

_enabled = numba is not None and os.environ.get("MPICUBE_KERNELS", "auto") != "numpy"


def check_choice() -> None:
    """Raise UserError for a bad or unsatisfiable MPICUBE_KERNELS."""
    choice = os.environ.get("MPICUBE_KERNELS", "auto")
    if choice not in CHOICES:
        raise UserError(f"MPICUBE_KERNELS={choice!r}: choose one of {', '.join(CHOICES)}")
    if choice == "numba" and numba is None:
        raise UserError("MPICUBE_KERNELS=numba, but numba is not installed: pip install 'mpicube[fast]'")
    min_elems = os.environ.get("MPICUBE_FUSED_MIN_ELEMS", "").strip()
    if min_elems and not min_elems.isdigit():
        raise UserError(f"MPICUBE_FUSED_MIN_ELEMS={min_elems!r}: give a number of elements (0 or more)")


def use(enabled: bool) -> bool:
    """Switch the fused kernels on or off (if numba is there); returns the
    previous setting. For tests and benchmarks that compare the two paths."""
    global _enabled
    previous = _enabled
    _enabled = bool(enabled) and numba is not None
    return previous


def enabled() -> bool:
    """Whether the fused kernels are on (numba there, MPICUBE_KERNELS not numpy)."""
    return _enabled


def describe() -> str:
    """Which kernels run, for benchmark reports."""
    if not _enabled:
        return "numpy"
    return f"numba fused, {numba.get_num_threads()} thread(s) per rank"


def configure_threads(comm=None) -> None:
    """Threads per rank for these kernels and every other pool the rank
    starts (BLAS, OpenMP): ``mpicube.device.threads`` decides the share (collective
    over ``comm``)."""
    from . import threads as thread_share

    thread_share.configure(comm)


def threads() -> int:
    """Threads this rank's fused work may use (1 when the kernels are off)."""
    return numba.get_num_threads() if _enabled else 1


class _Kernel:
    """One kernel compiled twice: threaded over its outer ``prange`` for
    work of at least PARALLEL_MIN_ELEMS elements (the first argument's
    size) on a rank with a share of threads (``threads.budget``: the
    share, not the threads the load watch leaves it now, so that the
    choice, and the rounding of a kernel's sums, never depends on the
    machine's load), and on the calling thread otherwise, so
    that small work does not pay to wake the pool (numba's workqueue layer
    takes about 0.1 ms per launch here) and still makes one pass instead of
    NumPy's several."""

    def __init__(self, threaded, one_thread):
        self.threaded, self.one_thread = threaded, one_thread

    forced = None          # "threaded" or "one_thread" under ``forced_build``

    def __call__(self, *args):
        if self.forced is not None:
            return getattr(self, self.forced)(*args)
        if args[0].size >= PARALLEL_MIN_ELEMS and (_share.budget() or numba.get_num_threads()) > 1:
            return self.threaded(*args)
        return self.one_thread(*args)


@contextmanager
def forced_build(variant: str | None):
    """Every kernel runs its ``variant`` build ("threaded" or "one_thread";
    None: the size decides) inside the block: for ``warm``, which compiles
    both, and for tests that compare them."""
    previous, _Kernel.forced = _Kernel.forced, variant
    try:
        yield
    finally:
        _Kernel.forced = previous


def _renamed(f, suffix: str):
    """A copy of function f under another qualified name, so that numba's
    on-disk cache keeps its compilation apart from f's."""
    g = types.FunctionType(f.__code__, f.__globals__, f.__name__ + suffix, f.__defaults__, f.__closure__)
    g.__qualname__ = f.__qualname__ + suffix
    g.__doc__ = f.__doc__
    return g


def _jit(sums: bool = False, parallel: bool = True):
    """numba.njit with an on-disk cache (compiled once per install, see
    ``warm``); the identity without numba, so this module always imports.
    ``parallel``: compile a threaded and a one-thread variant (``_Kernel``).
    ``sums``: the kernel's float sums may be reassociated, which lets them
    run in SIMD lanes (as NumPy's pairwise sums do); nothing else is relaxed,
    so NaN and inf still propagate."""
    if numba is None:
        return lambda f: f
    options = dict(cache=True, fastmath={"reassoc"} if sums else False)
    # error_model "numpy" (x / 0 is inf, as in the threaded build's parfors and in NumPy)
    # lets LLVM vectorise a loop with a division: AdamW's one-thread build ran 6.5x faster.
    one_thread_options = dict(options, nogil=True, error_model="numpy")

    def compile_both(f):
        one_thread = numba.njit(parallel=False, **one_thread_options)(_renamed(f, "_one_thread"))
        return _Kernel(numba.njit(parallel=True, **options)(f), one_thread) if parallel else one_thread

    return compile_both


# Below this many elements a kernel runs on the calling thread (_Kernel):
# waking numba's workers costs about what a pass over this many takes.
# MPICUBE_FUSED_MIN_ELEMS overrides it (0: threaded at every size).
_MIN_ELEMS_SET = os.environ.get("MPICUBE_FUSED_MIN_ELEMS", "").strip()    # checked in check_choice
PARALLEL_MIN_ELEMS = int(_MIN_ELEMS_SET) if _MIN_ELEMS_SET.isdigit() else 1 << 19


def active(*arrays) -> bool:
    """True if the fused kernels are on and apply to these arrays:
    C-contiguous float32 or float64 NumPy arrays, of any size and on any
    number of threads (``_Kernel`` decides whether to thread). Otherwise
    the caller takes its array-module path (always so for CuPy arrays,
    strided views and the 16-bit formats, which the kernels do not take:
    ops upcast those first)."""
    return _enabled and all(isinstance(a, np.ndarray) and a.flags.c_contiguous and a.dtype in _FLOATS
                            for a in arrays)


_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))
_GELU_S = math.sqrt(2.0 / math.pi)


# --- GELU (tanh approximation) ------------------------------------------------------
# The forward's tanh stays NumPy's (SIMD; numba's is a scalar libm call):
# these two kernels do the passes before and after it.
@_jit()
def gelu_tanh_argument(x, u):
    """x (n,) -> u (n,) = s (x + 0.044715 x^3), s = sqrt(2 / pi)."""
    for i in prange(x.size):
        a = x[i]
        u[i] = _GELU_S * a * (1.0 + 0.044715 * a * a)


@_jit()
def gelu_from_tanh(x, t, y):
    """x, t (n,) -> y (n,) = 0.5 x (1 + t), t = tanh(s (x + 0.044715 x^3))."""
    for i in prange(x.size):
        y[i] = 0.5 * x[i] * (1.0 + t[i])


def gelu_forward(x, t, y):
    """x (n,) -> t = tanh(s (x + 0.044715 x^3)), y = 0.5 x (1 + t): two
    threaded passes around NumPy's SIMD tanh (cuda_kernels does it in one)."""
    gelu_tanh_argument(x, t)
    np.tanh(t, out=t)
    gelu_from_tanh(x, t, y)


@_jit()
def gelu_backward(dy, x, t, dx):
    """dy, x, t (n,) -> dx (n,) where t = tanh(s (x + 0.044715 x^3)) from the
    forward: dx = dy (0.5 (1 + t) + 0.5 x (1 - t^2) s (1 + 3 * 0.044715 x^2))."""
    for i in prange(x.size):
        a, th = x[i], t[i]
        dx[i] = dy[i] * (0.5 * (1.0 + th) + 0.5 * a * (1.0 - th * th) * _GELU_S * (1.0 + 3 * 0.044715 * a * a))


# --- causal softmax -------------------------------------------------------------
@_jit(sums=True)
def softmax_causal(s):
    """s (M, T, T) scores -> probabilities, in place. Row i of each matrix
    keeps columns 0..i; the rest become 0 (as exp(-inf) would) unread."""
    T = s.shape[1]
    for r in prange(s.shape[0] * T):
        row, i = s[r // T, r % T], r % T                      # (T,), its query position
        top = row[0]
        for j in range(1, i + 1):                            # (a NaN still reaches every entry via exp)
            if row[j] > top:
                top = row[j]
        total = 0.0
        for j in range(i + 1):
            e = np.exp(row[j] - top)
            row[j] = e
            total += e
        inv = 1.0 / total
        for j in range(i + 1):
            row[j] *= inv
        for j in range(i + 1, T):
            row[j] = 0.0


@_jit(sums=True)
def softmax_causal_backward(d, p):
    """d (M, T, T) gradient w.r.t. probabilities p -> w.r.t. the scores, in
    place: d <- p (d - sum(d p)) on the causal part, 0 above it."""
    T = d.shape[1]
    for r in prange(d.shape[0] * T):
        m, i = r // T, r % T
        drow, prow = d[m, i], p[m, i]                         # (T,) each
        dot = 0.0
        for j in range(i + 1):
            dot += drow[j] * prow[j]
        for j in range(i + 1):
            drow[j] = prow[j] * (drow[j] - dot)
        for j in range(i + 1, T):
            drow[j] = 0.0


# --- LayerNorm, in the stages between its all-reduces ------------------------------
@_jit(sums=True)
def row_sums(x, out):
    """x (n, C) -> out (n,) row sums."""
    for r in prange(x.shape[0]):
        acc = 0.0
        for c in range(x.shape[1]):
            acc += x[r, c]
        out[r] = acc


@_jit(sums=True)
def center_rows(x, mean, xc, sumsq):
    """xc = x - mean[:, None]; sumsq[r] = sum(xc[r]^2). x, xc (n, C); mean, sumsq (n,)."""
    for r in prange(x.shape[0]):
        acc = 0.0
        for c in range(x.shape[1]):
            d = x[r, c] - mean[r]
            xc[r, c] = d
            acc += d * d
        sumsq[r] = acc


@_jit()
def normalize_rows(xhat, rstd, gamma, beta, y):
    """xhat *= rstd[:, None] in place, then y = xhat gamma + beta.
    xhat, y (n, C); rstd (n,); gamma, beta (C,)."""
    for r in prange(xhat.shape[0]):
        for c in range(xhat.shape[1]):
            h = xhat[r, c] * rstd[r]
            xhat[r, c] = h
            y[r, c] = h * gamma[c] + beta[c]


@_jit(sums=True)
def layernorm_grad_sums(dy, gamma, xhat, sums):
    """sums[r] = (sum(dy gamma), sum(dy gamma xhat)) over row r. dy, xhat (n, C); sums (n, 2)."""
    for r in prange(dy.shape[0]):
        s0 = 0.0
        s1 = 0.0
        for c in range(dy.shape[1]):
            g = dy[r, c] * gamma[c]
            s0 += g
            s1 += g * xhat[r, c]
        sums[r, 0] = s0
        sums[r, 1] = s1


@_jit()
def layernorm_grad_input(dy, gamma, xhat, rstd, means, dx):
    """dx = (dy gamma - means[:, 0] - xhat means[:, 1]) rstd, row by row.
    dy, xhat, dx (n, C); gamma (C,); rstd (n,); means (n, 2)."""
    for r in prange(dy.shape[0]):
        m0, m1, rs = means[r, 0], means[r, 1], rstd[r]
        for c in range(dy.shape[1]):
            dx[r, c] = (dy[r, c] * gamma[c] - m0 - xhat[r, c] * m1) * rs


# --- parameter gradients of biases and LayerNorm: sums over the rows ---------------
@_jit(sums=True, parallel=False)
def column_sums(a, out):
    """out (C,) float64 = the sums over the rows of a (n, C), added row by
    row in float64 (SIMD across the columns): four times NumPy's
    sum(0, dtype=float64), which casts through a buffer."""
    for c in range(a.shape[1]):
        out[c] = 0.0
    for r in range(a.shape[0]):
        row = a[r]
        for c in range(a.shape[1]):
            out[c] += row[c]


@_jit(sums=True, parallel=False)
def column_dots(a, b, out):
    """out (C,) float64 = the sums over the rows of a * b, a and b (n, C)."""
    for c in range(a.shape[1]):
        out[c] = 0.0
    for r in range(a.shape[0]):
        ra, rb = a[r], b[r]
        for c in range(a.shape[1]):
            out[c] += ra[c] * rb[c]


# --- AdamW ------------------------------------------------------------------------
def adamw(p, g, m, v, b1, b2, step, eps, keep, grad_scale):
    """One AdamW update of the slice p, g, m, v (n,) in one pass: the
    gradient times grad_scale feeds m and v (g itself is left as it is),
    p <- keep p - step m / (sqrt(v) + eps). The arithmetic is in the
    buffers' format, as the array path's (NumPy and CuPy keep float32
    with Python scalars) and PyTorch's: in float32 a third of the time of
    float64 arithmetic on float32 buffers (1.1M parameters, one thread:
    0.61 against 1.70 ms), and float64 unchanged."""
    t = p.dtype.type
    _adamw(p, g, m, v, t(b1), t(1.0 - b1), t(b2), t(1.0 - b2), t(step), t(eps), t(keep), t(grad_scale))


@_jit()
def _adamw(p, g, m, v, b1, c1, b2, c2, step, eps, keep, grad_scale):
    """adamw with every scalar in p's format (c1 = 1 - b1, c2 = 1 - b2)."""
    for i in prange(p.size):
        gi = g[i] * grad_scale
        mi = b1 * m[i] + c1 * gi
        vi = b2 * v[i] + c2 * gi * gi
        m[i] = mi
        v[i] = vi
        p[i] = keep * p[i] - step * mi / (np.sqrt(vi) + eps)


@_jit()
def fill_zero(a):
    """a (n,) = 0, threaded (NumPy's fill is one thread)."""
    for i in prange(a.size):
        a[i] = 0


# --- embedding gradient -------------------------------------------------------------
@_jit(parallel=False)
def scatter_add_rows(target, rows, values):
    """target[rows[i]] += values[i] for each i with rows[i] in [0, V),
    repeated rows summed in order; other rows (ids of another rank's
    vocabulary block) skipped. target (V, C); rows (n,); values (n, C). One
    thread (rows may repeat), but a plain loop instead of np.add.at's slow
    generic path."""
    for i in range(rows.size):
        r = rows[i]
        if r < 0 or r >= target.shape[0]:
            continue
        for c in range(values.shape[1]):
            target[r, c] += values[i, c]


def warm() -> None:
    """Compile every kernel, both variants, for float32 and float64 into
    numba's cache, so that the ranks of a job load them instead of each
    compiling them (``python -m mpicube.device.fused_attention`` warms
    both modules' kernels; make install runs it)."""
    for variant in ("threaded", "one_thread"):
        with forced_build(variant):
            _warm_each()


def _warm_each() -> None:
    for dtype in (np.float32, np.float64):
        v, n = np.ones(4, dtype), np.ones(2, dtype)
        x, two = np.ones((2, 4), dtype), np.ones((2, 2), dtype)
        s = np.ones((1, 2, 2), dtype)
        gelu_tanh_argument(v, v.copy())
        gelu_from_tanh(v, v, v.copy())
        gelu_backward(v, v, v, v.copy())
        softmax_causal(s)
        softmax_causal_backward(s.copy(), s)
        row_sums(x, n.copy())
        center_rows(x, n, x.copy(), n.copy())
        normalize_rows(x.copy(), n, v, v, x.copy())
        layernorm_grad_sums(x, v, x, two.copy())
        layernorm_grad_input(x, v, x, n, two, x.copy())
        adamw(v.copy(), v.copy(), v.copy(), v.copy(), 0.9, 0.95, 1e-3, 1e-8, 1.0, 1.0)
        fill_zero(v.copy())
        column_sums(x, np.empty(4))
        column_dots(x, x, np.empty(4))
        scatter_add_rows(x.copy(), np.zeros(2, np.int64), x)
