"""The GPU array path's embedding backward and dropout masks on CI's CuPy
stand-in (tests/gpu_ops_check.py, one child process: ``import cupy`` must
not resolve to the stand-in inside pytest): equal to the CPU path, bit for
bit where the CPU is, and with scratch memory that grows neither with the
vocabulary (no one-hot GEMM) nor to a uint64 counter per mask element."""

import json
import os
import subprocess
import sys

import pytest

from mpirun import ROOT

FAKE_GPU = {"PYTHONPATH": f"{ROOT / 'tests' / 'fake_gpu'}:{ROOT}"}


@pytest.mark.timeout(120)
def test_embedding_backward_and_dropout_on_the_gpu_array_path():
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "gpu_ops_check.py")], capture_output=True, text=True,
                          timeout=100, env={**os.environ, **FAKE_GPU})
    assert done.returncode == 0, done.stdout + done.stderr
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert figures["embedding_rel_err_float64"] <= 1e-12
    scratch = figures["embedding_scratch_bytes"]
    assert scratch["1048576"] <= 2 * scratch["64"] + 65536, scratch
