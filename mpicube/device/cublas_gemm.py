"""16-bit and TF32 GEMMs through cuBLAS directly, on a real GPU.

CuPy gets three things wrong for mpicube's products (CuPy 14, read from its
source):

* a float32 result of two float16 (or bfloat16) operands: CuPy widens both
  operands and runs a float32 GEMM, off the tensor cores;
* any batched product (more than 2 dimensions, attention's q k^T and p v):
  bfloat16 goes to CuPy's integer GEMM path and raises ``TypeError: data
  type 'E' not understood``; float16 is converted to float32 and multiplied
  with float32 compute on a handle in default math mode, so neither the
  tensor cores nor ``--tf32`` apply; and a transposed operand (``k^T``) is
  first copied to C order.

cublasGemmEx and cublasGemmStridedBatchedEx do exactly what is wanted:
CUDA_R_16F or CUDA_R_16BF inputs, a 16-bit or CUDA_R_32F output, float32
accumulation (CUBLAS_COMPUTE_32F, or CUBLAS_COMPUTE_32F_FAST_TF32 for
float32 operands under --tf32), and transposition flags instead of copies.

Row-major C = A @ B is column-major C^T = B^T A^T, so the operands are
passed swapped. Each matrix of an operand must be row-major (passed as is)
or column-major (``x.T`` of a row-major x, passed with the transpose flag),
and the batch must be one evenly strided run (leading dimensions that
collapse into one); anything else is not taken, and the caller widens.

This path cannot run in CI (the CuPy stand-in has no cuBLAS), so it checks
itself: the first call of each kind in a process compares a small product
with the widened-operand GEMM, and any error or disagreement switches that
kind off for the process (``precision.matmul`` then widens, which is
correct, only slower). ``tools/gpu_mixed.py`` reports which path ran.
"""

from __future__ import annotations

import numpy as np

_STATE = {}           # (kind, operand format, result format) -> True / False once checked;
                      # kinds: "gemmex" (2-D), "batched", "tf32" (float32 operands under --tf32)
_CUDA_R_32F, _CUDA_R_16F, _CUDA_R_16BF = 0, 2, 14
_CUBLAS_COMPUTE_32F, _CUBLAS_COMPUTE_32F_FAST_TF32, _CUBLAS_GEMM_DEFAULT = 68, 77, -1
_OP_N, _OP_T = 0, 1
_ONE, _ZERO = np.ones(1, np.float32), np.zeros(1, np.float32)


def _checked(kind: str):
    """True if every checked call of ``kind`` passed, False if one failed, None if none ran."""
    seen = [ok for (k, *_), ok in _STATE.items() if k == kind]
    return None if not seen else all(seen)


def status() -> str:
    """How 2-D 16-bit products run: 'gemmex', 'widened' or 'unchecked', for reports."""
    return {None: "unchecked", True: "gemmex", False: "widened"}[_checked("gemmex")]


def batched_status() -> str:
    """How batched 16-bit products run: 'strided-batched-ex', 'widened' or 'unchecked'."""
    return {None: "unchecked", True: "strided-batched-ex", False: "widened"}[_checked("batched")]


def _type(dtype) -> int:
    if dtype == np.float32:
        return _CUDA_R_32F
    return _CUDA_R_16F if dtype == np.float16 else _CUDA_R_16BF


def _matrices(x):
    """(transpose flag, leading dimension, batch stride, batch count) of an
    operand (..., rows, cols) as cuBLAS sees it, in elements; None if its
    matrices are neither row- nor column-major or its batch is not one
    evenly strided run."""
    *lead, rows, cols = x.shape
    item = x.itemsize
    *lead_strides, s_rows, s_cols = (s // item for s in x.strides)
    if any(s * item != t for s, t in zip((*lead_strides, s_rows, s_cols), x.strides)):
        return None
    if (s_cols == 1 or cols == 1) and (s_rows == cols or rows == 1):
        flag, ld = _OP_N, max(1, cols)
    elif (s_rows == 1 or rows == 1) and (s_cols == rows or cols == 1):
        flag, ld = _OP_T, max(1, rows)
    else:
        return None
    count, stride = 1, rows * cols
    for n, s in zip(reversed(lead), reversed(lead_strides)):
        if n == 1:
            continue
        if count > 1 and s != stride * count:
            return None                         # the leading dimensions do not collapse into one run
        if count == 1:
            stride = s
        count *= n
    if count > 1 and stride < rows * cols:
        return None                             # overlapping matrices
    return flag, ld, stride, count


def _cublas():
    try:
        from cupy_backends.cuda.libs import cublas
    except ImportError:                                  # older CuPy layouts
        from cupy.cuda import cublas
    return cublas


def _call(cupy, a, b, out, compute) -> bool:
    """out (..., M, N) = a (..., M, K) @ b (..., K, N), one cuBLAS call;
    False if the operands do not fit it."""
    ma, mb = _matrices(a), _matrices(b)
    if ma is None or mb is None or not out.flags.c_contiguous:
        return False
    (M, K), N = a.shape[-2:], b.shape[-1]
    batch = int(np.prod(out.shape[:-2], dtype=np.int64))
    if a.ndim != b.ndim or a.shape[:-2] != b.shape[:-2] or ma[3] != batch or mb[3] != batch:
        return False
    cublas = _cublas()
    handle = cupy.cuda.device.get_cublas_handle()
    cublas.setStream(handle, cupy.cuda.get_current_stream().ptr)
    ta, tb, tc = _type(a.dtype), _type(b.dtype), _type(out.dtype)
    if out.ndim == 2:
        cublas.gemmEx(handle, mb[0], ma[0], N, M, K, _ONE.ctypes.data, b.data.ptr, tb, mb[1],
                      a.data.ptr, ta, ma[1], _ZERO.ctypes.data, out.data.ptr, tc, max(1, N),
                      compute, _CUBLAS_GEMM_DEFAULT)
    else:
        cublas.gemmStridedBatchedEx(handle, mb[0], ma[0], N, M, K, _ONE.ctypes.data,
                                    b.data.ptr, tb, mb[1], mb[2], a.data.ptr, ta, ma[1], ma[2],
                                    _ZERO.ctypes.data, out.data.ptr, tc, max(1, N), M * N, batch,
                                    compute, _CUBLAS_GEMM_DEFAULT)
    return True


def matmul(cupy, a, b, dtype, out=None, tf32: bool = False):
    """a @ b with a ``dtype`` result through cuBLAS, or None where it does not
    apply (the caller widens or asks CuPy instead): same-format operands,
    16-bit (a 16-bit or float32 result) or float32 under ``tf32`` (a float32
    result), 2-D or batched, on a real CuPy whose self-check of that kind
    passed."""
    dtype = np.dtype(dtype)
    if a.dtype != b.dtype or a.ndim < 2 or (a.dtype == np.float32) != tf32:
        return None
    if a.dtype != np.float32 and a.dtype.itemsize != 2:
        return None
    if dtype != np.float32 and dtype != a.dtype:
        return None
    kind = "tf32" if tf32 else ("batched" if a.ndim > 2 else "gemmex")
    key = (kind, a.dtype.name, dtype.name)
    if getattr(cupy, "_mpicube_host_memory", False):     # CI's stand-in: no cuBLAS
        _STATE[key] = False
        return None
    if _STATE.get(key) is False:
        return None
    if _STATE.get(key) is None and not _self_check(cupy, key):
        return None
    compute = _CUBLAS_COMPUTE_32F_FAST_TF32 if tf32 else _CUBLAS_COMPUTE_32F
    shape = a.shape[:-1] + b.shape[-1:]
    result = out if out is not None and out.flags.c_contiguous and out.dtype == dtype else cupy.empty(shape, dtype)
    if not _call(cupy, a, b, result, compute):
        return None
    if out is not None and result is not out:
        out[...] = result
        return out
    return result


def _self_check(cupy, key) -> bool:
    """Compare the cuBLAS call with the widened GEMM on a small product whose
    operands are row- and column-major (batched for "batched"); switch that
    kind off on any problem."""
    kind, operand, result = key
    try:
        rng = np.random.default_rng(0)
        lead = (3, 2) if kind == "batched" else ()
        a = cupy.asarray(rng.normal(size=lead + (48, 40)).astype(np.float32)).astype(operand)
        b = cupy.asarray(rng.normal(size=lead + (24, 40)).astype(np.float32)).astype(operand).swapaxes(-1, -2)
        want = cupy.matmul(a.astype(np.float32), b.astype(np.float32))
        got = cupy.empty(lead + (48, 24), dtype=result)
        compute = _CUBLAS_COMPUTE_32F_FAST_TF32 if kind == "tf32" else _CUBLAS_COMPUTE_32F
        tolerance = 2e-2 if np.dtype(result).itemsize == 2 or kind == "tf32" else 1e-4
        ok = (_call(cupy, a, b, got, compute)
              and float(cupy.abs(got.astype(np.float32) - want).max()) <= tolerance * float(cupy.abs(want).max()))
    except Exception:          # an old CuPy, a missing symbol, a cuBLAS error: widen instead
        ok = False
    _STATE[key] = bool(ok)
    return _STATE[key]
