"""Shapes, joins, splits, sorting and searching of device arrays.

Views stay views (their ``base`` is the owning array). Functions whose
result size depends on the data (``nonzero``, ``argwhere``, ``unique``)
read a count back to the host in CuPy; each such sync is counted as a small
device-to-host copy.
"""

from __future__ import annotations

import numpy as np

from . import _stand_in
from ._convert import device_array, out_array, wrap, wrap_view
from ._core import ndarray


def _arrays(seq, what: str) -> list:
    """The NumPy values of a sequence that must hold device arrays only."""
    values = []
    for x in seq:
        if type(x) is not ndarray:
            raise TypeError(f"Only cupy arrays can be {what}")
        values.append(x._a)
    return values


def _join(func, tup, axis, out, dtype, casting):
    result = func(_arrays(tup, "concatenated"), axis=axis, out=out_array(out), dtype=dtype, casting=casting)
    return out if out is not None else wrap(result)


def concatenate(tup, axis=0, out=None, *, dtype=None, casting="same_kind"):
    return _join(np.concatenate, tup, axis, out, dtype, casting)


def stack(tup, axis=0, out=None, *, dtype=None, casting="same_kind"):
    return _join(np.stack, tup, axis, out, dtype, casting)


def hstack(tup, *, dtype=None, casting="same_kind"):
    return wrap(np.hstack(_arrays(tup, "concatenated"), dtype=dtype, casting=casting))


def vstack(tup, *, dtype=None, casting="same_kind"):
    return wrap(np.vstack(_arrays(tup, "concatenated"), dtype=dtype, casting=casting))


def _pieces(func, ary, indices_or_sections, axis):
    if type(indices_or_sections) is ndarray:
        raise TypeError("stand-in: split points on the device would need a sync; pass host integers")
    return [wrap_view(p, ary) for p in func(device_array(ary, "ary"), indices_or_sections, axis)]


def split(ary, indices_or_sections, axis=0):
    return _pieces(np.split, ary, indices_or_sections, axis)


def array_split(ary, indices_or_sections, axis=0):
    return _pieces(np.array_split, ary, indices_or_sections, axis)


def _view(func, a, *args):
    return wrap_view(func(device_array(a, "a"), *args), a)


def broadcast_to(array, shape):
    """A read-only view (NumPy's rule; CuPy would let you write through it)."""
    return _view(np.broadcast_to, array, shape)


def expand_dims(a, axis):
    return _view(np.expand_dims, a, axis)


def squeeze(a, axis=None):
    return _view(np.squeeze, a, axis)


def reshape(a, newshape, order="C"):
    return _view(np.reshape, a, newshape, order)


def transpose(a, axes=None):
    return _view(np.transpose, a, axes)


def swapaxes(a, axis1, axis2):
    return _view(np.swapaxes, a, axis1, axis2)


def moveaxis(a, source, destination):
    return _view(np.moveaxis, a, source, destination)


def ravel(a, order="C"):
    return _view(np.ravel, a, order)


def flip(a, axis=None):
    return _view(np.flip, a, axis)


def atleast_1d(*arys):
    res = [_view(np.atleast_1d, a) for a in arys]
    return res[0] if len(res) == 1 else res


def atleast_2d(*arys):
    res = [_view(np.atleast_2d, a) for a in arys]
    return res[0] if len(res) == 1 else res


def roll(a, shift, axis=None):
    return wrap(np.roll(device_array(a, "a"), shift, axis))


def tile(A, reps):
    return wrap(np.tile(device_array(A, "A"), reps))


def repeat(a, repeats, axis=None):
    device_array(a, "a")
    return a.repeat(repeats, axis)


def take(a, indices, axis=None, out=None):
    device_array(a, "a")
    return a.take(indices, axis, out)


def take_along_axis(a, indices, axis):
    return wrap(np.take_along_axis(device_array(a, "a"), device_array(indices, "indices"), axis))


def sort(a, axis=-1, kind=None):
    return wrap(np.sort(device_array(a, "a"), axis=axis, kind=kind))


def argsort(a, axis=-1, kind=None):
    return wrap(np.argsort(device_array(a, "a"), axis=axis, kind=kind))


def searchsorted(a, v, side="left", sorter=None):
    if isinstance(v, np.ndarray):              # a host array (CuPy takes device arrays and scalars)
        raise TypeError(f"Unsupported type {type(v)}")
    v = v._a if type(v) is ndarray else v
    sorter = None if sorter is None else device_array(sorter, "sorter")
    return wrap(np.searchsorted(device_array(a, "a"), v, side, sorter))


# --- results sized by the data: one sync each --------------------------------
def nonzero(a):
    device_array(a, "a")
    return a.nonzero()


def flatnonzero(a):
    _stand_in.count_d2h(8)
    return wrap(np.flatnonzero(device_array(a, "a")))


def argwhere(a):
    _stand_in.count_d2h(8)
    return wrap(np.argwhere(device_array(a, "a")))


def unique(ar, return_index=False, return_inverse=False, return_counts=False, axis=None, *, equal_nan=True):
    _stand_in.count_d2h(8)
    result = np.unique(device_array(ar, "ar"), return_index, return_inverse, return_counts, axis,
                       equal_nan=equal_nan)
    return tuple(wrap(r) for r in result) if isinstance(result, tuple) else wrap(result)


# --- metadata -----------------------------------------------------------------
def shape(a):
    return a.shape if type(a) is ndarray else np.shape(a)


def ndim(a):
    return a.ndim if type(a) is ndarray else np.ndim(a)


def size(a, axis=None):
    if type(a) is not ndarray:
        return np.size(a, axis)
    return a.size if axis is None else a.shape[axis]


def result_type(*arrays_and_dtypes):
    """Only dtypes are read: device arrays stand for their dtype."""
    return np.result_type(*[x.dtype if type(x) is ndarray else x for x in arrays_and_dtypes])


__all__ = ["concatenate", "stack", "hstack", "vstack", "split", "array_split", "broadcast_to", "expand_dims",
           "squeeze", "reshape", "transpose", "swapaxes", "moveaxis", "ravel", "flip", "atleast_1d",
           "atleast_2d", "roll", "tile", "repeat", "take", "take_along_axis", "sort", "argsort",
           "searchsorted", "nonzero", "flatnonzero", "argwhere", "unique", "shape", "ndim", "size",
           "result_type"]
