"""Which array module holds an array, and the no-op reduction.

Kept at the bottom of the device layer because every layer above asks the
same two questions: the local ops, the 16-bit GEMMs and the KV cache take
NumPy or CuPy arrays and must compute with the module that owns them (never
copying to the host to find out), and serial code passes ``identity`` where
a layout would pass an all-reduce.
"""

from __future__ import annotations

import numpy as np


def array_module(a):
    """The array module of ``a``: numpy for host arrays and scalars, else
    cupy's own answer (imported only when a device array is seen)."""
    if isinstance(a, (np.ndarray, np.generic)):
        return np
    import cupy

    return cupy.get_array_module(a)


def identity(x):
    """The reduction over a dimension nobody split: ``x`` itself."""
    return x
