"""NVIDIA's real compiler for mpicube's CUDA kernels, without a GPU.

NVRTC (the ``nvidia-cuda-nvrtc`` wheel: a shared library, driven here
through ctypes) compiles ``cuda_source``'s text for a real architecture as
CuPy's RawModule would, and ``cuobjdump`` (the ``nvidia-cuda-cuobjdump``
wheel) reads each kernel's resources from the binary. Both run on a CPU,
so CI checks what a GPU would refuse at run time: a syntax error, a kernel
that spills to local memory, a block the launch configuration asks for
that the kernel's registers or the hardware do not allow.

Install with ``pip install -e ".[cuda-check]"`` (.ci/run does).
"""

from __future__ import annotations

import ctypes
import re
import subprocess
import tempfile
from pathlib import Path

# What CuPy's RawModule passes to NVRTC besides the architecture (CuPy 14's
# compiler.py: flush denormals to zero, and the C++ standard of CUDA 13).
CUPY_OPTIONS = ("-ftz=true", "--std=c++17")
ARCHITECTURES = ("sm_80", "sm_90")           # A100, H100/H200
MAX_BLOCK_THREADS = 1024                     # every architecture since sm_20
MAX_BLOCK_REGISTERS = 64 * 1024              # 32-bit registers a block may hold, sm_80 and sm_90
MAX_STATIC_SHARED = 48 * 1024                # bytes of __shared__ without opting in


class CompileError(Exception):
    """NVRTC refused the source; the message is its log."""


def _nvidia_file(pattern: str):
    """A file of the NVIDIA wheels (the ``nvidia`` namespace package), or None."""
    try:
        import nvidia
    except ImportError:
        return None
    for root in getattr(nvidia, "__path__", []):
        found = sorted(Path(root).glob(pattern))
        if found:
            return found[-1]
    return None


def tools() -> tuple:
    """(libnvrtc path, cuobjdump path); either None where its wheel is missing."""
    return _nvidia_file("cu*/lib/libnvrtc.so*"), _nvidia_file("cu*/bin/cuobjdump")


def compile_cubin(source: str, arch: str, options=CUPY_OPTIONS, name: str = "mpicube.cu") -> bytes:
    """The CUBIN NVRTC makes of ``source`` for ``arch`` (e.g. sm_90);
    CompileError with the log if it refuses, or if it warns."""
    library, _ = tools()
    nvrtc = ctypes.CDLL(str(library))
    program = ctypes.c_void_p()
    _ok(nvrtc, nvrtc.nvrtcCreateProgram(ctypes.byref(program), source.encode(), name.encode(), 0, None, None))
    try:
        flags = [f"--gpu-architecture={arch}".encode(), *(o.encode() for o in options)]
        status = nvrtc.nvrtcCompileProgram(program, len(flags), (ctypes.c_char_p * len(flags))(*flags))
        size = ctypes.c_size_t()
        _ok(nvrtc, nvrtc.nvrtcGetProgramLogSize(program, ctypes.byref(size)))
        log = ctypes.create_string_buffer(size.value)
        _ok(nvrtc, nvrtc.nvrtcGetProgramLog(program, log))
        text = log.value.decode(errors="replace").strip()
        if status != 0 or text:
            raise CompileError(f"NVRTC, {arch}: {text or _error(nvrtc, status)}")
        _ok(nvrtc, nvrtc.nvrtcGetCUBINSize(program, ctypes.byref(size)))
        cubin = ctypes.create_string_buffer(size.value)
        _ok(nvrtc, nvrtc.nvrtcGetCUBIN(program, cubin))
        return cubin.raw
    finally:
        nvrtc.nvrtcDestroyProgram(ctypes.byref(program))


def _error(nvrtc, status: int) -> str:
    nvrtc.nvrtcGetErrorString.restype = ctypes.c_char_p
    return nvrtc.nvrtcGetErrorString(status).decode()


def _ok(nvrtc, status: int) -> None:
    if status != 0:
        raise CompileError(f"NVRTC call failed: {_error(nvrtc, status)}")


def resources(cubin: bytes) -> dict:
    """{kernel: {"REG": n, "STACK": bytes, "SHARED": bytes, "LOCAL": bytes}}
    as cuobjdump reads them from the binary."""
    _, cuobjdump = tools()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernels.cubin"
        path.write_bytes(cubin)
        out = subprocess.run([str(cuobjdump), "--dump-resource-usage", str(path)], capture_output=True,
                             text=True, timeout=120, check=True).stdout
    found, name = {}, None
    for line in out.splitlines():
        m = re.match(r"\s*Function (\w+):", line)
        if m:
            name = m.group(1)
            continue
        if name is not None and "REG:" in line:
            found[name] = {k: int(v) for k, v in re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", line)}
            name = None
    return found


def problems(usage: dict, block_threads: dict) -> list:
    """What a GPU would refuse or slow down, one line each: a kernel that
    spills (local memory or a stack), a block larger than the hardware
    allows or than the kernel's registers allow, too much static shared
    memory, and a kernel compiled but never launched or launched but not
    compiled. ``block_threads``: {kernel: the largest block the Python side
    launches it with}."""
    out = []
    for name in sorted(set(usage) | set(block_threads)):
        if name not in usage:
            out.append(f"{name}: launched but not in the compiled source")
            continue
        if name not in block_threads:
            out.append(f"{name}: compiled but never launched")
            continue
        u, threads = usage[name], block_threads[name]
        if u["LOCAL"] or u["STACK"]:
            out.append(f"{name}: spills ({u['LOCAL']} bytes of local memory, stack {u['STACK']})")
        if threads > MAX_BLOCK_THREADS:
            out.append(f"{name}: launched with {threads} threads a block, more than {MAX_BLOCK_THREADS}")
        if u["REG"] * threads > MAX_BLOCK_REGISTERS:
            out.append(f"{name}: {u['REG']} registers x {threads} threads exceed the "
                       f"{MAX_BLOCK_REGISTERS} registers of a block")
        if u["SHARED"] > MAX_STATIC_SHARED:
            out.append(f"{name}: {u['SHARED']} bytes of static shared memory, more than {MAX_STATIC_SHARED}")
    return out


def launch_blocks(kernels_module) -> dict:
    """{kernel: the largest block ``kernels_module`` (mpicube.device.
    cuda_kernels) launches it with}, read from its call sites: a kernel
    launched by ``_rows`` gets ``row_threads`` of the widest row, one
    launched by ``_flat`` gets ``ELEMENTWISE_THREADS``."""
    import ast

    tree = ast.parse(Path(kernels_module.__file__).read_text())
    widest = kernels_module.row_threads(1 << 62)
    shape = {"_rows": widest, "_flat": kernels_module.ELEMENTWISE_THREADS}
    found = {}
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in shape
                and node.args and isinstance(node.args[0], ast.Constant)):
            found[node.args[0].value] = shape[node.func.id]
    return found
