"""A strict NumPy-backed stand-in for CuPy, for CI machines without a GPU.

It is test code, never installed: put ``tests/fake_gpu`` first on PYTHONPATH
and ``import cupy`` / ``import cupyx`` resolve here, so mpicube's
``--device gpu`` path runs in ``make test``. "Device memory" is NumPy memory
hidden inside ``cupy.ndarray``; the point is to fail wherever real CuPy
would fail (or be slow) because code mixes host and device data:

- no implicit host conversion: ``numpy.asarray(a)``, ``numpy.exp(a)``,
  ``numpy_array + a``, ``numpy.concatenate([a])``, ``memoryview(a)`` raise;
  a NumPy array as an operand of a cupy function or operator raises;
- MPI cannot read an array (no buffer protocol) unless
  ``MPICUBE_CUDA_AWARE=1``, which switches on ``__cuda_array_interface__``
  (v3), so mpi4py passes the memory straight to MPI like a CUDA-aware MPI;
- only API that CuPy has (no ``vecdot``; no ``ElementwiseKernel`` /
  ``ReductionKernel`` / ``RawKernel`` / ``RawModule``: CUDA source cannot run),
  except that ``MPICUBE_FAKE_GPU_KERNELS=1`` (where g++ exists) adds
  ``RawModule``, which runs CUDA source through tests/cuda_emu.py's g++
  emulation of CUDA threads on the arrays' NumPy memory, and an
  ``ElementwiseKernel`` that only marks the kernel API as present (see
  _kernels.py); everything else stays as strict as without it;
- every host<->device copy and implicit sync is counted:
  ``cupy._stand_in.transfers()``, ``reset_transfers()``, and with
  ``MPICUBE_FAKE_GPU_REPORT=<path>`` a JSON file ``<path>.<pid>`` at exit;
  RawModule launches are counted by kernel name (``_stand_in.launches()``,
  ``"launches"`` in that file).

``cupy._mpicube_host_memory`` (absent from real CuPy) tells mpicube that
this "device" memory is host memory that any MPI may be handed.
"""

from numpy import (  # dtypes and constants are NumPy's, as in CuPy
    bool_, complex64, complex128, dtype, e, finfo, float16, float32, float64, iinfo, inf, int8, int16,
    int32, int64, int_, intp, isscalar, nan, newaxis, pi, uint8, uint16, uint32, uint64, uintp,
)

from . import _kernels, _stand_in
from ._core import ndarray
from . import cuda
from ._creation import *  # noqa: F401,F403
from ._manipulation import *  # noqa: F401,F403
from ._math import *  # noqa: F401,F403
from ._math import UFUNCS as _UFUNCS

globals().update(_UFUNCS)
if _kernels.enabled():
    RawModule, ElementwiseKernel = _kernels.RawModule, _kernels.ElementwiseKernel
max = amax
min = amin
round = around

_mpicube_host_memory = True
__version__ = "14.0.0+mpicube.stand.in"
