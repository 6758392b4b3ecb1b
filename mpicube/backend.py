"""The array namespace: NumPy on CPUs, CuPy on GPUs.

Every array operation in mpicube goes through ``Backend.xp`` so the same code
runs on both. Host (NumPy) copies are only made where data leaves the device:
MPI without CUDA awareness, checkpoints, logging.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

import numpy as np

from . import fused
from .errors import UserError

DTYPES = {"float32": np.float32, "float64": np.float64}


@dataclass
class Backend:
    xp: object          # the numpy or cupy module
    dtype: type         # np.float32 or np.float64
    device: str         # "cpu" or "gpu"

    @property
    def is_gpu(self) -> bool:
        return self.device == "gpu"

    def asarray(self, a, dtype=None):
        """Move a host array to the backend (no copy on CPU when possible)."""
        return self.xp.asarray(a, dtype=dtype)

    def to_host(self, a) -> np.ndarray:
        """A NumPy view or copy of a backend array."""
        if self.is_gpu:
            return self.xp.asnumpy(a)
        return np.asarray(a)

    def synchronize(self) -> None:
        """Wait for queued GPU work; MPI must not read a buffer still being written."""
        if self.is_gpu:
            self.xp.cuda.get_current_stream().synchronize()


def node_local(comm) -> tuple:
    """(rank, size) among the processes of ``comm`` sharing this node: the
    GPU to take, and how many ranks share the node's cores. Collective."""
    from mpi4py import MPI

    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    rank, size = local.Get_rank(), local.Get_size()
    local.Free()
    return rank, size


def keep_freed_memory() -> None:
    """Ask glibc to keep freed blocks of up to 32 MiB in the heap.

    By default it hands large freed blocks back to the OS (mmap'd chunks,
    heap trimming), so each step's temporaries - activations, gradients of
    the same sizes every step - are page-faulted in afresh every time; on
    the 768-wide model that costs about a fifth of the step. A no-op where
    the C library is not glibc.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, 32 << 20)
    libc.mallopt(m_trim_threshold, 1 << 30)


def make_backend(device: str = "cpu", dtype: str = "float32", comm=None) -> Backend:
    """Select NumPy or CuPy: on CPUs the fused kernels' threads (the node's
    cores shared among its ranks), on GPUs the device of this node-local rank."""
    if dtype not in DTYPES:
        raise UserError(f"unknown dtype {dtype!r}; choose one of {sorted(DTYPES)}")
    if device == "cpu":
        fused.check_choice()
        keep_freed_memory()
        fused.configure_threads(node_local(comm)[1] if comm is not None else 1)
        return Backend(np, DTYPES[dtype], "cpu")
    if device != "gpu":
        raise UserError(f"unknown device {device!r}; choose cpu or gpu")
    try:
        import cupy
    except ImportError as exc:  # pragma: no cover - depends on the machine
        raise UserError("--device gpu needs CuPy: pip install 'mpicube[gpu]'") from exc
    n_gpus = cupy.cuda.runtime.getDeviceCount()
    if n_gpus == 0:  # pragma: no cover
        raise UserError("--device gpu: no CUDA device visible on this node")
    local = node_local(comm)[0] if comm is not None else 0
    cupy.cuda.Device(local % n_gpus).use()
    return Backend(cupy, DTYPES[dtype], "gpu")


def cuda_aware_mpi() -> bool:
    """Whether MPI may be handed device pointers (set MPICUBE_CUDA_AWARE=1)."""
    return os.environ.get("MPICUBE_CUDA_AWARE", "0") == "1"
