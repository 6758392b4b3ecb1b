"""The array namespace: NumPy on CPUs, CuPy on GPUs.

Every array operation in mpicube goes through ``Backend.xp`` so the same code
runs on both. Host (NumPy) copies are only made where data leaves the device:
MPI without CUDA awareness, checkpoints, logging.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass, field

import numpy as np

from . import cuda_kernels, fused, precision
from ..core.errors import UserError
from .staging import Staging


@dataclass
class Backend:
    xp: object          # the numpy or cupy module
    dtype: np.dtype     # activations and the weights' working copy: float64, float32, float16 or bfloat16
    device: str         # "cpu" or "gpu"
    tf32: bool = False  # float32 GEMMs on tensor cores (GPU only)
    staging: object = field(default=None, repr=False)   # staging.Staging: pinned host buffers for MPI

    def __post_init__(self):
        self.dtype = np.dtype(self.dtype)

    @property
    def is_gpu(self) -> bool:
        return self.device == "gpu"

    @property
    def mixed(self) -> bool:
        """16-bit storage over float32 master weights (mixed precision)."""
        return precision.is_half(self.dtype)

    @property
    def master_dtype(self) -> np.dtype:
        """Master weights, gradients and Adam moments: float32 under 16-bit
        storage, else the storage format itself."""
        return precision.compute_dtype(self.dtype)

    @property
    def compute_dtype(self) -> np.dtype:
        """What ops compute in, statistics and reductions included."""
        return precision.compute_dtype(self.dtype)

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


def make_backend(device: str = "cpu", dtype: str = "float32", comm=None, tf32: bool = False) -> Backend:
    """Select NumPy or CuPy: on CPUs the fused kernels' threads (the node's
    cores shared among its ranks), on GPUs the device of this node-local rank."""

    if device not in ("cpu", "gpu"):
        raise UserError(f"unknown device {device!r}; choose cpu or gpu")
    if tf32 and device != "gpu":
        raise UserError("--tf32 applies to GPUs only (tensor cores); drop it or add --device gpu")
    if tf32 and dtype != "float32":
        raise UserError(f"--tf32 applies to float32 GEMMs, not --dtype {dtype}")
    if device == "cpu":
        storage = precision.dtype_of(dtype)
        fused.check_choice()
        keep_freed_memory()
        fused.configure_threads(comm)
        return Backend(np, storage, "cpu")
    cupy = import_cupy()
    cuda_kernels.check_choice()
    local = node_local(comm)[0] if comm is not None else 0
    cupy.cuda.Device(local % visible_gpus(cupy)).use()
    if cuda_aware_mpi():
        check_cuda_aware(cupy)
    set_tf32(cupy, tf32)
    return Backend(cupy, device_dtype(cupy, dtype), "gpu", tf32=tf32, staging=Staging())


def device_dtype(cupy, name: str) -> np.dtype:
    """The storage format ``name`` on this CuPy: bfloat16 only where CuPy can
    hold it and mpicube can multiply it, 2-D and batched (CuPy's own batched
    matmul cannot, so ``precision.matmul`` goes round it: the probe checks
    that path), otherwise one error that says to use float16."""
    if name != "bfloat16":
        return precision.dtype_of(name)
    try:
        bf16 = precision.bfloat16()
        a = cupy.ones((2, 2), dtype=bf16)
        (a @ a).sum()
        batch = cupy.ones((2, 2, 2), dtype=bf16)          # attention's batched products, as mpicube runs them
        precision.matmul(batch, batch).sum()
        precision.matmul(batch, batch, dtype=np.float32).sum()
    except UserError:
        raise
    except Exception as exc:       # CuPy's refusal varies by version: TypeError, ValueError, NotImplementedError
        raise UserError(f"--dtype bfloat16: this CuPy ({getattr(cupy, '__version__', '?')}) has no bfloat16 "
                        f"arrays ({type(exc).__name__}); use --dtype float16 on GPUs") from None
    return bf16


def import_cupy():
    """The cupy module, or one clear error saying how to get it."""
    try:
        import cupy
    except ModuleNotFoundError as exc:
        if exc.name != "cupy":
            raise UserError(f"--device gpu: CuPy is installed but does not import ({exc})") from None
        raise UserError("--device gpu needs CuPy: pip install 'mpicube[gpu]' "
                        "(or the cupy-cudaXXx wheel matching your CUDA)") from None
    except ImportError as exc:
        raise UserError(f"--device gpu: CuPy is installed but does not import ({exc})") from None
    return cupy


def visible_gpus(cupy) -> int:
    """How many CUDA devices this process sees; UserError if none."""
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except cupy.cuda.runtime.CUDARuntimeError as exc:
        raise UserError(f"--device gpu: no usable CUDA device on this node ({exc})") from None
    if n == 0:
        raise UserError("--device gpu: no CUDA device visible on this node (check CUDA_VISIBLE_DEVICES)")
    return n


def set_tf32(cupy, enabled: bool) -> None:
    """Let cuBLAS run float32 GEMMs on tensor cores (TF32 inputs, float32
    accumulation), or forbid it. CuPy reads CUPY_TF32 when it first picks a
    GEMM compute type; setting the compute type as well covers a CuPy that
    has already picked one."""
    os.environ["CUPY_TF32"] = "1" if enabled else "0"
    precision.use_tf32(enabled)             # batched float32 GEMMs: CuPy's setting does not reach them
    try:
        from cupy._core import _routines_linalg as linalg

        kind = linalg.COMPUTE_TYPE_TF32 if enabled else linalg.COMPUTE_TYPE_DEFAULT
        linalg.set_compute_type(np.float32, kind)
    except (ImportError, AttributeError):   # another CuPy layout, or the CI stand-in
        pass


def cuda_aware_mpi() -> bool:
    """Whether MPI may be handed device pointers (set MPICUBE_CUDA_AWARE=1)."""
    return os.environ.get("MPICUBE_CUDA_AWARE", "0") == "1"


def mpi_cuda_support():
    """What the MPI library says about reading CUDA device memory: True,
    False, or None where it has no way to say. Open MPI answers through
    MPIX_Query_cuda_support, MPICH through MPIX_GPU_query_support."""
    from mpi4py import MPI  # noqa: F401  (loads the MPI library into the process)

    for lib in _loaded_mpi_libraries():
        if hasattr(lib, "MPIX_Query_cuda_support"):
            return bool(lib.MPIX_Query_cuda_support())
        if hasattr(lib, "MPIX_GPU_query_support"):
            supported = ctypes.c_int(0)
            if lib.MPIX_GPU_query_support(0, ctypes.byref(supported)) == 0:   # 0 = MPIX_GPU_SUPPORT_CUDA
                return bool(supported.value)
    return None


def _loaded_mpi_libraries() -> list:
    """ctypes handles of the libmpi* shared objects mpi4py has loaded (they
    are loaded privately, so the process's global symbols do not show them)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/libmpi" in line}
    except OSError:  # pragma: no cover - not Linux
        return []
    libs = []
    for path in sorted(paths):
        try:
            libs.append(ctypes.CDLL(path))
        except OSError:  # pragma: no cover
            continue
    return libs


def check_cuda_aware(xp) -> None:
    """MPICUBE_CUDA_AWARE=1 with an MPI that says it cannot read device
    memory would crash inside the first collective: refuse it up front.
    (CI's CuPy stand-in keeps its arrays in host memory, which any MPI reads.)"""
    if getattr(xp, "_mpicube_host_memory", False):
        return
    if mpi_cuda_support() is False:
        from mpi4py import MPI

        library = MPI.Get_library_version().splitlines()[0].strip()
        raise UserError(f"MPICUBE_CUDA_AWARE=1, but this MPI ({library}) is not CUDA-aware: "
                        "unset it to stage through host memory, or use a CUDA-aware MPI build")
