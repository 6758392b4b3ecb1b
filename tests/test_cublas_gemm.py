"""mpicube.device.cublas_gemm without a GPU: how it reads operands for
cuBLAS (which matrices it can pass with a transpose flag instead of a copy,
which batches are one strided run), and that on the CuPy stand-in every
product still comes out right by the widening path, bfloat16 batches
included, which CuPy's own batched matmul refuses."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mpicube.device.cublas_gemm import _OP_N, _OP_T, _matrices

ROOT = Path(__file__).resolve().parents[1]
FAKE_GPU = {"PYTHONPATH": f"{ROOT / 'tests' / 'fake_gpu'}:{ROOT}"}


@pytest.mark.parametrize("make, expected", [
    (lambda: np.zeros((6, 4), np.float16), (_OP_N, 4, 24, 1)),                    # row-major
    (lambda: np.zeros((4, 6), np.float16).T, (_OP_T, 6, 24, 1)),                  # x.T: column-major, no copy
    (lambda: np.zeros((3, 6, 4), np.float16), (_OP_N, 4, 24, 3)),                 # a batch
    (lambda: np.zeros((2, 3, 6, 4), np.float16), (_OP_N, 4, 24, 6)),              # (B, nh, T, hd): one run
    (lambda: np.zeros((2, 3, 4, 6), np.float16).swapaxes(-1, -2), (_OP_T, 6, 24, 6)),   # k^T of attention
    (lambda: np.zeros((2, 6, 3, 4), np.float16).transpose(0, 2, 1, 3), None),    # heads not one strided run
    (lambda: np.zeros((6, 8), np.float16)[:, :4], None),                          # rows with a gap: not taken
    (lambda: np.zeros((1, 6, 4), np.float16), (_OP_N, 4, 24, 1)),
])
def test_operands_as_cublas_reads_them(make, expected):
    assert _matrices(make()) == expected


def test_batched_16_bit_products_on_the_stand_in():
    """The stand-in refuses a batched bfloat16 matmul as CuPy does, and
    ``precision.matmul`` still gives the CPU path's numbers (16-bit and
    float32 results; row- and column-major operands)."""
    code = """
import numpy as np, ml_dtypes, cupy
from mpicube.device import precision
rng = np.random.default_rng(0)
for fmt in (np.float16, ml_dtypes.bfloat16):
    a = rng.normal(size=(2, 3, 8, 5)).astype(fmt)
    b = rng.normal(size=(2, 3, 6, 5)).astype(fmt).swapaxes(-1, -2)
    da, db = cupy.asarray(a), cupy.asarray(np.ascontiguousarray(b.swapaxes(-1, -2))).swapaxes(-1, -2)
    if fmt is ml_dtypes.bfloat16:
        try:
            da @ db
            raise SystemExit("the stand-in multiplied a bfloat16 batch")
        except TypeError as exc:
            assert "data type 'E' not understood" in str(exc), exc
    for dtype in (fmt, np.float32):
        want = precision.matmul(a, b, dtype=dtype)
        got = precision.matmul(da, db, dtype=dtype).get()
        assert got.dtype == want.dtype and np.array_equal(got.astype(np.float32), want.astype(np.float32)), (fmt, dtype)
print("ok")
"""
    env = {**os.environ, **FAKE_GPU}
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout + proc.stderr
