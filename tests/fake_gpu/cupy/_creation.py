"""Creating device arrays, and the two explicit doors between host and device
(``asarray`` / ``array`` in, ``asnumpy`` out), which the counters watch.

Data made on the device (``zeros``, ``arange``, ...) is not a transfer; data
copied from a host object (NumPy array, list, scalar) is one h2d copy.
"""

from __future__ import annotations

import numpy as np

from ._convert import check_dtype, device_array, from_host, operand, wrap, wrap_empty
from ._core import ndarray

def _device_leaves(obj):
    """``obj`` with each device array replaced by its NumPy value when it is
    a (nested) list or tuple of device arrays only, else None: CuPy joins
    such a list on the device, without a transfer."""
    if type(obj) is ndarray:
        return obj._a
    if not isinstance(obj, (list, tuple)) or not obj:
        return None
    leaves = [_device_leaves(item) for item in obj]
    return None if any(leaf is None for leaf in leaves) else leaves


def array(obj, dtype=None, copy=True, order="K", subok=False, ndmin=0, *, blocking=False):
    if type(obj) is ndarray:
        result = obj.astype(dtype if dtype is not None else obj.dtype, order=order, copy=copy)
        if ndmin > result.ndim:
            result = result.reshape((1,) * (ndmin - result.ndim) + result.shape)
        return result
    leaves = _device_leaves(obj)
    if leaves is not None:
        try:
            joined = np.array(leaves, dtype=dtype, ndmin=ndmin)
        except ValueError:  # ragged: NumPy would need the values on the host
            raise TypeError("Implicit conversion to a NumPy array is not allowed.") from None
        return wrap(joined)
    return from_host(obj, dtype, order=order if order in ("C", "F") else "K", ndmin=ndmin)


def asarray(a, dtype=None, order=None, *, copy=None, blocking=False):
    if type(a) is ndarray and copy is not True and (dtype is None or np.dtype(dtype) == a.dtype):
        return a
    return array(a, dtype=dtype, copy=bool(copy) if copy is not None else False, order=order or "K")


asanyarray = asarray


def ascontiguousarray(a, dtype=None):
    source = device_array(a, "a")
    dtype = check_dtype(dtype if dtype is not None else source.dtype)
    if source.flags.c_contiguous and source.ndim and dtype == source.dtype:
        return a
    return wrap(np.ascontiguousarray(source, dtype=dtype))


def copy(a, order="K"):
    return wrap(device_array(a, "a").copy(order))


def asnumpy(a, stream=None, order="C", out=None, *, blocking=True):
    """A host copy of a device array (counted); host input is returned as NumPy."""
    if type(a) is ndarray:
        return a.get(stream=stream, order=order, out=out, blocking=blocking)
    result = np.asarray(a, order=order)
    if out is None:
        return result
    out[...] = result
    return out


def get_array_module(*args):
    return _module() if any(type(a) is ndarray for a in args) else np


def _module():
    import cupy

    return cupy


# --- made on the device -----------------------------------------------------
def empty(shape, dtype=float, order="C"):
    return wrap_empty(np.empty(shape, check_dtype(dtype), order))


def zeros(shape, dtype=float, order="C"):
    return wrap(np.zeros(shape, check_dtype(dtype), order))


def ones(shape, dtype=float, order="C"):
    return wrap(np.ones(shape, check_dtype(dtype), order))


def full(shape, fill_value, dtype=None, order="C"):
    if dtype is None:
        dtype = fill_value.dtype if type(fill_value) is ndarray else np.array(fill_value).dtype
    result = empty(shape, dtype, order)
    result.fill(fill_value)
    return result


def _like(prototype, dtype, order, shape):
    """Shape, dtype and order of a prototype: CuPy reads only its metadata,
    so a NumPy prototype is accepted (nothing is copied)."""
    if not isinstance(prototype, (ndarray, np.ndarray)):
        raise TypeError(f"Unsupported type {type(prototype)}")
    dtype = check_dtype(prototype.dtype if dtype is None else dtype)
    shape = prototype.shape if shape is None else shape
    if order in ("K", "A"):
        order = "F" if prototype.flags.f_contiguous and not prototype.flags.c_contiguous else "C"
    return shape, dtype, order


def empty_like(prototype, dtype=None, order="K", subok=None, shape=None):
    return empty(*_like(prototype, dtype, order, shape))


def zeros_like(a, dtype=None, order="K", subok=None, shape=None):
    return zeros(*_like(a, dtype, order, shape))


def ones_like(a, dtype=None, order="K", subok=None, shape=None):
    return ones(*_like(a, dtype, order, shape))


def full_like(a, fill_value, dtype=None, order="K", subok=None, shape=None):
    shape, dtype, order = _like(a, dtype, order, shape)
    return full(shape, fill_value, dtype, order)


def _host_number(x, name):
    if type(x) is ndarray:
        raise TypeError(f"{name} must be a scalar, not a cupy.ndarray")
    return x


def arange(start, stop=None, step=1, dtype=None):
    args = [_host_number(x, n) for x, n in ((start, "start"), (stop, "stop"), (step, "step"))]
    if args[1] is None:
        args = [0, args[0], args[2]]
    return wrap(np.arange(*args, dtype=None if dtype is None else check_dtype(dtype)))


def linspace(start, stop, num=50, endpoint=True, retstep=False, dtype=None, axis=0):
    result = np.linspace(operand(start), operand(stop), num, endpoint, retstep, dtype, axis)
    return (wrap(result[0]), result[1]) if retstep else wrap(result)


def eye(N, M=None, k=0, dtype=float, order="C"):
    return wrap(np.eye(N, M, k, check_dtype(dtype), order))


def identity(n, dtype=float):
    return wrap(np.identity(n, check_dtype(dtype)))


def tri(N, M=None, k=0, dtype=float):
    return wrap(np.tri(N, M, k, check_dtype(dtype)))


def triu(m, k=0):
    return wrap(np.triu(device_array(m, "m"), k))


def tril(m, k=0):
    return wrap(np.tril(device_array(m, "m"), k))


def triu_indices(n, k=0, m=None):
    return tuple(wrap(i) for i in np.triu_indices(n, k, m))


def tril_indices(n, k=0, m=None):
    return tuple(wrap(i) for i in np.tril_indices(n, k, m))


__all__ = ["array", "asarray", "asanyarray", "ascontiguousarray", "copy", "asnumpy", "get_array_module",
           "empty", "zeros", "ones", "full", "empty_like", "zeros_like", "ones_like", "full_like", "arange",
           "linspace", "eye", "identity", "tri", "triu", "tril", "triu_indices", "tril_indices"]
