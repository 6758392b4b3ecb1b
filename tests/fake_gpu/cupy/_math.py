"""Elementwise math, reductions and products of the stand-in.

Each ufunc takes what a CuPy kernel takes (device arrays, Python and NumPy
scalars) and writes into ``out=`` only when it is a device array; NumPy
computes the values, so results match NumPy to the bit.
"""

from __future__ import annotations

import numpy as np

from ._convert import device_array, is_bfloat16, operand, out_array, wrap
from ._core import ndarray


class ufunc:
    """A CuPy ufunc over NumPy's: device arrays and scalars in, device arrays out."""

    __module__ = "cupy"

    def __init__(self, numpy_ufunc: np.ufunc, name: str | None = None):
        self._ufunc = numpy_ufunc
        self.__name__ = name or numpy_ufunc.__name__
        self.nin, self.nout, self.nargs = numpy_ufunc.nin, numpy_ufunc.nout, numpy_ufunc.nargs

    def __repr__(self):
        return f"<ufunc '{self.__name__}'>"

    def __call__(self, *args, out=None, dtype=None, casting="same_kind"):
        if len(args) > self.nin:
            if out is not None:
                raise TypeError("out was specified twice")
            args, out = args[:self.nin], args[self.nin:]
        if isinstance(out, tuple) and len(out) == 1:
            out = out[0]
        inputs = [operand(x) for x in args]
        if self.nout == 1:
            result = self._ufunc(*inputs, out=out_array(out), dtype=dtype, casting=casting)
            return out if out is not None else wrap(result)
        outs = {"out": tuple(out_array(o) for o in out)} if out is not None else {}   # NumPy refuses out=None here
        results = self._ufunc(*inputs, **outs, dtype=dtype, casting=casting)
        return out if out is not None else tuple(wrap(r) for r in results)


_UFUNCS = """add subtract multiply divide true_divide floor_divide negative positive power float_power
remainder mod fmod absolute sign square sqrt cbrt reciprocal exp exp2 expm1 log log2 log10 log1p logaddexp
sin cos tan arcsin arccos arctan arctan2 sinh cosh tanh arcsinh arccosh arctanh hypot deg2rad rad2deg
maximum minimum fmax fmin floor ceil trunc rint isfinite isinf isnan signbit copysign nextafter ldexp
frexp modf divmod equal not_equal less less_equal greater greater_equal logical_and logical_or
logical_xor logical_not bitwise_and bitwise_or bitwise_xor invert left_shift right_shift conjugate
matmul""".split()

class _Matmul(ufunc):
    """``cupy.matmul`` (and ``@``): more than 2 dimensions go through CuPy's
    batched path, which sends any dtype whose char is not in 'efdFD' to its
    integer GEMM and so fails for bfloat16 (CuPy 14.2's source); 2-D
    products of bfloat16 work."""

    def __call__(self, *args, **kwargs):
        check_matmul(*args[:2])
        return bfloat16_result(super().__call__(*args, **kwargs), *args[:2])


def bfloat16_result(result, a, b):
    """NumPy's matmul of ml_dtypes bfloat16 returns float32; CuPy's returns
    bfloat16 (float32 accumulation, one rounding): round it as CuPy does."""
    if isinstance(result, ndarray) and isinstance(a, ndarray) and isinstance(b, ndarray) \
            and is_bfloat16(a.dtype) and is_bfloat16(b.dtype) and not is_bfloat16(result.dtype):
        return result.astype(a.dtype)
    return result


def check_matmul(a, b) -> None:
    arrays = [x for x in (a, b) if isinstance(x, ndarray)]      # (builtins: this module shadows any/max)
    if arrays and True in [is_bfloat16(x.dtype) for x in arrays] and sorted(x.ndim for x in arrays)[-1] > 2:
        raise TypeError("data type 'E' not understood")


UFUNCS = {name: ufunc(getattr(np, name), name) for name in _UFUNCS}
UFUNCS["matmul"] = _Matmul(np.matmul, "matmul")
UFUNCS["abs"] = UFUNCS["absolute"]
UFUNCS["bitwise_not"] = UFUNCS["invert"]
UFUNCS["conj"] = UFUNCS["conjugate"]


# --- reductions: CuPy calls the array's method ------------------------------
def sum(a, axis=None, dtype=None, out=None, keepdims=False):
    return _as_device(a).sum(axis, dtype, out, keepdims)


def prod(a, axis=None, dtype=None, out=None, keepdims=False):
    return _as_device(a).prod(axis, dtype, out, keepdims)


def mean(a, axis=None, dtype=None, out=None, keepdims=False):
    return _as_device(a).mean(axis, dtype, out, keepdims)


def var(a, axis=None, dtype=None, out=None, ddof=0, keepdims=False):
    return _as_device(a).var(axis, dtype, out, ddof, keepdims)


def std(a, axis=None, dtype=None, out=None, ddof=0, keepdims=False):
    return _as_device(a).std(axis, dtype, out, ddof, keepdims)


def amax(a, axis=None, out=None, keepdims=False):
    return _as_device(a).max(axis, out, keepdims)


def amin(a, axis=None, out=None, keepdims=False):
    return _as_device(a).min(axis, out, keepdims)


def all(a, axis=None, out=None, keepdims=False):
    return _as_device(a).all(axis, out, keepdims)


def any(a, axis=None, out=None, keepdims=False):
    return _as_device(a).any(axis, out, keepdims)


def argmax(a, axis=None, dtype=None, out=None, keepdims=False):
    return _as_device(a).argmax(axis, out, dtype, keepdims)


def argmin(a, axis=None, dtype=None, out=None, keepdims=False):
    return _as_device(a).argmin(axis, out, dtype, keepdims)


def cumsum(a, axis=None, dtype=None, out=None):
    return _as_device(a).cumsum(axis, dtype, out)


def bincount(x, weights=None, minlength=0):
    """CuPy's bincount: a device array of non-negative integers in, the counts on the device out."""
    w = None if weights is None else device_array(weights, "weights")
    return wrap(np.bincount(device_array(x, "x"), w, minlength=minlength))


def count_nonzero(a, axis=None):
    """A device array even for ``axis=None`` (CuPy does not sync here)."""
    return wrap(np.count_nonzero(device_array(a, "a"), axis=axis))


def clip(a, a_min, a_max, out=None):
    return _as_device(a).clip(a_min, a_max, out)


def around(a, decimals=0, out=None):
    return _as_device(a).round(decimals, out)


def where(condition, x=None, y=None):
    if x is None and y is None:
        return _as_device(condition).nonzero()
    if x is None or y is None:
        raise ValueError("Must give either both or neither of x and y")
    return wrap(np.where(device_array(condition, "condition"), operand(x), operand(y)))


def isclose(a, b, rtol=1e-05, atol=1e-08, equal_nan=False):
    return wrap(np.isclose(operand(a), operand(b), rtol, atol, equal_nan))


def allclose(a, b, rtol=1e-05, atol=1e-08, equal_nan=False):
    """A 0-d device array, as in CuPy (no sync until it is read)."""
    return wrap(np.allclose(operand(a), operand(b), rtol, atol, equal_nan))


def array_equal(a1, a2, equal_nan=False):
    return wrap(np.array_equal(device_array(a1, "a1"), device_array(a2, "a2"), equal_nan=equal_nan))


def _as_device(a) -> ndarray:
    device_array(a, "a")
    return a


# --- products ---------------------------------------------------------------
def dot(a, b, out=None):
    return _as_device(a).dot(b, out)


def vdot(a, b):
    return wrap(np.vdot(device_array(a, "a"), device_array(b, "b")))


def inner(a, b):
    return wrap(np.inner(device_array(a, "a"), device_array(b, "b")))


def outer(a, b, out=None):
    result = np.outer(device_array(a, "a"), device_array(b, "b"), out=out_array(out))
    return out if out is not None else wrap(result)


def tensordot(a, b, axes=2):
    return wrap(np.tensordot(device_array(a, "a"), device_array(b, "b"), axes))


def einsum(*operands, **kwargs):
    """CuPy passes the operands through ``cupy.asarray``: host operands are
    accepted and copied to the device (counted)."""
    from ._creation import asarray

    dtype = kwargs.pop("dtype", None)
    optimize = kwargs.pop("optimize", False)
    casting = kwargs.pop("casting", "safe")
    if kwargs:
        raise TypeError(f"Did not understand the following kwargs: {list(kwargs)}")
    if not isinstance(operands[0], str):
        raise TypeError("stand-in: only the subscripts form of einsum is offered")
    arrays = [asarray(x)._a for x in operands[1:]]
    return wrap(np.einsum(operands[0], *arrays, dtype=dtype, optimize=optimize, casting=casting))


__all__ = ["ufunc", "sum", "prod", "mean", "var", "std", "amax", "amin", "all", "any", "argmax", "argmin",
           "cumsum", "bincount", "count_nonzero", "clip", "around", "where", "isclose", "allclose", "array_equal", "dot",
           "vdot", "inner", "outer", "tensordot", "einsum"]
