"""Which BLAS kernels NumPy's GEMMs run, and whether the environment holds
them below what the CPU can run.

OpenBLAS picks its kernels for the CPU it finds, unless OPENBLAS_CORETYPE
names them: some machines set it (with OPENBLAS_L2_SIZE) for old NumPy
builds, and then a machine with AVX-512 runs Haswell's AVX2 kernels (on
the project's AVX-512 development machine that pin alone turned mpicube's
serial step from faster than PyTorch's into slower). A speed figure that
does not say which kernels ran cannot be compared with another, so
``bench`` and tools/compare_torch.py print ``describe()`` (threadpoolctl's
``architecture``: the kernels OpenBLAS really chose) and ``bench`` prints
``pin_warning()`` when the pin sits below the CPU.
"""

from __future__ import annotations

import os
from typing import Optional

CORETYPE_VAR = "OPENBLAS_CORETYPE"

# OpenBLAS's x86 core types, by the instruction set their kernels need (higher runs more per cycle).
LEVELS = {"prescott": 0, "core2": 1, "penryn": 1, "dunnington": 1, "atom": 1, "nehalem": 2, "sandybridge": 3,
          "haswell": 4, "zen": 4, "skylakex": 5, "cooperlake": 5, "sapphirerapids": 5}
FLAG_LEVELS = (("avx512f", 5, "SkylakeX"), ("avx2", 4, "Haswell"), ("avx", 3, "Sandybridge"),
               ("sse4_2", 2, "Nehalem"))


def blas_pools() -> list:
    """threadpoolctl's record of every BLAS NumPy loaded ([] without threadpoolctl)."""
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return []
    return [p for p in threadpool_info() if p.get("user_api") == "blas"]


def describe(pools: Optional[list] = None) -> str:
    """``openblas 0.3.31 (SkylakeX kernels, 2 threads)``, one per BLAS."""
    pools = blas_pools() if pools is None else pools
    if not pools:
        return "unknown (threadpoolctl did not find NumPy's BLAS)"
    said = []
    for p in pools:
        kernels = f"{p['architecture']} kernels, " if p.get("architecture") else ""
        said.append(f"{p.get('internal_api', '?')} {p.get('version') or ''}".rstrip()
                    + f" ({kernels}{p.get('num_threads', '?')} thread(s))")
    return "; ".join(said)


def cpu_flags(cpuinfo: str = None) -> set:
    """The instruction-set flags of this machine's first CPU (/proc/cpuinfo; empty elsewhere)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


def cpu_kernels(flags: set) -> tuple:
    """(level, the OpenBLAS core type) the CPU's flags can run; (None, None) when unknown."""
    for flag, level, name in FLAG_LEVELS:
        if flag in flags:
            return level, name
    return None, None


def pin_warning(environ=os.environ, flags: Optional[set] = None) -> Optional[str]:
    """A line when OPENBLAS_CORETYPE pins kernels below what the CPU runs, else None."""
    pinned = environ.get(CORETYPE_VAR, "").strip()
    if not pinned or pinned.lower() not in LEVELS:
        return None
    level, best = cpu_kernels(cpu_flags() if flags is None else flags)
    if level is None or LEVELS[pinned.lower()] >= level:
        return None
    return (f"warning: {CORETYPE_VAR}={pinned} holds OpenBLAS to {pinned}'s kernels on a CPU that runs {best}'s: "
            f"GEMMs, and the times below, are slower than this machine's (unset it for a benchmark)")
