"""The CuPy stand-in's API, and what mpicube calls on CuPy, pinned to real
CuPy 14 (tests/fake_gpu/cupy14_api.json: the surface of the cupy-cuda13x
14.2.0 wheel, read by importing it without a GPU; its provenance, wheel
name and sha256, is in the file, and tests/cupy_api.py says how to
rewrite it).

- every public name of the stand-in's cupy, cupyx, cupy.cuda and
  cupy.cuda.runtime, of its ndarray and its Device, Stream and Event,
  exists in CuPy 14, so a test passing on the stand-in never leans on API
  that real CuPy lacks;
- where both signatures are readable, the stand-in's parameters are
  CuPy's: each keyword it accepts CuPy accepts, each positional parameter
  sits at the same position (so a call that binds on the stand-in binds
  the same way on CuPy);
- every name mpicube's source reads on cupy/cupyx/xp (its AST) exists in
  CuPy 14 (NumPy-only names that mpicube guards are listed with the
  guard), and, unless it is reached only on a real GPU, in the stand-in.
With MPICUBE_CUPY14_SITE pointing at an unpacked cupy-cuda13x (see
tests/cupy_api.py), the record is regenerated and must equal the file.
"""

import json
import os
import subprocess
import sys

import pytest

import cupy_api
from mpirun import ROOT

RECORD = ROOT / "tests" / "fake_gpu" / "cupy14_api.json"
# reached only where real CuPy runs (cuBLAS, device handles, kernels): the stand-in does not model them
GPU_ONLY = ("cupy_backends.", "cupy.cuda.device.", "cupy._core._routines_linalg", "cupy.cuda.cublas",
            "cupy.RawModule")


def record() -> dict:
    return json.loads(RECORD.read_text())


@pytest.fixture(scope="module")
def stand_in() -> dict:
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'tests' / 'fake_gpu'}:{ROOT}"}
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "cupy_api.py"), "surface"], capture_output=True,
                          text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_the_record_is_cupy_14():
    rec = record()
    assert rec["provenance"]["cupy"].startswith("14.") and len(rec["provenance"]["sha256"]) == 64
    assert {"cupy.matmul", "cupy.ndarray.get", "cupyx.empty_pinned", "cupy.cuda.Stream.synchronize"} <= set(
        rec["names"])


def test_stand_in_offers_only_cupy_14_api(stand_in):
    names = record()["names"]
    assert len(stand_in) > 200, "the stand-in's surface was not read"
    extra = sorted(set(stand_in) - set(names))
    assert not extra, f"the stand-in offers what CuPy 14 lacks: {extra}"


def incompatible(mine, real) -> list:
    """Why a call that binds on parameters ``mine`` may not bind the same way on ``real``."""
    kinds = {p[0]: p[1] for p in real}
    var_kw = "VAR_KEYWORD" in kinds.values()
    var_pos = "VAR_POSITIONAL" in kinds.values()
    real_pos = [p[0] for p in real if p[1] in ("POSITIONAL_ONLY", "POSITIONAL_OR_KEYWORD")]
    problems = []
    for i, (name, kind, _) in enumerate(p for p in mine if p[1] in ("POSITIONAL_ONLY", "POSITIONAL_OR_KEYWORD")):
        if i < len(real_pos) and real_pos[i] != name:
            problems.append(f"positional {i} is {name!r}, CuPy's is {real_pos[i]!r}")
        elif i >= len(real_pos) and not var_pos:
            problems.append(f"{name!r} is positional {i}; CuPy takes {len(real_pos)} positionals")
    for name, kind, _ in mine:
        if kind in ("POSITIONAL_OR_KEYWORD", "KEYWORD_ONLY") and kinds.get(name, "POSITIONAL_ONLY") == \
                "POSITIONAL_ONLY" and not var_kw:
            problems.append(f"keyword {name!r} is not one of CuPy's")
    return problems


def test_stand_in_signatures_are_cupys(stand_in):
    names = record()["names"]
    checked, problems = 0, {}
    for name, entry in stand_in.items():
        real = names.get(name, {}).get("params")
        if entry["params"] is None or real is None:
            continue
        checked += 1
        found = incompatible(entry["params"], real)
        if found:
            problems[name] = found
    assert checked > 50, checked
    assert not problems, problems


def test_mpicube_calls_only_cupy_14_api(stand_in):
    names = record()["names"]
    used = cupy_api.uses()
    assert "cupy.matmul" in used and any("gemmStridedBatchedEx" in k for k in used), sorted(used)
    missing, not_in_stand_in = {}, {}
    for alternatives, where in used.items():
        options = alternatives.split(" | ")            # a fallback import: one of them must exist
        if alternatives in cupy_api.NUMPY_ONLY:
            continue
        if not any(o in names for o in options):
            missing[alternatives] = where
        elif not any(o.startswith(GPU_ONLY) for o in options) and not any(o in stand_in for o in options) \
                and options[0] not in ("cupy.cuda", "cupy.cuda.runtime"):
            not_in_stand_in[alternatives] = where
    assert not missing, f"mpicube calls what CuPy 14 lacks: {missing}"
    assert not not_in_stand_in, f"mpicube calls what the stand-in lacks (CI cannot run it): {not_in_stand_in}"


@pytest.mark.skipif(not os.environ.get("MPICUBE_CUPY14_SITE"), reason="MPICUBE_CUPY14_SITE: no unpacked CuPy 14")
def test_the_record_is_what_the_wheel_says(tmp_path):
    site = os.environ["MPICUBE_CUPY14_SITE"]
    wheel = os.environ.get("MPICUBE_CUPY14_WHEEL", "")
    env = {**os.environ, "PYTHONPATH": f"{site}:{ROOT}"}
    out = tmp_path / "api.json"
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "cupy_api.py"), "dump", str(out), wheel],
                          capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert json.loads(out.read_text())["names"] == record()["names"]
