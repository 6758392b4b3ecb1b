"""Run mpicube's CUDA kernels on the CPU: the same source, compiled by g++.

CI has no GPU, yet the kernels' index arithmetic, masks and block
reductions are exactly what can go wrong in them. This compiles
mpicube/device/cuda_source.py's text against a small emulation of the CUDA
built-ins and runs it on one OS thread, each CUDA thread a fiber with its
own stack (started with ucontext, switched with _setjmp/_longjmp):

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
import fcntl
import hashlib
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np

SHIM = r"""
#undef _FORTIFY_SOURCE                        // its longjmp check refuses jumps between stacks
#include <math.h>
#include <setjmp.h>
#include <ucontext.h>
#include <cstring>
#include <algorithm>
#include <functional>
#include <memory>
#include <vector>

struct emu_dim3 { unsigned x, y, z; };
static emu_dim3 threadIdx, blockIdx, blockDim, gridDim;

// One CUDA thread: a fiber with its own stack that runs thread bodies one
// after another, block after block. ucontext only starts it on its stack;
// switches go through _setjmp/_longjmp, which do not save the signal mask
// (swapcontext makes a system call for it on every switch, and a block
// reduction switches about a dozen times per thread).
struct EmuBarrier;
struct EmuThread {
    ucontext_t start;
    jmp_buf resume;                          // where the fiber continues
    std::vector<char> stack;
    bool started;                            // running its loop (else: start it afresh)
    bool done;                               // finished this block's body, idle
    const EmuBarrier* waiting;               // the barrier it waits at, or null
    unsigned waited;                         // that barrier's generation when it arrived
};

static jmp_buf emu_scheduler;
static EmuThread* emu_current;
static const std::function<void()>* emu_body;

static void emu_suspend() {
    EmuThread* self = emu_current;
    if (!_setjmp(self->resume)) _longjmp(emu_scheduler, 1);
}

static void emu_entry() {
    for (;;) {                                // one thread body per turn
        (*emu_body)();
        emu_current->done = true;
        emu_suspend();
    }
}

// Run `th` until it waits at a barrier or ends its body.
static void emu_switch_to(EmuThread& th) {
    emu_current = &th;
    if (_setjmp(emu_scheduler)) return;
    if (th.started) _longjmp(th.resume, 1);
    th.started = true;
    getcontext(&th.start);
    th.start.uc_stack.ss_sp = th.stack.data();
    th.start.uc_stack.ss_size = th.stack.size();
    th.start.uc_link = nullptr;
    makecontext(&th.start, emu_entry, 0);
    setcontext(&th.start);
}

struct EmuBarrier {
    unsigned n, count, generation;
    void wait() {
        const unsigned arrived = generation;
        if (++count == n) {                   // the last to arrive opens it and runs on
            count = 0;
            ++generation;
            return;
        }
        EmuThread* self = emu_current;
        self->waiting = this;
        self->waited = arrived;
        emu_suspend();
        self->waiting = nullptr;
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
    static std::vector<std::unique_ptr<EmuThread>> pool;   // fibers and stacks live across launches
    while (pool.size() < block) {
        pool.emplace_back(new EmuThread{});
        pool.back()->stack.resize(1 << 17);
    }
    for (unsigned b = 0; b < grid; ++b) {
        blockIdx = {b, 0, 0};
        emu_block_barrier = EmuBarrier{block, 0, 0};
        emu_warp_barriers.assign(block / 32, EmuBarrier{32, 0, 0});
        for (unsigned t = 0; t < block; ++t) {
            EmuThread& th = *pool[t];
            if (!th.done) th.started = false;     // left inside a body by a deadlock: start afresh
            th.done = false;
            th.waiting = nullptr;
        }
        for (;;) {
            EmuThread* next = nullptr;
            unsigned next_id = 0, unfinished = 0;
            for (unsigned t : order) {
                EmuThread& th = *pool[t];
                if (th.done) continue;
                ++unfinished;
                if (!next && (!th.waiting || th.waiting->generation != th.waited)) {
                    next = &th;
                    next_id = t;
                }
            }
            if (unfinished == 0) break;
            if (!next) return 1;
            threadIdx = {next_id, 0, 0};
            emu_switch_to(*next);
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
    """Compile ``source`` with the shim into a shared library (cached by
    content). Several processes may ask at once (the ranks of one MPI job):
    a lock file lets one compile while the others wait, and the library
    appears under its final name only when complete."""
    text = SHIM + source + "\n" + _wrappers(kernels(source)) + "\n"
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    lib = folder / f"cuda_emu_{digest}.so"
    if lib.exists():
        return lib
    with open(folder / f"cuda_emu_{digest}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not lib.exists():
            cpp = folder / f"cuda_emu_{digest}.{os.getpid()}.cpp"
            partial = folder / f"cuda_emu_{digest}.{os.getpid()}.so"
            cpp.write_text(text)
            done = subprocess.run([compiler(), "-std=c++17", "-O1", "-fPIC", "-shared", "-pthread", "-Wall",
                                   "-Werror", "-Wno-unknown-pragmas", str(cpp), "-o", str(partial)],
                                  capture_output=True, text=True)
            cpp.unlink()
            if done.returncode != 0:
                raise RuntimeError(f"g++ could not compile the emulated kernels:\n{done.stderr}")
            os.replace(partial, lib)
    return lib


def scalar_dtype(source: str) -> np.dtype:
    """The storage type ``scalar_t`` that mpicube.device.cuda_source typed ``source`` with."""
    found = re.search(r"typedef (float|double) scalar_t;", source)
    if not found:
        raise ValueError("no `typedef float|double scalar_t;` in the kernel source")
    return np.dtype(np.float32 if found.group(1) == "float" else np.float64)


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
    """Stands in for cupy.RawModule(code=source(dtype)); ``dtype`` None
    reads it from the source's ``scalar_t``."""

    def __init__(self, source: str, dtype, folder: Path):
        self.dtype = scalar_dtype(source) if dtype is None else np.dtype(dtype)
        self.signatures = kernels(source)
        self.lib = ctypes.CDLL(str(build(source, folder)))
        self.functions = {}

    def get_function(self, name: str) -> Kernel:
        if name not in self.functions:
            self.functions[name] = Kernel(self.lib, name, self.signatures[name], self.dtype)
        return self.functions[name]
