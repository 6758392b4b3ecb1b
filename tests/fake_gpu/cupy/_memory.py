"""``ndarray.flags`` and ``ndarray.data`` of the stand-in."""

from __future__ import annotations

import numpy as np


class Flags:
    """The subset of ``ndarray.flags`` CuPy offers."""

    def __init__(self, c_contiguous: bool, f_contiguous: bool, owndata: bool):
        self.c_contiguous, self.f_contiguous, self.owndata = c_contiguous, f_contiguous, owndata

    def __getitem__(self, name):
        return {"C_CONTIGUOUS": self.c_contiguous, "F_CONTIGUOUS": self.f_contiguous,
                "OWNDATA": self.owndata}[name]

    def __repr__(self):
        return f"  C_CONTIGUOUS : {self.c_contiguous}\n  F_CONTIGUOUS : {self.f_contiguous}\n  OWNDATA : {self.owndata}"


class MemoryPointer:
    """``ndarray.data``: an address inside a device allocation. It keeps the
    owning array alive, so ``cupy.ndarray(shape, dtype, memptr=p)`` can build
    views into it as CuPy code does with pooled buffers."""

    def __init__(self, array: "ndarray", ptr: int):
        self._owner, self.ptr = array, ptr
        self.device_id = 0

    def __add__(self, offset: int) -> "MemoryPointer":
        return MemoryPointer(self._owner, self.ptr + int(offset))

    def __int__(self):
        return self.ptr

    @property
    def device(self):
        from .cuda import Device

        return Device(self.device_id)

    def numpy_buffer(self) -> tuple:
        """(owning NumPy array, byte offset of ``ptr`` in it)."""
        a = self._owner._a
        buf = a if a.base is None else a.base
        if not isinstance(buf, np.ndarray):
            raise NotImplementedError("stand-in: memptr into memory NumPy does not own")
        return buf, self.ptr - buf.ctypes.data
