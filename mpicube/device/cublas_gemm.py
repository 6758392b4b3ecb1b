"""16-bit operands, float32 result: one cuBLAS GemmEx call on a real GPU.

CuPy's matmul of two float16 arrays returns float16; asking it for a float32
result makes it widen both operands first and run a float32 GEMM, off the
tensor cores. A partial sum that will be reduced across ranks, and a weight
gradient that lands in the float32 gradient buffer, want 16-bit inputs and
a float32 output: cublasGemmEx does exactly that (CUDA_R_16F or
CUDA_R_16BF inputs, CUDA_R_32F output, CUBLAS_COMPUTE_32F).

Row-major C = A @ B is column-major C^T = B^T A^T, so the operands are
passed swapped; a C-contiguous operand is its column-major transpose as it
is, an F-contiguous one (``x.T`` of a C-contiguous x) is passed with the
transpose flag. Anything else (strided views, batches) is not taken.

This path cannot run in CI (the CuPy stand-in has no cuBLAS), so it checks
itself: the first call in a process compares a small product with the
widened-operand GEMM, and any error or disagreement switches it off for the
process (``precision.matmul`` then widens, which is correct, only slower).
``tools/gpu_mixed.py`` reports which path ran.
"""

from __future__ import annotations

import numpy as np

_STATE = {"ok": None}        # None: not checked yet; then True or False
_CUDA_R_32F, _CUDA_R_16F, _CUDA_R_16BF = 0, 2, 14
_CUBLAS_COMPUTE_32F, _CUBLAS_GEMM_DEFAULT = 68, -1
_OP_N, _OP_T = 0, 1
_ONE, _ZERO = np.ones(1, np.float32), np.zeros(1, np.float32)


def status() -> str:
    """'gemmex', 'widened' or 'unchecked', for reports."""
    return {None: "unchecked", True: "gemmex", False: "widened"}[_STATE["ok"]]


def _layout(x):
    """(transpose flag, leading dimension) of a 2-D operand as cuBLAS sees
    it, or None if it is neither C- nor F-contiguous."""
    rows, cols = x.shape
    if x.flags.c_contiguous:
        return _OP_N, max(1, cols)
    if x.flags.f_contiguous:
        return _OP_T, max(1, rows)
    return None


def _call(cupy, a, b, out) -> bool:
    """out (M, N) float32 = a (M, K) @ b (K, N), 16-bit a and b of one
    format; False if the operands do not fit the call."""
    try:
        from cupy_backends.cuda.libs import cublas
    except ImportError:                                  # older CuPy layouts
        from cupy.cuda import cublas

    la, lb = _layout(a), _layout(b)
    if la is None or lb is None or not out.flags.c_contiguous or out.dtype != np.float32:
        return False
    kind = _CUDA_R_16F if a.dtype == np.float16 else _CUDA_R_16BF
    (M, K), N = a.shape, b.shape[1]
    handle = cupy.cuda.device.get_cublas_handle()
    cublas.setStream(handle, cupy.cuda.get_current_stream().ptr)
    cublas.gemmEx(handle, lb[0], la[0], N, M, K, _ONE.ctypes.data, b.data.ptr, kind, lb[1],
                  a.data.ptr, kind, la[1], _ZERO.ctypes.data, out.data.ptr, _CUDA_R_32F, max(1, N),
                  _CUBLAS_COMPUTE_32F, _CUBLAS_GEMM_DEFAULT)
    return True


def matmul_to_float32(cupy, a, b, out=None):
    """a @ b as float32 through GemmEx, or None where it does not apply (the
    caller widens instead): 2-D operands of the same 16-bit format on a real
    CuPy whose self-check passed."""
    if _STATE["ok"] is False or a.ndim != 2 or b.ndim != 2 or a.dtype != b.dtype:
        return None
    if getattr(cupy, "_mpicube_host_memory", False):     # CI's stand-in: no cuBLAS
        _STATE["ok"] = False
        return None
    if _STATE["ok"] is None and not _self_check(cupy, a.dtype):
        return None
    result = out if out is not None and out.flags.c_contiguous else cupy.empty(a.shape[:1] + b.shape[1:],
                                                                                 dtype=np.float32)
    if not _call(cupy, a, b, result):
        return None
    if out is not None and result is not out:
        out[...] = result
        return out
    return result


def _self_check(cupy, dtype) -> bool:
    """Compare GemmEx with the widened GEMM on a small product whose
    operands are C- and F-contiguous; switch the path off on any problem."""
    try:
        rng = np.random.default_rng(0)
        a = cupy.asarray(rng.normal(size=(48, 40)).astype(np.float32)).astype(dtype)
        b = cupy.asarray(rng.normal(size=(24, 40)).astype(np.float32)).astype(dtype).T     # F-contiguous
        want = cupy.matmul(a.astype(np.float32), b.astype(np.float32))
        got = cupy.empty((48, 24), dtype=np.float32)
        ok = _call(cupy, a, b, got) and float(cupy.abs(got - want).max()) <= 1e-4 * float(cupy.abs(want).max())
    except Exception:          # an old CuPy, a missing symbol, a cuBLAS error: widen instead
        ok = False
    _STATE["ok"] = bool(ok)
    return _STATE["ok"]
