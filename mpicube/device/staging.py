"""Pinned host memory for MPI libraries that cannot read device memory.

It belongs to the device layer (not to ``parallel.comm``, which uses it)
because the backend creates the pool when it picks a GPU: one pool per
process, handed to every communicator through ``Backend.staging``.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np


class Staging:
    """Pinned host buffers for MPI when it cannot read device memory.

    Page-locked memory lets the device copy at full link speed, and
    allocating it is expensive, so buffers are kept and reused: a step
    repeats the same collectives with the same shapes, so after the first
    step every ``take`` finds a free buffer. A buffer is taken for the
    duration of one collective (until ``wait`` for a nonblocking one) and
    given back after its contents have been copied to the device.
    """

    def __init__(self):
        self._free = defaultdict(list)     # (shape, dtype) -> idle pinned arrays

    def take(self, shape, dtype) -> np.ndarray:
        key = (tuple(shape), np.dtype(dtype).str)
        if self._free[key]:
            return self._free[key].pop()
        import cupyx

        return cupyx.empty_pinned(tuple(shape), dtype=dtype)

    def give(self, buf: np.ndarray) -> None:
        self._free[(buf.shape, buf.dtype.str)].append(buf)
