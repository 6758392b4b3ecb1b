"""Which fused kernels run: the one switch over both kernel modules.

``fused`` (numba, CPU) and ``cuda_kernels`` (CuPy, GPU) offer the same
functions with the same output arguments; the ops and the optimizer ask
``kernels_for(arrays...)`` and run what it returns, or their plain array
code when it returns None. ``MPICUBE_KERNELS=numpy`` turns both off, so the
plain array path runs on either device (the path CI's CuPy stand-in takes).
"""

from __future__ import annotations

from . import cuda_kernels, fused


def kernels_for(*arrays):
    """``fused`` or ``cuda_kernels``, whichever applies to these arrays, or
    None for the plain array path."""
    for module in (fused, cuda_kernels):
        if module.active(*arrays):
            return module
    return None


def describe(device: str) -> str:
    """Which kernels run on ``device`` ("cpu" or "gpu"), for reports."""
    return fused.describe() if device == "cpu" else cuda_kernels.describe()
