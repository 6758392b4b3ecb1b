"""One command gives the same bits at any thread count and under any load
(issues 42 and 49): real training runs, OpenBLAS's Haswell kernels forced
(they are the ones whose own threaded GEMM is not thread-invariant; every
AVX2-only CPU gets them), compared bit for bit: every logged loss and
gradient norm, and every tensor of the final checkpoint.

The runs: one thread (OMP_NUM_THREADS=1); the machine's threads with the
count changed at every GEMM (MPICUBE_ADAPT_THREADS=cycle); the machine's
threads with one core kept busy by another process (the load watch at
work); and two ranks of a 1-D layout, one thread each against two each
cycling. Plus float64 traces at one thread and two."""

import json
import os
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
from mpirun import MPIEXEC, ROOT, job_env

pytestmark = pytest.mark.timeout(600)

MODEL = ["--n-layer", "2", "--n-head", "12", "--n-embd", "144", "--seq-len", "64", "--batch-size", "8",
         "--lr", "3e-3", "--warmup", "2", "--eval-every", "3", "--seed", "7"]
HASWELL = {"OPENBLAS_CORETYPE": "Haswell"}


def needs_two_cores():
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two cores for a two-thread run")


def run(out: Path, argv: list, env: dict, ranks: int = 1) -> Path:
    """``mpicube ARGV --out OUT`` on ``ranks`` ranks with ``env`` over the
    test's environment (OMP_NUM_THREADS and MPICUBE_* of the caller removed)."""
    full = job_env(dict(HASWELL, **env), timeout=240)
    for name in ("OMP_NUM_THREADS", "MPICUBE_ADAPT_THREADS", "MPICUBE_NODE_CORES"):
        if name not in env:
            full.pop(name, None)
    cmd = [str(MPIEXEC), "-n", str(ranks), sys.executable, "-m", "mpicube"] + argv + ["--out", str(out)]
    p = subprocess.run(cmd, env=full, cwd=str(ROOT), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    return out


def metrics(run_dir: Path) -> list:
    """Every line of metrics.jsonl less its clocks (step times differ, numbers must not)."""
    rows = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        rows.append({k: v for k, v in row.items() if "time" not in k and "_s" not in k and "tok" not in k})
    assert rows and any("loss" in r for r in rows), rows
    return rows


def datasets(group, prefix="") -> dict:
    """Every dataset under ``group`` by path, links followed (a checkpoint's
    tensors are external links into its index files)."""
    found = {}
    for name in group.keys():
        item = group[name]
        if isinstance(item, h5py.Dataset):
            found[prefix + name] = item[()]
        else:
            found.update(datasets(item, prefix + name + "/"))
    return found


def checkpoint(run_dir: Path) -> dict:
    """Every dataset of the latest checkpoint, by path."""
    latest = sorted((run_dir / "ckpt").glob("step_*"))[-1]
    with h5py.File(latest / "checkpoint.h5", "r") as f:
        tensors = datasets(f)
    assert any(name.startswith("model/") for name in tensors), sorted(tensors)
    return tensors


def assert_same_run(a: Path, b: Path):
    assert metrics(a) == metrics(b)
    ta, tb = checkpoint(a), checkpoint(b)
    assert sorted(ta) == sorted(tb)
    for name in ta:
        assert np.array_equal(ta[name], tb[name]), name


def threads_of(run_dir: Path) -> dict:
    return json.loads((run_dir / "config.json").read_text())["threads"]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_a_run_is_bitwise_the_same_at_any_thread_count(tmp_path, dtype):
    needs_two_cores()
    argv = ["train", "--steps", "6", "--dtype", dtype] + MODEL
    one = run(tmp_path / "one", argv, {"OMP_NUM_THREADS": "1"})
    cycling = run(tmp_path / "cycle", argv, {"MPICUBE_ADAPT_THREADS": "cycle"})
    assert_same_run(one, cycling)
    assert threads_of(one)["threads"] == 1
    assert threads_of(cycling)["threads"] == 2 and threads_of(cycling)["adapt"] == "cycle"
    assert threads_of(cycling)["pools"]["gemm panels"] == 2
    if dtype == "float32":                    # the load watch itself, one core taken by a spinning process
        spin = subprocess.Popen([sys.executable, "-c", "import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})\n"
                                 "while True: pass"])
        try:
            busy = run(tmp_path / "busy", argv, {})
        finally:
            spin.kill()
            spin.wait()
        assert_same_run(one, busy)
        assert threads_of(busy)["adapt"] == "load"


def test_a_layout_is_bitwise_the_same_at_any_thread_count(tmp_path):
    """Two ranks of 1-D: one thread each, and two each (a pretended 4-core
    node) with the count cycling."""
    argv = ["train", "--steps", "4", "--dtype", "float32", "--layout", "1d"] + MODEL
    one = run(tmp_path / "one", argv, {"OMP_NUM_THREADS": "1"}, ranks=2)
    cycling = run(tmp_path / "cycle", argv, {"MPICUBE_NODE_CORES": "4", "MPICUBE_ADAPT_THREADS": "cycle"}, ranks=2)
    assert_same_run(one, cycling)
    assert threads_of(cycling)["adapt"] == "cycle" and threads_of(cycling)["threads"] == 2


def test_a_float64_trace_is_bitwise_the_same_at_one_thread_and_two(tmp_path):
    """Issue 42: `trace --dtype float64` first differed at step_1/grad_norm
    (OpenBLAS's threaded dot product), then everywhere after it."""
    needs_two_cores()
    traces = []
    for name, env in [("one", {"OMP_NUM_THREADS": "1"}), ("two", {"MPICUBE_ADAPT_THREADS": "cycle"})]:
        out = tmp_path / f"{name}.h5"
        full = job_env(dict(HASWELL, **env), timeout=240)
        if "OMP_NUM_THREADS" not in env:
            full.pop("OMP_NUM_THREADS", None)
        p = subprocess.run([sys.executable, "-m", "mpicube", "trace", "--dtype", "float64", "--steps", "3",
                            "--out", str(out)] + MODEL[:8], env=full, cwd=str(ROOT), capture_output=True,
                           text=True, timeout=300)
        assert p.returncode == 0, p.stdout + p.stderr
        with h5py.File(out, "r") as f:
            traces.append(datasets(f))
    assert "step_1/grad_norm" in traces[0] and len(traces[0]) > 50
    assert sorted(traces[0]) == sorted(traces[1])
    for name in traces[0]:
        assert np.array_equal(traces[0][name], traces[1][name]), name
