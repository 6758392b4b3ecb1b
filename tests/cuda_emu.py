"""Run mpicube's CUDA kernels on the CPU: the same source, compiled by g++.

CI has no GPU, yet the kernels' index arithmetic, masks and block
reductions are exactly what can go wrong in them. This compiles
mpicube/cuda_source.py's text against a small emulation of the CUDA
built-ins and runs it on one OS thread, each CUDA thread a user-level
context (ucontext) with its own stack:

- the blocks of a launch run one after another, so ``__shared__`` can be a
  function-static array; within a block the first runnable thread in a
  priority order that changes between launches runs until it waits at a
  barrier, so favoured threads race ahead and a missing barrier gives a
  wrong result;
- ``__syncthreads`` is a barrier over the block, ``__shfl_xor_sync`` an
  exchange through per-thread slots between two barriers of the warp.

A kernel with a barrier that some threads of a block never reach (undefined
behaviour on a GPU) raises RuntimeError here instead of hanging. ``Module``
stands in for cupy.RawModule and checks every argument against the kernel's
C signature (pointer dtype, contiguity, scalar width), which CuPy would not:
it passes whatever bytes it is given.
"""

from __future__ import annotations

import ctypes
import hashlib
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np

SHIM = r"""
#include <math.h>
#include <ucontext.h>
#include <cstring>
#include <algorithm>
#include <functional>
#include <vector>

struct emu_dim3 { unsigned x, y, z; };
static emu_dim3 threadIdx, blockIdx, blockDim, gridDim;

// One CUDA thread: a user-level context with its own stack.
struct EmuBarrier;
struct EmuThread {
    ucontext_t context;
    std::vector<char> stack;
    bool done;
    const EmuBarrier* waiting;               // the barrier it waits at, or null
    unsigned waited;                         // that barrier's generation when it arrived
};

static ucontext_t emu_scheduler;
static EmuThread* emu_current;
static const std::function<void()>* emu_body;

static void emu_entry() {
    (*emu_body)();
    emu_current->done = true;
}                                             // returns to emu_scheduler (uc_link)

struct EmuBarrier {
    unsigned n, count, generation;
    void wait() {
        const unsigned arrived = generation;
        if (++count == n) {                   // the last to arrive opens it and runs on
            count = 0;
            ++generation;
            return;
        }
        emu_current->waiting = this;
        emu_current->waited = arrived;
        swapcontext(&emu_current->context, &emu_scheduler);
        emu_current->waiting = nullptr;
    }
};

static EmuBarrier emu_block_barrier;
static std::vector<EmuBarrier> emu_warp_barriers;
static unsigned long long emu_slots[1024];
static unsigned long long emu_launches;

#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static

inline void __syncthreads() { emu_block_barrier.wait(); }

template <typename V>
V __shfl_xor_sync(unsigned, V v, int lane_mask) {
    static_assert(sizeof(V) <= sizeof(unsigned long long), "8-byte slots");
    const unsigned t = threadIdx.x;
    std::memcpy(&emu_slots[t], &v, sizeof(V));
    emu_warp_barriers[t >> 5].wait();
    V other;
    std::memcpy(&other, &emu_slots[(t & ~31u) | ((t & 31u) ^ (unsigned)lane_mask)], sizeof(V));
    emu_warp_barriers[t >> 5].wait();
    return other;
}

// Runs the blocks one after another. Inside a block the scheduler always
// resumes the first runnable thread in a priority order (identity, reversed
// or shuffled, changing from launch to launch), which runs until it waits at
// a barrier or ends: favoured threads race as far ahead as the barriers let
// them, so a missing barrier shows up as a wrong result. Returns 1 if no
// thread can run while some have not ended (a barrier they cannot all reach).
static int emu_run(unsigned grid, unsigned block, const std::function<void()>& body) {
    gridDim = {grid, 1, 1};
    blockDim = {block, 1, 1};
    emu_body = &body;
    std::vector<unsigned> order(block);
    for (unsigned t = 0; t < block; ++t) order[t] = t;
    const unsigned long long launch = emu_launches++;
    if (launch % 3 == 1) std::reverse(order.begin(), order.end());
    if (launch % 3 == 2) {
        unsigned long long state = launch * 0x9E3779B97F4A7C15ull + 1;
        for (unsigned t = block - 1; t > 0; --t) {
            state = state * 6364136223846793005ull + 1442695040888963407ull;
            std::swap(order[t], order[(state >> 33) % (t + 1)]);
        }
    }
    std::vector<EmuThread> threads(block);
    for (auto& th : threads) th.stack.resize(1 << 17);
    for (unsigned b = 0; b < grid; ++b) {
        blockIdx = {b, 0, 0};
        emu_block_barrier = EmuBarrier{block, 0, 0};
        emu_warp_barriers.assign(block / 32, EmuBarrier{32, 0, 0});
        for (auto& th : threads) {
            getcontext(&th.context);
            th.context.uc_stack.ss_sp = th.stack.data();
            th.context.uc_stack.ss_size = th.stack.size();
            th.context.uc_link = &emu_scheduler;
            makecontext(&th.context, emu_entry, 0);
            th.done = false;
            th.waiting = nullptr;
        }
        for (;;) {
            EmuThread* next = nullptr;
            unsigned next_id = 0, unfinished = 0;
            for (unsigned t : order) {
                EmuThread& th = threads[t];
                if (th.done) continue;
                ++unfinished;
                if (!next && (!th.waiting || th.waiting->generation != th.waited)) {
                    next = &th;
                    next_id = t;
                }
            }
            if (unfinished == 0) break;
            if (!next) return 1;
            emu_current = next;
            threadIdx = {next_id, 0, 0};
            swapcontext(&emu_scheduler, &next->context);
        }
    }
    return 0;
}
"""

_KERNEL = re.compile(r'extern "C" __global__ void (\w+)\(([^)]*)\)')

# C parameter type -> (ctypes type, what the argument must be)
_SCALARS = {"long long": (ctypes.c_longlong, np.int64), "unsigned long long": (ctypes.c_ulonglong, np.uint64),
            "double": (ctypes.c_double, np.float64)}
_POINTEES = {"long long": np.int64, "unsigned long long": np.uint64}


def kernels(source: str) -> dict:
    """{kernel name: [(C type, parameter name), ...]} of every extern "C" kernel."""
    found = {}
    for name, params in _KERNEL.findall(source):
        found[name] = []
        for param in params.split(","):
            words = param.replace("*", " * ").split()
            found[name].append((" ".join(words[:-1]), words[-1]))
    return found


def _wrappers(signatures: dict) -> str:
    out = []
    for name, params in signatures.items():
        decl = ", ".join(f"{ctype} {pname}" for ctype, pname in params)
        call = ", ".join(pname for _, pname in params)
        out.append(f'extern "C" int emu_{name}(unsigned grid, unsigned block, {decl}) '
                   f"{{ return emu_run(grid, block, [&] {{ {name}({call}); }}); }}")
    return "\n".join(out)


def compiler() -> str | None:
    return shutil.which("g++")


def build(source: str, folder: Path) -> Path:
    """Compile ``source`` with the shim into a shared library (cached by content)."""
    text = SHIM + source + "\n" + _wrappers(kernels(source)) + "\n"
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    lib = folder / f"cuda_emu_{digest}.so"
    if not lib.exists():
        cpp = folder / f"cuda_emu_{digest}.cpp"
        cpp.write_text(text)
        subprocess.run([compiler(), "-std=c++17", "-O1", "-fPIC", "-shared", "-pthread", "-Wall", "-Werror",
                        "-Wno-unknown-pragmas", str(cpp), "-o", str(lib)], check=True, capture_output=True, text=True)
    return lib


class Kernel:
    """One emulated kernel, called like a cupy RawKernel: (grid, block, args)."""

    def __init__(self, lib, name: str, params: list, dtype: np.dtype):
        self.name, self.params, self.dtype = name, params, dtype
        self.fn = getattr(lib, f"emu_{name}")
        self.fn.restype = ctypes.c_int
        self.launches = 0

    def _convert(self, ctype: str, pname: str, value):
        where = f"{self.name}({pname})"
        base = ctype.replace("const ", "").strip()
        if base.endswith("*"):
            pointee = base[:-1].strip()
            want = self.dtype if pointee == "scalar_t" else np.dtype(_POINTEES[pointee])
            if not isinstance(value, np.ndarray) or value.dtype != want or not value.flags.c_contiguous:
                raise TypeError(f"{where}: wants a C-contiguous {want} array, got {type(value).__name__} "
                                f"{getattr(value, 'dtype', '')}")
            return ctypes.c_void_p(value.ctypes.data)
        if base == "scalar_t":
            kind, want = (ctypes.c_float if self.dtype == np.float32 else ctypes.c_double), self.dtype.type
        else:
            kind, want = _SCALARS[base]
        if type(value) is not want:
            raise TypeError(f"{where}: wants a {np.dtype(want)} scalar, got {type(value).__name__}")
        return kind(value)

    def __call__(self, grid: tuple, block: tuple, args: tuple, shared_mem: int = 0):
        (blocks,), (threads,) = grid, block
        if not (0 < threads <= 1024 and threads % 32 == 0 and blocks > 0):
            raise ValueError(f"{self.name}: launch of {blocks} blocks of {threads} threads")
        if len(args) != len(self.params):
            raise TypeError(f"{self.name}: {len(self.params)} parameters, {len(args)} arguments")
        converted = [self._convert(ctype, pname, a) for (ctype, pname), a in zip(self.params, args)]
        self.launches += 1
        if self.fn(ctypes.c_uint(blocks), ctypes.c_uint(threads), *converted):
            raise RuntimeError(f"{self.name}: deadlock, a barrier that not every thread of a block reaches")


class Module:
    """Stands in for cupy.RawModule(code=source(dtype))."""

    def __init__(self, source: str, dtype, folder: Path):
        self.dtype = np.dtype(dtype)
        self.signatures = kernels(source)
        self.lib = ctypes.CDLL(str(build(source, folder)))
        self.functions = {}

    def get_function(self, name: str) -> Kernel:
        if name not in self.functions:
            self.functions[name] = Kernel(self.lib, name, self.signatures[name], self.dtype)
        return self.functions[name]
