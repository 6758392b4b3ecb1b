"""``cupy.cuda.runtime`` of the stand-in: how many "GPUs" there are and which
one is current.

``MPICUBE_FAKE_GPU_COUNT`` (default 1) sets the device count. With 0, as on a
real node without GPUs, ``getDeviceCount`` raises ``CUDARuntimeError``
(cudaErrorNoDevice) rather than returning 0: that is what CuPy does.
"""

from __future__ import annotations

import os

from .. import _stand_in

_ERRORS = {
    100: ("cudaErrorNoDevice", "no CUDA-capable device is detected"),
    101: ("cudaErrorInvalidDevice", "invalid device ordinal"),
}

_current = 0


class CUDARuntimeError(RuntimeError):
    def __init__(self, status: int):
        self.status = status
        name, message = _ERRORS.get(status, ("cudaErrorUnknown", "unknown error"))
        super().__init__(f"{name}: {message}")

    def __reduce__(self):
        return type(self), (self.status,)


def _count() -> int:
    return int(os.environ.get("MPICUBE_FAKE_GPU_COUNT", "1"))


def getDeviceCount() -> int:
    count = _count()
    if count <= 0:
        raise CUDARuntimeError(100)
    return count


def getDevice() -> int:
    getDeviceCount()
    return _current


def setDevice(device: int) -> None:
    global _current
    if not 0 <= int(device) < getDeviceCount():
        raise CUDARuntimeError(101)
    _current = int(device)


def deviceSynchronize() -> None:
    getDeviceCount()
    _stand_in.count_sync()
