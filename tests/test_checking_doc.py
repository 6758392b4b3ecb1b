"""The complete Mixtral recorder loop of docs/checking-a-framework.md
(section 2e) runs as written against an mpicube float64 trace, and
transformers' MixtralForCausalLM then agrees with mpicube in every tensor,
the router's included. Skipped where torch or transformers is not
installed (the optional comparison extra)."""

import re
import subprocess
import sys

import pytest

from mpirun import ROOT, job_env

PAGE = ROOT / "docs" / "checking-a-framework.md"
MARKER = "<!-- run by tests/test_checking_doc.py -->"
TRACE = ("trace --arch mixtral --n-experts 4 --n-layer 2 --n-head 4 --n-kv-head 2 --n-embd 16 --ffn-hidden 24 "
         "--seq-len 8 --batch-size 4 --dtype float64 --steps 2 --router-z-loss-coef 0.01 --out ref.h5")


def page_block() -> str:
    text = PAGE.read_text()
    assert MARKER in text, "the Mixtral loop lost its marker"
    after = text.split(MARKER, 1)[1]
    m = re.match(r"\s*```python\n(.*?)\n```", after, re.DOTALL)
    assert m, "the marker must be followed by a python block"
    return m.group(1)


def test_the_page_names_the_trace_it_runs_against():
    assert "mpicube " + TRACE in " ".join(PAGE.read_text().split())


def test_the_mixtral_recorder_loop_runs_as_written_and_agrees(tmp_path):
    pytest.importorskip("torch", reason="torch is not installed (optional check)")
    pytest.importorskip("transformers", reason="transformers is not installed (optional check)")
    from mpicube.check.compare import compare_traces

    env = job_env({}, timeout=300)
    run = subprocess.run([sys.executable, "-m", "mpicube", *TRACE.split()], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    (tmp_path / "loop.py").write_text(page_block())
    run = subprocess.run([sys.executable, "loop.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    result = compare_traces(tmp_path / "ref.h5", tmp_path / "mine.h5")
    bad = [(r.name, r.note, r.max_rel) for r in result.rows if not r.ok]
    assert result.first_divergence is None and not bad, bad[:5]
    assert result.summary()["tensors"] == 194 and any(r.name == "step_2/moe/h.1.weights" for r in result.rows)
