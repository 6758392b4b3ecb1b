"""CUDA kernels for the work between the GEMMs: the GPU twin of mpicube.device.fused.

On CuPy every array operation is its own kernel launch and its own trip
through device memory: the array path of mpicube.ops runs GELU as about 8
passes forward and 11 backward, the causal softmax as 6 over the whole T x T
(masked half included), LayerNorm as about 10, AdamW as 13. A kernel here
does each chain in one pass (the causal softmax skips the masked half), and
the embedding gradient is summed in a fixed order instead of with atomics,
so a GPU run resumes bit for bit.

The functions have fused.py's names and signatures (outputs passed in), so
ops.py and optim.py run the same code with either module. They take
C-contiguous float32/float64 CuPy arrays of one dtype (``active`` says
whether they apply); row sums accumulate in float64, elementwise chains and
AdamW compute in the storage type. The CUDA source is mpicube.device.cuda_source,
compiled by CuPy (NVRTC) on first use, once per dtype.

Switch: off unless ``MPICUBE_CUDA_KERNELS=1``, because no GPU has run
tools/gpu_check.py on them yet (CHECKED_ON_GPU); ``MPICUBE_KERNELS=numpy``
forces the plain array path on either device. Importing this module does not
import CuPy.
"""

from __future__ import annotations

import os

import numpy as np

from . import cuda_source
from ..core.errors import UserError

ENV = "MPICUBE_CUDA_KERNELS"
CHECKED_ON_GPU = False          # set when tools/gpu_check.py has passed on a device

# Launch shapes. Every kernel loops grid-stride, so the cap only bounds the
# grid (tests lower it to exercise the loops); 64k blocks fill any GPU.
MAX_BLOCKS = 1 << 16
ELEMENTWISE_THREADS = 256

_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))
_switch = None                  # None: not yet read from the environment
_modules = {}                   # dtype name -> compiled cupy.RawModule
_functions = {}                 # (dtype name, kernel name) -> kernel


# --- the switch -------------------------------------------------------------------
def _cp():
    """The array module the kernels run on (tests put NumPy here to run them emulated)."""
    import cupy

    return cupy


def available() -> bool:
    """Real CuPy with its kernel API and at least one CUDA device."""
    try:
        import cupy
    except Exception:  # ImportError, or a CUDA library that fails to load
        return False
    if not (hasattr(cupy, "RawModule") and hasattr(cupy, "ElementwiseKernel")):
        return False   # e.g. the NumPy-backed stand-in in tests/fake_gpu
    try:
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no driver, no device
        return False


def _wanted() -> bool:
    return os.environ.get(ENV, "0").strip() == "1" and os.environ.get("MPICUBE_KERNELS", "auto") != "numpy"


def _on() -> bool:
    global _switch
    if _switch is None:
        _switch = _wanted() and available()
    return _switch


def use(enabled: bool) -> bool:
    """Switch the kernels on or off (on only where ``available``); returns
    the previous setting. For tests and benchmarks that compare the paths."""
    global _switch
    previous = _on()
    _switch = bool(enabled) and available()
    return previous


def check_choice() -> None:
    """Raise UserError for a bad or unsatisfiable MPICUBE_CUDA_KERNELS
    (call it when --device gpu is chosen)."""
    value = os.environ.get(ENV, "0").strip()
    if value not in ("", "0", "1"):
        raise UserError(f"{ENV}={value!r}: choose 1 (mpicube's CUDA kernels) or 0 (the CuPy array path, the default)")
    if value == "1" and not available():
        raise UserError(f"{ENV}=1, but CuPy's kernel API (cupy.RawModule) or a CUDA device is missing here: "
                        f"unset {ENV} to run the CuPy array path")


def describe() -> str:
    """Which GPU kernels run, for benchmark reports."""
    if not _on():
        return "CuPy array path"
    state = "checked on a GPU" if CHECKED_ON_GPU else "opt-in, not yet checked on a GPU"
    return f"mpicube CUDA kernels ({state})"


def active(*arrays) -> bool:
    """True if the kernels are on and apply to these arrays: CuPy ndarrays
    (not NumPy), C-contiguous, float32 or float64. Otherwise the caller
    takes its array-module path."""
    if not _on():
        return False
    ndarray = _cp().ndarray
    return all(isinstance(a, ndarray) and a.flags.c_contiguous and a.dtype in _FLOATS for a in arrays)


# --- compiling and launching --------------------------------------------------------
def _module(dtype):
    """The compiled kernels for one storage dtype (CuPy compiles lazily and
    keeps the binary in its on-disk cache)."""
    name = np.dtype(dtype).name
    if name not in _modules:
        _modules[name] = _cp().RawModule(code=cuda_source.source(name))
    return _modules[name]


def _launch(name: str, dtype, blocks: int, threads: int, args: tuple) -> None:
    key = (np.dtype(dtype).name, name)
    if key not in _functions:
        _functions[key] = _module(dtype).get_function(name)
    _functions[key]((max(1, min(blocks, MAX_BLOCKS)),), (threads,), args)


def row_threads(width: int) -> int:
    """Threads for a block that owns a row of ``width``: a multiple of 32,
    at least 4 elements each, at most 256."""
    warps = min(8, max(1, -(-width // 128)))
    return 32 * warps


def _rows(name: str, rows: int, width: int, dtype, args: tuple) -> None:
    """Launch a row kernel: a block per row (grid-stride past MAX_BLOCKS),
    its threads striding over the row's ``width`` columns."""
    if rows > 0:
        _launch(name, dtype, rows, row_threads(width), args)


def _flat(name: str, n: int, dtype, args: tuple) -> None:
    """Launch an elementwise kernel over n elements."""
    if n > 0:
        _launch(name, dtype, -(-n // ELEMENTWISE_THREADS), ELEMENTWISE_THREADS, args)


def _dtype(*arrays):
    """The common float dtype of these arrays; TypeError unless they are
    C-contiguous and share it (a raw kernel would read them as garbage)."""
    dtype = arrays[0].dtype
    for a in arrays:
        if a.dtype != dtype or dtype not in _FLOATS or not a.flags.c_contiguous:
            raise TypeError(f"CUDA kernels take C-contiguous float32/float64 arrays of one dtype, got {a.dtype} "
                            f"(contiguous: {a.flags.c_contiguous}) beside {dtype}")
    return dtype


def _sizes(ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(f"CUDA kernel arguments: {what}")


def _i64(v) -> np.int64:
    return np.int64(v)


# --- LayerNorm, in the stages between its all-reduces ----------------------------------
def row_sums(x, out):
    """x (n, C) -> out (n,) row sums."""
    n, C = x.shape
    _sizes(out.size == n, "out must hold one value per row")
    _rows("row_sums", n, C, _dtype(x, out), (x, out, _i64(n), _i64(C)))


def center_rows(x, mean, xc, sumsq):
    """xc = x - mean[:, None]; sumsq[r] = sum(xc[r]^2). x, xc (n, C); mean, sumsq (n,)."""
    n, C = x.shape
    _sizes(xc.shape == x.shape and mean.size == n and sumsq.size == n, "x, xc (n, C); mean, sumsq (n,)")
    _rows("center_rows", n, C, _dtype(x, mean, xc, sumsq), (x, mean, xc, sumsq, _i64(n), _i64(C)))


def normalize_rows(xhat, rstd, gamma, beta, y):
    """xhat *= rstd[:, None] in place, then y = xhat gamma + beta.
    xhat, y (n, C); rstd (n,); gamma, beta (C,)."""
    n, C = xhat.shape
    _sizes(y.shape == xhat.shape and rstd.size == n and gamma.size == C and beta.size == C,
           "xhat, y (n, C); rstd (n,); gamma, beta (C,)")
    _rows("normalize_rows", n, C, _dtype(xhat, rstd, gamma, beta, y), (xhat, rstd, gamma, beta, y, _i64(n), _i64(C)))


def layernorm_grad_sums(dy, gamma, xhat, sums):
    """sums[r] = (sum(dy gamma), sum(dy gamma xhat)) over row r. dy, xhat (n, C); sums (n, 2)."""
    n, C = dy.shape
    _sizes(xhat.shape == dy.shape and gamma.size == C and sums.size == 2 * n, "dy, xhat (n, C); gamma (C,); sums (n, 2)")
    _rows("layernorm_grad_sums", n, C, _dtype(dy, gamma, xhat, sums), (dy, gamma, xhat, sums, _i64(n), _i64(C)))


def layernorm_grad_input(dy, gamma, xhat, rstd, means, dx):
    """dx = (dy gamma - means[:, 0] - xhat means[:, 1]) rstd, row by row.
    dy, xhat, dx (n, C); gamma (C,); rstd (n,); means (n, 2)."""
    n, C = dy.shape
    _sizes(xhat.shape == dy.shape and dx.shape == dy.shape and gamma.size == C and rstd.size == n
           and means.size == 2 * n, "dy, xhat, dx (n, C); gamma (C,); rstd (n,); means (n, 2)")
    _rows("layernorm_grad_input", n, C, _dtype(dy, gamma, xhat, rstd, means, dx),
          (dy, gamma, xhat, rstd, means, dx, _i64(n), _i64(C)))


# --- GELU (tanh approximation) ----------------------------------------------------------
def gelu_forward(x, t, y):
    """x (n,) -> t = tanh(s (x + 0.044715 x^3)), y = 0.5 x (1 + t), s = sqrt(2 / pi); one pass."""
    _sizes(t.size == x.size and y.size == x.size, "x, t, y of one size")
    _flat("gelu_forward", x.size, _dtype(x, t, y), (x, t, y, _i64(x.size)))


def gelu_backward(dy, x, t, dx):
    """dy, x, t (n,) -> dx (n,) = dy (0.5 (1 + t) + 0.5 x (1 - t^2) s (1 + 3 * 0.044715 x^2))."""
    _sizes(x.size == dy.size and t.size == dy.size and dx.size == dy.size, "dy, x, t, dx of one size")
    _flat("gelu_backward", dy.size, _dtype(dy, x, t, dx), (dy, x, t, dx, _i64(dy.size)))


# --- causal softmax ------------------------------------------------------------------
def softmax_causal(s):
    """s (M, T, T) scores -> probabilities, in place. Row i of each matrix
    keeps columns 0..i; the rest become 0 (as exp(-inf) would) unread."""
    M, T, T2 = s.shape
    _sizes(T == T2, "s must be (M, T, T)")
    _rows("softmax_causal", M * T, T, _dtype(s), (s, _i64(M * T), _i64(T)))


def softmax_causal_backward(d, p):
    """d (M, T, T) gradient w.r.t. probabilities p -> w.r.t. the scores, in
    place: d <- p (d - sum(d p)) on the causal part, 0 above it."""
    M, T, T2 = d.shape
    _sizes(T == T2 and p.shape == d.shape, "d, p must be (M, T, T)")
    _rows("softmax_causal_backward", M * T, T, _dtype(d, p), (d, p, _i64(M * T), _i64(T)))


# --- softmax cross-entropy over a vocabulary block ---------------------------------------
def masked_row_max(z, n_real, out):
    """z (n, V) -> out (n,): max over the columns < n_real (-inf if none);
    columns past n_real are vocabulary padding."""
    n, V = z.shape
    _sizes(out.size == n, "out must hold one value per row")
    dtype = _dtype(z, out)
    real = max(0, min(V, int(n_real)))
    _rows("masked_row_max", n, max(1, real), dtype, (z, out, _i64(n), _i64(V), _i64(real), dtype.type(-np.inf)))


def exp_rows(z, row_max, n_real, probs, sum_exp):
    """probs (n, V) = exp(z - row_max[:, None]) on the columns < n_real and 0
    on the padding; sum_exp (n,) its row sums."""
    n, V = z.shape
    _sizes(probs.shape == z.shape and row_max.size == n and sum_exp.size == n, "z, probs (n, V); row_max, sum_exp (n,)")
    real = max(0, min(V, int(n_real)))
    _rows("exp_rows", n, V, _dtype(z, row_max, probs, sum_exp),
          (z, row_max, probs, sum_exp, _i64(n), _i64(V), _i64(real)))


# --- AdamW ---------------------------------------------------------------------------
def adamw(p, g, m, v, b1, b2, step, eps, keep, grad_scale):
    """One AdamW update of the slice p, g, m, v (n,) in one pass: the
    gradient times grad_scale feeds m and v (g itself is left as it is),
    p <- keep p - step m / (sqrt(v) + eps). Computed in the storage type;
    the scalars are rounded to it once, as the array path rounds them."""
    _sizes(g.size == p.size and m.size == p.size and v.size == p.size, "p, g, m, v of one size")
    t = _dtype(p, g, m, v).type
    args = (p, g, m, v, t(b1), t(1.0 - b1), t(b2), t(1.0 - b2), t(step), t(eps), t(keep), t(grad_scale), _i64(p.size))
    _flat("adamw", p.size, p.dtype, args)


# --- embedding gradient -------------------------------------------------------------
def scatter_add_rows(target, rows, values):
    """target[rows[i]] += values[i] for each i; rows outside [0, V) are
    skipped. target (V, C); rows (n,) integer; values (n, C).

    Deterministic, with no host synchronisation: sort the keys (row, i),
    all distinct, so any sort gives the same order; then one block per run of
    equal rows adds the run's values in increasing i, as mpicube.device.fused and
    NumPy's add.at do."""
    xp = _cp()
    V, C = target.shape
    n = rows.size
    _sizes(values.shape == (n, C), "values must be (rows.size, target.shape[1])")
    dtype = _dtype(target, values)
    if n == 0:
        return
    rows = rows.reshape(-1).astype(xp.int64, copy=False)
    clean = xp.where((rows >= 0) & (rows < V), rows, V)                       # (n,) skipped rows -> V, sorted last
    keys = clean * n + xp.arange(n, dtype=xp.int64)                          # (n,) distinct
    order = xp.ascontiguousarray(xp.argsort(keys).astype(xp.int64, copy=False))   # (n,)
    sorted_rows = xp.ascontiguousarray(clean[order])                         # (n,)
    _rows("scatter_add_rows", n, C, dtype, (target, values, order, sorted_rows, _i64(n), _i64(C), _i64(V)))


# --- dropout ----------------------------------------------------------------------
def dropout_keep(key, terms, p, out):
    """out = 1.0 where mpicube.ops.rng.uniform(key, counter) >= p, else 0.0:
    the host's masks, bit for bit, hashed on the device. The counter of
    out's element (i_0, ..., i_k) is terms[0][i_0] + ... + terms[k][i_k]
    (mpicube.ops.rng.BlockIndex: per-dimension uint64 vectors, at most 4),
    summed inside the kernel, so no counter array of out's size is made.
    out float32/float64, shape (len(terms[0]), ..., len(terms[k]))."""
    xp = _cp()
    _sizes(1 <= len(terms) <= 4, "one to four index terms")
    _sizes(tuple(int(t.size) for t in terms) == tuple(out.shape), "one index term per dimension of out")
    terms = [xp.ascontiguousarray(t.reshape(-1).astype(xp.uint64, copy=False)) for t in terms]
    pad = 4 - len(terms)
    terms = [xp.zeros(1, dtype=xp.uint64)] * pad + terms                   # leading length-1 dimensions
    n1, n2, n3 = (int(t.size) for t in terms[1:])
    _flat("dropout_keep", out.size, _dtype(out),
          (*terms, out, np.uint64(int(key)), np.float64(p), _i64(n1), _i64(n2), _i64(n3), _i64(out.size)))
