"""tools/gpu_check.py, the device check a session lent a GPU runs first.

- its verdict logic: first losses of mpicube and PyTorch judged per shape
  and dtype, PyTorch's timings merged into mpicube's records with the
  over-PyTorch ratios, skipped steps apart from failed ones;
- a dry run of three of its steps on CI's CuPy stand-in within a budget:
  each step's result is in summary.json as soon as it ends, the timing
  script's own JSON lies beside it, and the log says what ran.
(The whole dry run, ``--dry-run`` with every step, takes about 100 s on
a loaded 2-core machine; CI runs this part of it.)
"""

import json
import subprocess
import sys

import pytest

from mpirun import ROOT

sys.path.insert(0, str(ROOT / "tools"))
import gpu_check  # noqa: E402


def test_first_losses_are_part_of_the_verdict():
    perf = {"gpt2-small": {"mpicube_first_loss": 10.98, "torch_first_loss": 10.98 * (1 + 5e-5)},
            "other": {"mpicube_first_loss": 10.0, "torch_first_loss": 10.1}}
    got = gpu_check.first_losses(perf, lambda k: "float32")
    assert got["gpt2-small"]["agree"] and not got["other"]["agree"]
    mixed = {"1.3b": {"float16": {"mpicube_first_loss": 11.0, "torch_first_loss": 11.1},
                      "bfloat16": {"mpicube_first_loss": 11.0, "torch_first_loss": 12.0}}}
    got = gpu_check.first_losses(mixed, lambda k: k.split("/")[-1])
    assert got["1.3b/float16"]["agree"] and not got["1.3b/bfloat16"]["agree"]
    assert gpu_check.verdict({"a": {"ok": True}, "b": {"ok": None}})["ok"]
    assert not gpu_check.verdict({"a": {"ok": True}, "b": {"ok": False}})["ok"]
    assert not gpu_check.verdict({"a": {"ok": None}})["ok"]                 # nothing ran: no verdict of ok


def test_torch_timings_merge_into_mpicubes_records():
    mine = {"gpt2-small": {"mpicube": {"fp32/array": {"ms": 300.0}, "tf32/array": {"ms": 200.0}}}}
    theirs = {"gpt2-small": {"torch_first_loss": 10.9, "torch": {"fp32/math": {"ms": 150.0},
                                                                 "tf32/sdpa": {"ms": 100.0}}}}
    gpu_check.merge(mine, theirs, "gpu_perf.py")
    r = mine["gpt2-small"]
    assert r["torch_first_loss"] == 10.9
    assert r["mpicube"]["fp32/array"]["over_torch_math"] == 2.0 and r["mpicube"]["tf32/array"]["over_torch_sdpa"] == 2.0
    mixed = {"1.3b": {"float16": {"mpicube": {"ms": 120.0, "gemm_fraction": 0.5}}}}
    gpu_check.merge(mixed, {"1.3b": {"float16": {"torch_autocast": {"ms": 100.0}}}}, "gpu_mixed.py")
    assert mixed["1.3b"]["float16"]["mpicube"]["over_torch"] == 1.2
    assert mixed["1.3b"]["float16"]["mpicube"]["targets_met"]


@pytest.mark.timeout(240)
def test_dry_run_on_the_stand_in_writes_each_step(tmp_path):
    cmd = [sys.executable, str(ROOT / "tools" / "gpu_check.py"), "--dry-run", "--only", "env,serial,perf",
           "--budget", "200", "--out", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=220, cwd=ROOT)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert done.returncode == 0 and summary["ok"], done.stdout[-3000:] + done.stderr[-2000:]
    assert summary["dry_run"] and list(summary["steps"]) == ["env", "serial", "perf"]
    assert summary["steps"]["serial"]["kernels off"]["worst_relative"]["grads"] <= 1e-10
    assert summary["steps"]["serial"]["kernels on"]["ok"] is None          # the stand-in runs no CUDA source
    perf = json.loads((tmp_path / "perf.json").read_text())                # the script's own record, beside
    assert perf["shapes"]["tiny"]["mpicube"]["fp32/array"]["ms"] > 0
    assert "torch" not in perf["shapes"]["tiny"]                           # mpicube's part only
    assert "=== perf: ok" in (tmp_path / "gpu_check.log").read_text()
