"""``cupy.RawModule`` of the stand-in: CUDA source run through a g++ emulation.

Opt-in (``MPICUBE_FAKE_GPU_KERNELS=1``), because it needs g++ and is slow:
the source is compiled by tests/cuda_emu.py against an emulation of CUDA
threads, barriers and warp shuffles, and a launch runs it on the NumPy
memory behind the stand-in arrays. That lets mpicube's opt-in CUDA kernels
(mpicube.device.cuda_kernels) run at their real call sites inside whole training
steps in CI. Libraries are cached by content in
``MPICUBE_FAKE_GPU_KERNEL_CACHE`` (default: a folder in the temp dir).

The arguments are held to CuPy's rules and to the emulation's stricter
ones: device arrays (a NumPy array is refused, as CuPy refuses it), which
must be C-contiguous and of the pointer's dtype, and NumPy scalars of the
parameter's exact width (CuPy would pass a wrong width as garbage). Every
launch is counted by kernel name (``_stand_in.launches()``), so a test can
tell that the kernels ran instead of the array path.

``ElementwiseKernel`` is here only because mpicube.device.cuda_kernels.available()
takes it as the sign of a real kernel API; constructing one raises.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

from . import _stand_in
from ._convert import written
from ._core import ndarray

ENV = "MPICUBE_FAKE_GPU_KERNELS"
_EMU_FILE = Path(__file__).resolve().parents[2] / "cuda_emu.py"


def _emulation():
    """tests/cuda_emu.py, loaded by path (tests/ need not be on sys.path)."""
    name = "_mpicube_stand_in_cuda_emu"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, _EMU_FILE)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def enabled() -> bool:
    """Opted in and able to compile: then ``cupy`` offers RawModule."""
    return os.environ.get(ENV, "0") == "1" and _emulation().compiler() is not None


def _cache() -> Path:
    default = Path(tempfile.gettempdir()) / f"mpicube-cuda-emu-{os.getuid()}"
    return Path(os.environ.get("MPICUBE_FAKE_GPU_KERNEL_CACHE") or default)


def _device_memory(value, where: str):
    """A kernel argument as the emulation takes it: a device array becomes
    its NumPy memory; a host array is refused, as CuPy refuses it."""
    if type(value) is ndarray:
        return value._a
    if isinstance(value, np.ndarray):
        raise TypeError(f"{where}: a numpy.ndarray cannot be a kernel argument (copy it to the device first)")
    return value


class RawKernel:
    """One kernel of a RawModule: ``kernel(grid, block, args, shared_mem=0)``."""

    def __init__(self, emulated):
        self._kernel = emulated
        self.name = emulated.name

    def __call__(self, grid, block, args, *, shared_mem=0, enable_cooperative_groups=False):
        if shared_mem:
            raise NotImplementedError("stand-in: dynamic shared memory is not emulated")
        grid = (grid,) if isinstance(grid, int) else tuple(grid)
        block = (block,) if isinstance(block, int) else tuple(block)
        if len(grid) != 1 or len(block) != 1:
            raise NotImplementedError(f"stand-in: {self.name}: only 1-D grids and blocks are emulated")
        memory = tuple(_device_memory(a, f"{self.name} argument {i}") for i, a in enumerate(args))
        for a in args:                      # a kernel may write any array it is given
            if type(a) is ndarray:
                written(a)
        self._kernel(grid, block, memory)
        _stand_in.count_launch(self.name)


class RawModule:
    """CUDA source compiled (by g++, emulated) on construction; ``options``
    (NVRTC flags) are accepted and have no effect here."""

    def __init__(self, code=None, path=None, options=(), backend="nvrtc", **kwargs):
        if code is None:
            raise NotImplementedError("stand-in: RawModule runs CUDA source given as code= only")
        if not all(isinstance(o, str) for o in options):
            raise TypeError("options must be a tuple of strings")
        self._module = _emulation().Module(code, None, _cache())

    def get_function(self, name: str) -> RawKernel:
        if name not in self._module.signatures:
            raise RuntimeError(f"stand-in: no extern \"C\" kernel {name!r} in this module "
                               f"(CUDA_ERROR_NOT_FOUND)")
        return RawKernel(self._module.get_function(name))


class ElementwiseKernel:
    """A marker of CuPy's kernel API (see the module docstring); not runnable."""

    def __init__(self, *args, **kwargs):
        raise NotImplementedError("stand-in: only RawModule runs CUDA source (through tests/cuda_emu.py); "
                                  "ElementwiseKernel is not emulated")
