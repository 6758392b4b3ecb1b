"""``cupyx`` of the stand-in: pinned host buffers (plain NumPy arrays, as CuPy's
are) and unbuffered scatter operations onto device arrays."""

from __future__ import annotations

import numpy as np

from cupy import _stand_in
from cupy._convert import from_host as _from_host, operand as _operand, prepare_index as _prepare_index
from cupy._convert import written as _written
from cupy._core import ndarray as _ndarray


def empty_pinned(shape, dtype=float, order="C"):
    return np.empty(shape, dtype, order)


def zeros_pinned(shape, dtype=float, order="C"):
    return np.zeros(shape, dtype, order)


def empty_like_pinned(a, dtype=None, order="K", subok=None, shape=None):
    return np.empty_like(a, dtype, order, subok=False, shape=shape)


def zeros_like_pinned(a, dtype=None, order="K", subok=None, shape=None):
    return np.zeros_like(a, dtype, order, subok=False, shape=shape)


def _scatter(ufunc, a, slices, value):
    """``a[slices] op= value`` where repeated indices all count. As in CuPy,
    with an advanced index a host value is copied to the device; with basic
    slices the value must be a kernel operand (device array or scalar)."""
    if type(a) is not _ndarray:
        raise TypeError(f"Argument 'a' has incorrect type (expected cupy.ndarray, got {type(a).__name__})")
    index, advanced, masks = _prepare_index(slices)
    for _ in range(masks):
        _stand_in.count_d2h(8)
    _written(a)
    if not advanced:
        target = a._a[index]
        ufunc(target, _operand(value), out=target)
        return
    source = value._a if type(value) is _ndarray else _from_host(value, a.dtype)._a
    flat = []
    for s in index:  # ufunc.at wants boolean masks as the integer indices they select
        flat += np.nonzero(s) if isinstance(s, np.ndarray) and s.dtype == np.bool_ else [s]
    index = tuple(flat)
    ufunc.at(a._a, index, source)


def scatter_add(a, slices, value):
    _scatter(np.add, a, slices, value)


def scatter_max(a, slices, value):
    _scatter(np.maximum, a, slices, value)


def scatter_min(a, slices, value):
    _scatter(np.minimum, a, slices, value)

