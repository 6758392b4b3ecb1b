"""Floating-point formats, and the one GEMM every layout's matmuls go through.

Mixed precision (``--dtype float16`` or ``bfloat16``) stores activations,
the working copy of the weights and the panels that layouts gather or
broadcast in 16 bits, and computes in float32: each op upcasts what it reads,
does its arithmetic, statistics and reductions in float32, and rounds what
it stores once. The master weights, gradients and Adam moments stay float32
(``ParamStore``), so checkpoints do not depend on the training format.

GEMMs accumulate in float32. cuBLAS does that itself for 16-bit inputs;
NumPy has no 16-bit BLAS (its float16 matmul is a plain loop, about a
thousand times slower than sgemm), so ``matmul`` converts the panels to
float32 a block of rows at a time, calls sgemm, and rounds each block of the
result into the output: the temporaries stay a few MiB whatever the operand
sizes. The conversions are the price of 16-bit storage on CPUs (``mpicube
bench --dtype`` shows it); the GEMM itself runs at the float32 rate.

bfloat16 comes from ``ml_dtypes`` (the NumPy dtype extension JAX and
TensorFlow use): NumPy has no bfloat16 of its own, and ml_dtypes' casts are
vectorised C++.
"""

from __future__ import annotations

import numpy as np

from ..core.errors import UserError
from . import gemm_threads, threads
from .arrays import array_module

FORMATS = ("float32", "float64", "float16", "bfloat16")

# Rows per block when NumPy converts a 16-bit operand: at most this many
# float32 elements of the row panel are converted at once (4 MiB).
BLOCK_ELEMS = 1 << 20


def bfloat16():
    """The bfloat16 dtype of ml_dtypes, or one clear error saying how to get it."""
    try:
        import ml_dtypes
    except ImportError:
        raise UserError("--dtype bfloat16 needs the ml_dtypes package on CPUs: "
                        "pip install ml_dtypes (or reinstall mpicube)") from None
    return np.dtype(ml_dtypes.bfloat16)


def dtype_of(name: str) -> np.dtype:
    """The NumPy dtype of a ``--dtype`` name."""
    if name not in FORMATS:
        raise UserError(f"unknown dtype {name!r}; choose one of {', '.join(FORMATS)}")
    return bfloat16() if name == "bfloat16" else np.dtype(name)


def is_half(dtype) -> bool:
    """True for the 16-bit storage formats (float16, bfloat16)."""
    return np.dtype(dtype).itemsize == 2


def is_float(dtype) -> bool:
    """True for any floating-point format, bfloat16 included (its NumPy kind is 'V')."""
    dtype = np.dtype(dtype)
    return dtype.kind == "f" or dtype.name == "bfloat16"


def compute_dtype(dtype) -> np.dtype:
    """The format arithmetic runs in: float32 for 16-bit storage, else the format itself."""
    return np.dtype(np.float32) if is_half(dtype) else np.dtype(dtype)


def gradient_wire_name(name: str) -> str:
    """The format the summed gradients travel in (replica groups inside the
    tensor-parallel group, data parallelism), for a ``--dtype`` name: the
    one place that decides it, for the optimizer steps
    (``gradient_wire``) and the cost model (``costmodel.Widths``).

    bfloat16 sums them in 16 bits (words added in float32 at the receiver,
    ``mpicube.parallel.comm_wire``): bfloat16 has float32's exponent range, and the
    gradient sums were most of what kept a data-parallel bfloat16 step
    above half of float32's bytes, at no measurable cost in loss. float16
    keeps the float32 master format: its loss-scaled gradients sit near the
    top of float16's range, where a 16-bit sum would overflow and skip
    steps. float32 and float64 sum in their own format (unchanged).
    """
    return "bfloat16" if name == "bfloat16" else ("float64" if name == "float64" else "float32")


def gradient_wire(dtype) -> np.dtype:
    """``gradient_wire_name`` for a storage dtype: the ``wire=`` of the
    optimizer steps' gradient sums (the master format where that is not
    16 bits, so those sums are MPI's own)."""
    return dtype_of(gradient_wire_name(np.dtype(dtype).name))


def unit_roundoff(dtype) -> float:
    """u = 2^-p for a format with p significand bits (implicit bit included):
    the largest relative error of rounding one value to it."""
    bits = {"float16": 11, "bfloat16": 8, "float32": 24, "float64": 53}[np.dtype(dtype).name]
    return 2.0 ** -bits


def up(a):
    """``a`` in its compute format: a float32 copy of a 16-bit array, else ``a`` itself."""
    return a.astype(np.float32) if is_half(a.dtype) else a


def narrow(a, dtype):
    """``a`` rounded to ``dtype`` (``a`` itself when it already is)."""
    return a if a.dtype == dtype else a.astype(dtype)


def matmul(a, b, out=None, dtype=None):
    """a (..., n, k) @ b (..., k, m) -> (..., n, m), accumulated in at least
    float32. The result has ``dtype`` (default: ``out``'s, else ``a``'s) and
    is written into ``out`` when given. Leading dimensions must match (no
    broadcasting between batches)."""
    xp = array_module(a)
    if dtype is None:
        dtype = out.dtype if out is not None else a.dtype
    if xp is not np:
        return _matmul_device(xp, a, b, out, np.dtype(dtype))
    if not (is_half(a.dtype) or is_half(b.dtype)):
        if out is not None and out.dtype != dtype:
            raise ValueError("matmul: out has the wrong dtype")
        r = _gemm(a, b, out)
        return r if r.dtype == dtype else r.astype(dtype)
    return _matmul_blocks(a, b, out, dtype)


_TF32 = {"on": False}        # --tf32: float32 GEMMs may run on tensor cores (backend.set_tf32)


def use_tf32(enabled: bool) -> None:
    """Whether float32 products on a GPU may take TF32 inputs (``--tf32``):
    CuPy's own setting reaches its 2-D GEMMs only, so batched ones go
    through ``cublas_gemm`` with the TF32 compute type."""
    _TF32["on"] = bool(enabled)


def _matmul_device(xp, a, b, out, dtype):
    """A GEMM on a GPU. cuBLAS directly (``cublas_gemm``) where it applies:
    16-bit operands with a 16-bit or float32 result, 2-D or batched
    (tensor cores, float32 accumulation, transposed operands by flag), and
    float32 ones under --tf32; the result is rounded once, the same numbers
    as on CPUs. Otherwise CuPy: its 2-D 16-bit GEMM, or widened operands
    for a batched 16-bit product (CuPy's batched matmul cannot take
    bfloat16 and widens float16 anyway) or a mixed pair."""
    from . import cublas_gemm

    if a.dtype == b.dtype and (is_half(a.dtype) or (a.dtype == np.float32 and _TF32["on"])):
        r = cublas_gemm.matmul(xp, a, b, dtype, out, tf32=a.dtype == np.float32)
        if r is not None:
            return r
    if not (is_half(a.dtype) or is_half(b.dtype)):
        if a.ndim == 2 and (out is None or out.dtype == dtype):
            r = xp.matmul(a, b, out=out)
            return r if r.dtype == dtype else r.astype(dtype)
        r = xp.matmul(a, b)                 # batched: ``out`` may be a strided view CuPy's matmul refuses
        r = r if r.dtype == dtype else r.astype(dtype)
    elif a.ndim == 2 and is_half(dtype) and a.dtype == b.dtype == dtype:
        r = narrow(xp.matmul(a, b), dtype)
    else:
        r = narrow(xp.matmul(up(a), up(b)), dtype)
    if out is None:
        return r
    out[...] = r
    return out


def _matmul_blocks(a, b, out, dtype):
    """16-bit GEMM on NumPy: float32 copies of blocks of the operands, sgemm,
    each block's result rounded into the output once. A long inner dimension
    (a weight gradient, x^T dy over all tokens) is cut along k and summed in
    a float32 accumulator; otherwise ``a`` is cut by rows (by batches for
    batched operands) and ``b`` converted once."""
    if out is None:
        out = np.empty(a.shape[:-1] + (b.shape[-1],), dtype=dtype)
    if a.ndim > 2:
        per_batch = int(np.prod(a.shape[1:])) + int(np.prod(b.shape[1:]))
        step = max(1, BLOCK_ELEMS // max(1, per_batch))
        for lo in range(0, a.shape[0], step):
            batch = slice(lo, min(a.shape[0], lo + step))
            _gemm_into(up(a[batch]), up(b[batch]), out[batch])
        return out
    n, k = a.shape
    m = b.shape[1]
    if k > n:
        acc = out if out.dtype == np.float32 else np.empty((n, m), dtype=np.float32)   # (n, m)
        step = max(1, BLOCK_ELEMS // max(n, m))
        for lo in range(0, k, step):
            inner = slice(lo, min(k, lo + step))
            part = _gemm(up(a[:, inner]), up(b[inner]), out=acc if lo == 0 else None)
            if lo:
                acc += part
        if acc is not out:
            out[...] = acc
        return out
    b32 = up(b)                                                  # (k, m)
    step = max(1, BLOCK_ELEMS // max(1, k))
    for lo in range(0, n, step):
        rows = slice(lo, min(n, lo + step))
        _gemm_into(up(a[rows]), b32, out[rows])
    return out


def _gemm(a, b, out=None):
    """a @ b on NumPy, 2-D products in panels fixed by their shape over the
    rank's threads (``gemm_threads``): the same numbers at any thread count."""
    threads.tick()                           # the pools follow the free cores (device/core_load.py)
    if a.ndim == b.ndim == 2 and a.dtype == b.dtype:
        return gemm_threads.gemm(a, b, out)
    return np.matmul(a, b, out=out)


def _gemm_into(a32, b32, out):
    """out = a32 @ b32: straight into ``out`` when it is float32, else rounded."""
    if out.dtype == np.float32:
        _gemm(a32, b32, out=out)
    else:
        out[...] = _gemm(a32, b32)
