"""Every CUDA kernel compiled by NVIDIA's real compiler, for A100 (sm_80)
and H100/H200 (sm_90), in both storage formats, with CuPy's options; each
kernel's registers, spills and shared memory held against the blocks the
Python side launches it with (tests/nvrtc.py). A planted syntax error and a
planted 2,000-thread block must each fail the check.

The wheels (``pip install -e ".[cuda-check]"``) are optional: without them
these tests skip, except in CI (CI set), where .ci/run installs them and a
missing compiler fails.
"""

from __future__ import annotations

import os

import pytest

import nvrtc
from mpicube.device import cuda_kernels, cuda_source

library, cuobjdump = nvrtc.tools()
if library is None or cuobjdump is None:
    if os.environ.get("CI"):
        raise RuntimeError("CI needs NVIDIA's compiler for the kernel checks: pip install -e '.[cuda-check]'")
    pytest.skip("no NVRTC / cuobjdump wheel (pip install -e '.[cuda-check]')", allow_module_level=True)


@pytest.fixture(scope="module")
def compiled() -> dict:
    """{(arch, dtype): per-kernel resources}: 4 compiles, shared by the tests."""
    return {(arch, dtype): nvrtc.resources(nvrtc.compile_cubin(cuda_source.source(dtype), arch))
            for arch in nvrtc.ARCHITECTURES for dtype in ("float32", "float64")}


@pytest.mark.timeout(300)
def test_every_kernel_compiles_and_fits_its_launch(compiled):
    blocks = nvrtc.launch_blocks(cuda_kernels)
    assert len(blocks) >= 14, blocks
    for (arch, dtype), usage in compiled.items():
        assert nvrtc.problems(usage, blocks) == [], (arch, dtype)
        assert all(u["REG"] > 0 for u in usage.values()), (arch, dtype, usage)


def test_a_planted_syntax_error_fails():
    broken = cuda_source.source("float32") + "\nextern \"C\" __global__ void broken(float* x) { x[0] = ; }\n"
    with pytest.raises(nvrtc.CompileError, match="expected an expression"):
        nvrtc.compile_cubin(broken, "sm_90")


def test_a_planted_2000_thread_block_fails(compiled, monkeypatch):
    monkeypatch.setattr(cuda_kernels, "ELEMENTWISE_THREADS", 2000)
    found = nvrtc.problems(compiled[("sm_90", "float32")], nvrtc.launch_blocks(cuda_kernels))
    assert any("gelu_forward: launched with 2000 threads a block, more than 1024" in p for p in found), found
    assert any("registers x 2000 threads exceed" in p for p in found), found


def test_a_kernel_nobody_launches_is_named(compiled):
    blocks = nvrtc.launch_blocks(cuda_kernels)
    del blocks["adamw"]
    assert nvrtc.problems(compiled[("sm_80", "float64")], blocks) == ["adamw: compiled but never launched"]
