"""The CPU emulation of CUDA (tests/cuda_emu.py) and the CuPy stand-in's
RawModule built on it.

tests/test_cuda_kernels.py trusts the emulation to expose what goes wrong in
a kernel; here it must: a missing barrier gives a wrong result and a barrier
that not every thread reaches raises. The stand-in (tests/fake_gpu with
MPICUBE_FAKE_GPU_KERNELS=1), which tests/test_gpu_path.py uses to run
mpicube's kernels inside whole training steps, must run CUDA source on its
arrays' memory, refuse the arguments CuPy or the kernel's signature would
not take, and count its launches. Skipped without g++.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import cuda_emu

ROOT = Path(__file__).resolve().parents[1]

SOURCE = r"""
typedef double scalar_t;
// y = x reversed within each block, through shared memory
extern "C" __global__ void reverse_block(const scalar_t* x, scalar_t* y, long long n) {
    __shared__ scalar_t tile[1024];
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    tile[threadIdx.x] = x[i];
    __syncthreads();
    y[i] = tile[blockDim.x - 1 - threadIdx.x];
}
// the same without the barrier: threads read slots others have not written yet
extern "C" __global__ void reverse_block_racing(const scalar_t* x, scalar_t* y, long long n) {
    __shared__ scalar_t tile[1024];
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    tile[threadIdx.x] = x[i];
    y[i] = tile[blockDim.x - 1 - threadIdx.x];
}
// a barrier that half the block never reaches
extern "C" __global__ void split_barrier(scalar_t* y, long long n) {
    if (threadIdx.x < 16) __syncthreads();
    y[threadIdx.x] = (scalar_t)1;
}
"""


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """Where SOURCE is compiled, once for this file (cached by content)."""
    if cuda_emu.compiler() is None:
        pytest.skip("no g++ to compile the emulated kernels")
    return tmp_path_factory.mktemp("cuda_emu")


def test_emulation_catches_a_missing_barrier_and_a_deadlock(folder):
    """A missing barrier gives a wrong result within three launches (each
    schedules the threads in another order); a barrier some threads never
    reach raises, and the threads it stranded start afresh on the next launch."""
    module = cuda_emu.Module(SOURCE, None, folder)
    assert module.dtype == np.float64                     # read from the source's scalar_t
    blocks, threads = 3, 64
    n = np.int64(blocks * threads)

    def reversed_blocks(kernel, seed):
        x = np.random.default_rng(seed).standard_normal(blocks * threads)   # (n,)
        y = np.zeros_like(x)
        module.get_function(kernel)((blocks,), (threads,), (x, y, n))
        return np.array_equal(y, x.reshape(blocks, threads)[:, ::-1].reshape(-1))

    assert not all(reversed_blocks("reverse_block_racing", seed) for seed in range(3))
    with pytest.raises(RuntimeError, match="deadlock"):
        module.get_function("split_barrier")((1,), (32,), (np.zeros(32), n))
    assert all(reversed_blocks("reverse_block", seed) for seed in range(3))


STAND_IN_CHECK = r"""
import sys
import numpy as np, cupy
from mpicube.device import cuda_kernels as K

def refused(exc, func, *args):
    try:
        func(*args)
    except exc as e:
        return str(e)
    raise AssertionError(f"no {exc.__name__}")

assert K.available() and K.active(cupy.zeros((2, 3)))
assert K.describe().startswith("mpicube CUDA kernels")
refused(NotImplementedError, cupy.ElementwiseKernel, "T x", "T y", "y = x", "copy")
module = cupy.RawModule(code=sys.argv[1], options=("-std=c++17",))
reverse = module.get_function("reverse_block")
host = np.arange(64.0)
x, y, n = cupy.asarray(host), cupy.zeros(64), np.int64(64)
reverse((2,), (32,), (x, y, n))
assert np.array_equal(y.get(), host.reshape(2, 32)[:, ::-1].reshape(-1)), y
assert "numpy.ndarray" in refused(TypeError, reverse, (2,), (32,), (host, y, n))
assert "C-contiguous" in refused(TypeError, reverse, (2,), (32,), (x.reshape(8, 8).T, y, n))
assert "int64 scalar" in refused(TypeError, reverse, (2,), (32,), (x, y, 64))
assert "float64 array" in refused(TypeError, reverse, (2,), (32,), (x.astype(cupy.float32), y, n))
refused(RuntimeError, module.get_function, "no_such_kernel")
assert cupy._stand_in.launches() == {"reverse_block": 1}, cupy._stand_in.launches()
assert cupy._stand_in.transfers()["h2d"] == 1                # the asarray: a launch copies nothing
print("stand-in RawModule ok")
"""


def stand_in_env(folder, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MPICUBE_")}
    env.update(PYTHONPATH=f"{ROOT / 'tests' / 'fake_gpu'}:{ROOT}", MPICUBE_FAKE_GPU_KERNEL_CACHE=str(folder), **extra)
    return env


def test_stand_in_raw_module_runs_cuda_source_strictly(folder):
    env = stand_in_env(folder, MPICUBE_FAKE_GPU_KERNELS="1", MPICUBE_CUDA_KERNELS="1")
    done = subprocess.run([sys.executable, "-c", STAND_IN_CHECK, SOURCE], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "stand-in RawModule ok"


def test_stand_in_has_no_kernel_api_unless_asked(folder):
    code = "import cupy, mpicube.device.cuda_kernels as K; print(hasattr(cupy, 'RawModule'), K.available())"
    done = subprocess.run([sys.executable, "-c", code], env=stand_in_env(folder), capture_output=True, text=True,
                          timeout=60)
    assert done.stdout.strip() == "False False", done.stderr
