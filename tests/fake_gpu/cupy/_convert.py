"""How values enter and leave the stand-in's arrays: wrapping NumPy results,
the operands a kernel accepts, host copies (counted) and index preparation.

``ndarray`` is looked up in ``_core`` at call time: the array class uses
these helpers and these helpers make arrays of that class, so ``_core`` is
imported at the bottom, once everything it takes from here exists.
"""

from __future__ import annotations

import os

import numpy as np

from . import _stand_in

_HOST_SCALARS = (bool, int, float, complex, np.generic)
_INDEX_KINDS = "biu"


def check_dtype(dtype) -> np.dtype:
    """CuPy holds booleans and numbers only, and (CuPy 14, through
    ml_dtypes) bfloat16; ``MPICUBE_FAKE_GPU_NO_BFLOAT16=1`` plays an older
    CuPy without it."""
    dtype = np.dtype(dtype)
    if dtype.kind not in "biufc" and not (is_bfloat16(dtype) and not os.environ.get("MPICUBE_FAKE_GPU_NO_BFLOAT16")):
        raise ValueError(f"Unsupported dtype {dtype}")
    return dtype


def is_bfloat16(dtype) -> bool:
    return np.dtype(dtype).name == "bfloat16"


def owner(a: np.ndarray):
    """The object owning the memory of NumPy array ``a`` (NumPy keeps view
    bases pointing at the owner, never at an intermediate view)."""
    return a if a.base is None else a.base


def wrap(a) -> "ndarray":
    """A new device array owning the NumPy result ``a`` (0-d for scalars)."""
    if type(a) is not np.ndarray:
        a = np.asarray(a)
    out = object.__new__(_core.ndarray)
    out._a = a
    out._base = None
    out._mark = _stand_in.stamp()           # computed by queued work: pending until a synchronisation
    return out


def wrap_empty(a) -> "ndarray":
    """A new device array of memory nothing has written (``empty``)."""
    out = wrap(a)
    out._mark = -1
    return out


def written(x: "ndarray") -> None:
    """Queued work writes ``x`` (in place, ``out=``, item assignment): its
    memory, the owner's if ``x`` is a view, is pending until a synchronisation."""
    (x._base if x._base is not None else x)._mark = _stand_in.stamp()


def wrap_view(a, src: "ndarray") -> "ndarray":
    """``a``, computed from ``src``: a view whose ``base`` is the array that
    owns the memory when ``a`` shares it (CuPy's rule), else a new array."""
    if type(a) is np.ndarray and a.base is not None and owner(a) is owner(src._a):
        out = object.__new__(_core.ndarray)
        out._a = a
        out._base = src if src._base is None else src._base
        out._mark = -1                      # a view: its owner's mark counts
        return out
    if a is src._a:
        return wrap_view(a.view(), src)
    return wrap(a)


def operand(x):
    """The NumPy value of a kernel argument: device arrays and scalars only."""
    if type(x) is _core.ndarray:
        return x._a
    if isinstance(x, _HOST_SCALARS):
        return x
    raise TypeError(f"Unsupported type {type(x)}")


def device_array(x, what: str = "argument") -> np.ndarray:
    """The NumPy value of an argument that must be a device array."""
    if type(x) is _core.ndarray:
        return x._a
    raise TypeError(f"{what} must be a cupy.ndarray, not {type(x).__module__}.{type(x).__name__}")


def out_array(out):
    """The NumPy value of an ``out=`` argument (None, or a device array)."""
    if out is None:
        return None
    if isinstance(out, tuple) and len(out) == 1:
        out = out[0]
    if type(out) is _core.ndarray:
        written(out)
        return out._a
    raise TypeError("Output arguments must be cupy.ndarray")


def from_host(obj, dtype=None, **kwargs) -> "ndarray":
    """Copy host data (NumPy array, list, scalar) to a new device array."""
    a = np.array(obj, dtype=dtype, copy=True, **kwargs)
    check_dtype(a.dtype)
    _stand_in.count_h2d(a.nbytes)
    out = wrap(a)
    out._mark = -1                          # CuPy copies pageable host memory synchronously
    return out


def count_mask_syncs(n: int) -> None:
    """CuPy reads the number of True values of each boolean index back to
    the host to size the result: one small device-to-host copy each."""
    for _ in range(n):
        _stand_in.count_d2h(8)


def prepare_index(key):
    """(NumPy key, has advanced index, number of boolean masks). Host arrays,
    lists and bools become device index arrays (copied, as CuPy does); an
    Ellipsis is appended so that full integer indexing yields a 0-d view."""
    items = list(key) if isinstance(key, tuple) else [key]
    advanced, masks, has_ellipsis = False, 0, False
    for i, s in enumerate(items):
        if s is None or isinstance(s, slice):
            continue
        if s is Ellipsis:
            has_ellipsis = True
            continue
        if type(s) is _core.ndarray:
            arr = s._a
        elif isinstance(s, (list, tuple, np.ndarray, bool, np.bool_)):
            arr = np.array(s)
            if isinstance(s, (list, tuple)) and arr.size == 0:
                arr = arr.astype(np.int32)  # an empty list means no indices, not an empty mask
            if arr.dtype.kind in _INDEX_KINDS:
                _stand_in.count_h2d(arr.nbytes)
        else:
            continue  # an integer; NumPy checks anything stranger
        if arr.dtype.kind not in _INDEX_KINDS:
            raise IndexError(f"arrays used as indices must be of integer or boolean type (actual: {arr.dtype.type})")
        advanced = True
        masks += arr.dtype.kind == "b"
        items[i] = arr
    if not has_ellipsis:
        items.append(Ellipsis)
    return tuple(items), advanced, masks


from . import _core  # noqa: E402 - see the module docstring
