"""The stand-in's ``cupy.ndarray``: a plain Python object around a private
NumPy array that plays the part of device memory.

It is a wrapper rather than a NumPy subclass so that it has what a CuPy array
has and nothing more: no buffer protocol (MPI cannot read it unless the
CUDA array interface is switched on), ``__array__`` raising TypeError,
``__array_ufunc__ = None`` and an ``__array_function__`` that declines, so
NumPy refuses it in ufuncs, functions and mixed arithmetic. Real CuPy would
dispatch ``numpy.exp(device_array)`` to itself; the stand-in refuses instead,
because in mpicube such a call is a bug (ops must use ``xp``). NumPy scalars
on the left (``numpy.float32(2) * a``) still work, as in CuPy.

Operands follow CuPy's kernel rules: stand-in arrays, Python scalars and
NumPy scalars; anything else, a NumPy array in particular, is a TypeError.
Indices and advanced-index values follow CuPy's indexing code: host index
arrays and lists are copied to the device (counted), a host array assigned
through advanced indexing is copied too, but a basic slice assignment takes
only scalars (CuPy routes it through ``fill``).
"""

from __future__ import annotations

import warnings

import numpy as np

from . import _stand_in
from ._convert import (check_dtype, count_mask_syncs, device_array, from_host, operand, out_array,
                       prepare_index, wrap, wrap_view, written)
from ._memory import Flags, MemoryPointer


def _binary(ufunc):
    """The forward, reflected and in-place operators of ``ufunc``."""

    def op(self, other):
        return wrap(ufunc(self._a, operand(other)))

    def rop(self, other):
        return wrap(ufunc(operand(other), self._a))

    def iop(self, other):
        ufunc(self._a, operand(other), out=self._a)
        written(self)
        return self

    return op, rop, iop


def _comparison(ufunc, unrelated: bool | None = None):
    """A rich comparison; ``==`` / ``!=`` with objects that have no notion of
    equality (None, ...) give all-False / all-True, as in CuPy."""

    def op(self, other):
        if unrelated is not None and (other is None or type(other).__eq__ is object.__eq__):
            return wrap(np.full(self._a.shape, unrelated, dtype=np.bool_))
        return wrap(ufunc(self._a, operand(other)))

    return op


class ndarray:
    """A device array of the stand-in (see the module docstring)."""

    __slots__ = ("_a", "_base", "_mark", "__weakref__")   # _mark: _stand_in's stream-order stamp
    __module__ = "cupy"
    __array_ufunc__ = None
    __array_priority__ = 100

    def __init__(self, shape, dtype=float, memptr=None, strides=None, order="C"):
        dtype = check_dtype(dtype)
        if memptr is None:
            self._a = np.empty(shape, dtype, order=order)
        else:
            buf, offset = memptr.numpy_buffer()
            self._a = np.ndarray(shape, dtype, buffer=buf, offset=offset, strides=strides, order=order)
        self._base = None
        self._mark = -1                     # allocated, not yet written by queued work

    # --- refusals -----------------------------------------------------------
    def __array__(self, dtype=None, copy=None):
        raise TypeError("Implicit conversion to a NumPy array is not allowed. "
                        "Please use `.get()` to construct a NumPy array explicitly.")

    def __array_function__(self, func, types, args, kwargs):
        return NotImplemented

    @property
    def __cuda_array_interface__(self):
        """Version 3, only while MPICUBE_CUDA_AWARE=1: then mpi4py hands the
        address to MPI, which reads host memory, as a CUDA-aware MPI would
        read device memory."""
        if not _stand_in.cuda_aware():
            raise AttributeError("'cupy.ndarray' object has no attribute '__cuda_array_interface__' "
                                 "(the stand-in offers it only with MPICUBE_CUDA_AWARE=1)")
        _stand_in.check_handoff((self._base if self._base is not None else self)._mark)
        a = self._a
        typestr = a.dtype.str
        return {"shape": a.shape, "typestr": typestr, "descr": [("", typestr)],
                "strides": None if a.flags.c_contiguous else a.strides,
                "data": (a.ctypes.data if a.size else 0, not a.flags.writeable),
                "stream": 1, "version": 3}

    # --- attributes ---------------------------------------------------------
    @property
    def shape(self):
        return self._a.shape

    @shape.setter
    def shape(self, new_shape):
        self._a = np.reshape(self._a, new_shape, copy=False)

    dtype = property(lambda self: self._a.dtype)
    size = property(lambda self: self._a.size)
    ndim = property(lambda self: self._a.ndim)
    itemsize = property(lambda self: self._a.itemsize)
    nbytes = property(lambda self: self._a.nbytes)
    strides = property(lambda self: self._a.strides)
    base = property(lambda self: self._base)
    T = property(lambda self: wrap_view(self._a.T, self))
    real = property(lambda self: wrap_view(self._a.real, self))
    imag = property(lambda self: wrap_view(self._a.imag, self))

    @property
    def mT(self):
        if self.ndim < 2:
            raise ValueError("matrix transpose with ndim < 2 is undefined")
        return self.swapaxes(-1, -2)

    @property
    def flags(self):
        f = self._a.flags
        return Flags(f.c_contiguous, f.f_contiguous, self._base is None)

    @property
    def data(self):
        return MemoryPointer(self if self._base is None else self._base, self._a.ctypes.data)

    @property
    def device(self):
        from .cuda import Device

        return Device()

    # --- host transfers -----------------------------------------------------
    def get(self, stream=None, order="C", out=None, blocking=True):
        """A host copy (counted), into ``out`` (a NumPy array, e.g. pinned) if given."""
        if out is not None:
            if not isinstance(out, np.ndarray):
                raise TypeError("Only numpy.ndarray can be obtained from cupy.ndarray")
            if out.dtype != self.dtype:
                raise TypeError(f"{out.dtype} array cannot be obtained from {self.dtype} array")
            if out.shape != self.shape:
                raise ValueError(f"Shape mismatch. Expected shape: {self.shape}, actual shape: {out.shape}")
            out[...] = self._a
            _stand_in.count_d2h(self.nbytes)
            return out
        order = order.upper()
        if order == "A":
            order = "F" if self._a.flags.f_contiguous and not self._a.flags.c_contiguous else "C"
        _stand_in.count_d2h(self.nbytes)
        return np.array(self._a, order=order, copy=True)

    def set(self, arr, stream=None):
        """Overwrite with host data of the same dtype and shape (counted)."""
        if not isinstance(arr, np.ndarray):
            raise TypeError("Only numpy.ndarray can be set to cupy.ndarray")
        if self.dtype != arr.dtype:
            raise TypeError(f"{arr.dtype} array cannot be set to {self.dtype} array")
        if self.shape != arr.shape:
            raise ValueError(f"Shape mismatch. Old shape: {self.shape}, new shape: {arr.shape}")
        if not (self._a.flags.c_contiguous or self._a.flags.f_contiguous):
            raise RuntimeError("Cannot set to non-contiguous array")
        _stand_in.count_h2d(arr.nbytes)
        self._a[...] = arr

    def item(self, *args):
        _stand_in.count_d2h(self.itemsize)
        return self._a.item(*args)

    def tolist(self):
        return self.get().tolist()

    def __int__(self):
        return int(self.get())

    def __float__(self):
        return float(self.get())

    def __complex__(self):
        return complex(self.get())

    def __bool__(self):
        if self.size == 0:
            warnings.warn("The truth value of an empty array is ambiguous. Returning False, but in future "
                          "this will result in an error. Use `array.size > 0` to check that an array is "
                          "not empty.", DeprecationWarning, stacklevel=2)
            return False
        if self.size == 1:
            return bool(self.get())
        raise ValueError("The truth value of an array with more than one element is ambiguous. "
                         "Use a.any() or a.all()")

    def __repr__(self):
        return repr(self.get())

    def __str__(self):
        return str(self.get())

    def __format__(self, spec):
        return format(self.get(), spec)

    def __reduce__(self):
        from ._creation import array

        return array, (self.get(order="A"),)

    # --- containers and indexing ---------------------------------------------
    def __len__(self):
        if self.ndim == 0:
            raise TypeError("len() of unsized object")
        return self._a.shape[0]

    def __iter__(self):
        if self.ndim == 0:
            raise TypeError("iteration over a 0-d array")
        return (self[i] for i in range(self._a.shape[0]))

    def __getitem__(self, key):
        index, _, masks = prepare_index(key)
        count_mask_syncs(masks)
        return wrap_view(self._a[index], self)

    def __setitem__(self, key, value):
        index, advanced, masks = prepare_index(key)
        if type(value) is ndarray:
            source = value._a
        elif advanced:
            source = from_host(value, self.dtype)._a
        else:
            source = np.asarray(value, dtype=self.dtype)
            if source.ndim:
                raise ValueError("non-scalar numpy.ndarray cannot be used for fill")
        count_mask_syncs(masks)
        self._a[index] = source
        written(self)

    def fill(self, value):
        if type(value) is ndarray:
            if value.ndim:
                raise ValueError("non-scalar cupy.ndarray cannot be used for fill")
            self._a[...] = value._a
            written(self)
            return
        value = np.asarray(value, dtype=self.dtype)
        if value.ndim:
            raise ValueError("non-scalar numpy.ndarray cannot be used for fill")
        self._a.fill(value[()])
        written(self)

    # --- shape and copies ---------------------------------------------------
    def reshape(self, *shape, order="C"):
        shape = shape[0] if len(shape) == 1 and not isinstance(shape[0], (int, np.integer)) else shape
        return wrap_view(self._a.reshape(shape, order=order), self)

    def transpose(self, *axes):
        return wrap_view(self._a.transpose(*axes), self)

    def swapaxes(self, axis1, axis2):
        return wrap_view(self._a.swapaxes(axis1, axis2), self)

    def ravel(self, order="C"):
        return wrap_view(self._a.ravel(order), self)

    def squeeze(self, axis=None):
        return wrap_view(self._a.squeeze(axis), self)

    def diagonal(self, offset=0, axis1=0, axis2=1):
        return wrap_view(self._a.diagonal(offset, axis1, axis2), self)

    def flatten(self, order="C"):
        return wrap(self._a.flatten(order))

    def copy(self, order="C"):
        return wrap(self._a.copy(order))

    def __copy__(self):
        return self.copy()

    def __deepcopy__(self, memo):
        return self.copy()

    def astype(self, dtype, order="K", casting=None, subok=None, copy=True):
        dtype = check_dtype(dtype)
        if not copy and dtype == self.dtype:
            return self
        return wrap(self._a.astype(dtype, order=order, casting=casting or "unsafe"))

    def view(self, dtype=None):
        return wrap_view(self._a.view() if dtype is None else self._a.view(check_dtype(dtype)), self)

    # --- reductions and other methods ---------------------------------------
    def _reduce(self, func, out, **kwargs):
        result = func(self._a, out=out_array(out), **kwargs)
        return out if out is not None else wrap(result)

    def sum(self, axis=None, dtype=None, out=None, keepdims=False):
        return self._reduce(np.sum, out, axis=axis, dtype=dtype, keepdims=keepdims)

    def prod(self, axis=None, dtype=None, out=None, keepdims=False):
        return self._reduce(np.prod, out, axis=axis, dtype=dtype, keepdims=keepdims)

    def mean(self, axis=None, dtype=None, out=None, keepdims=False):
        return self._reduce(np.mean, out, axis=axis, dtype=dtype, keepdims=keepdims)

    def var(self, axis=None, dtype=None, out=None, ddof=0, keepdims=False):
        return self._reduce(np.var, out, axis=axis, dtype=dtype, ddof=ddof, keepdims=keepdims)

    def std(self, axis=None, dtype=None, out=None, ddof=0, keepdims=False):
        return self._reduce(np.std, out, axis=axis, dtype=dtype, ddof=ddof, keepdims=keepdims)

    def max(self, axis=None, out=None, keepdims=False):
        return self._reduce(np.max, out, axis=axis, keepdims=keepdims)

    def min(self, axis=None, out=None, keepdims=False):
        return self._reduce(np.min, out, axis=axis, keepdims=keepdims)

    def all(self, axis=None, out=None, keepdims=False):
        return self._reduce(np.all, out, axis=axis, keepdims=keepdims)

    def any(self, axis=None, out=None, keepdims=False):
        return self._reduce(np.any, out, axis=axis, keepdims=keepdims)

    def argmax(self, axis=None, out=None, dtype=None, keepdims=False):
        result = self._reduce(np.argmax, out, axis=axis, keepdims=keepdims)
        return result if dtype is None else result.astype(dtype, copy=False)

    def argmin(self, axis=None, out=None, dtype=None, keepdims=False):
        result = self._reduce(np.argmin, out, axis=axis, keepdims=keepdims)
        return result if dtype is None else result.astype(dtype, copy=False)

    def cumsum(self, axis=None, dtype=None, out=None):
        return self._reduce(np.cumsum, out, axis=axis, dtype=dtype)

    def clip(self, min=None, max=None, out=None):
        lo = None if min is None else operand(min)
        hi = None if max is None else operand(max)
        return self._reduce(lambda a, out: np.clip(a, lo, hi, out=out), out)

    def dot(self, b, out=None):
        return self._reduce(lambda a, out: np.dot(a, device_array(b, "b"), out=out), out)

    def sort(self, axis=-1, kind=None):
        self._a.sort(axis=axis, kind=kind)

    def argsort(self, axis=-1, kind=None):
        return wrap(self._a.argsort(axis=axis, kind=kind))

    def nonzero(self):
        if self.ndim == 0:
            raise ValueError("Calling nonzero on 0d arrays is not allowed. "
                             "Use cp.atleast_1d(scalar).nonzero() instead.")
        count_mask_syncs(1)
        return tuple(wrap(i) for i in self._a.nonzero())

    def take(self, indices, axis=None, out=None):
        index = indices._a if type(indices) is ndarray else from_host(indices, np.intp)._a
        return self._reduce(lambda a, out: np.take(a, index, axis=axis, out=out), out)

    def repeat(self, repeats, axis=None):
        if type(repeats) is ndarray:
            raise ValueError("`repeats` should not be a cupy.ndarray")
        return wrap(self._a.repeat(repeats, axis))

    def trace(self, offset=0, axis1=0, axis2=1, dtype=None, out=None):
        return self._reduce(lambda a, out: a.trace(offset, axis1, axis2, dtype, out), out)

    def conj(self):
        return wrap(self._a.conj())

    def round(self, decimals=0, out=None):
        return self._reduce(lambda a, out: a.round(decimals, out), out)

    # --- operators ----------------------------------------------------------
    __add__, __radd__, __iadd__ = _binary(np.add)
    __sub__, __rsub__, __isub__ = _binary(np.subtract)
    __mul__, __rmul__, __imul__ = _binary(np.multiply)
    __truediv__, __rtruediv__, __itruediv__ = _binary(np.true_divide)
    __floordiv__, __rfloordiv__, __ifloordiv__ = _binary(np.floor_divide)
    __mod__, __rmod__, __imod__ = _binary(np.remainder)
    __matmul__, __rmatmul__, __imatmul__ = _binary(np.matmul)

    def __matmul__(self, other):                # CuPy's batched path refuses bfloat16 (see _math.matmul)
        from ._math import bfloat16_result, check_matmul

        check_matmul(self, other)
        return bfloat16_result(wrap(np.matmul(self._a, operand(other))), self, other)
    __and__, __rand__, __iand__ = _binary(np.bitwise_and)
    __or__, __ror__, __ior__ = _binary(np.bitwise_or)
    __xor__, __rxor__, __ixor__ = _binary(np.bitwise_xor)
    __lshift__, __rlshift__, __ilshift__ = _binary(np.left_shift)
    __rshift__, __rrshift__, __irshift__ = _binary(np.right_shift)
    __pow__, __rpow__, __ipow__ = _binary(np.power)

    def __divmod__(self, other):
        return tuple(wrap(r) for r in np.divmod(self._a, operand(other)))

    def __rdivmod__(self, other):
        return tuple(wrap(r) for r in np.divmod(operand(other), self._a))

    __lt__ = _comparison(np.less)
    __le__ = _comparison(np.less_equal)
    __gt__ = _comparison(np.greater)
    __ge__ = _comparison(np.greater_equal)
    __eq__ = _comparison(np.equal, unrelated=False)
    __ne__ = _comparison(np.not_equal, unrelated=True)
    __hash__ = None

    def __neg__(self):
        return wrap(np.negative(self._a))

    def __pos__(self):
        return wrap(np.positive(self._a))

    def __abs__(self):
        return wrap(np.absolute(self._a))

    def __invert__(self):
        return wrap(np.invert(self._a))
