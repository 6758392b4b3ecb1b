"""``mpicube trace --suite edge`` (issue 47 item 4): the reference traces
of the configurations that have broken frameworks, written into one
folder on one rank; each holds what makes it an edge (the idle experts
show in its expert loads), and mpicube's own parallel run of one agrees
with it, as a framework's CI would check."""

import h5py
import pytest
from conftest import MpiCube

from mpicube.analysis.suite import SUITES
from mpicube.check.compare import compare_traces


@pytest.mark.timeout(300)
def test_the_edge_suite_is_written_and_a_parallel_run_agrees_with_it(tmp_path, corpus_cache):
    runner = MpiCube(tmp_path, corpus_cache)
    r = runner.run("trace", "--suite", "edge", "--out", "suite")
    assert r.returncode == 0, r
    written = sorted(p.stem for p in (tmp_path / "suite").iterdir())
    assert written == sorted(SUITES["edge"]), written
    with h5py.File(tmp_path / "suite" / "idle-experts.h5", "r") as f:
        loads = [f[f"step_1/state/expert_load/h.{i}"][()] for i in range(2)]
    assert all(load.sum() == 4 and (load == 0).sum() >= 4 for load in loads), loads     # 4 tokens, top-1 of 8
    with h5py.File(tmp_path / "suite" / "vocab-257.h5", "r") as f:
        assert f["step_1/logits"].shape[-1] == 257 and f.attrs["version"] == 4
    r = runner.run("trace", "--layout", "1d", "--n-layer", "2", "--n-head", "4", "--n-embd", "16", "--seq-len", "8",
                   "--batch-size", "8", "--dtype", "float64", "--dropout", "0.1", "--steps", "2", "--state",
                   "--vocab-size", "257", "--out", "tp2.h5", n=2)
    assert r.returncode == 0, r
    assert compare_traces(tmp_path / "suite" / "vocab-257.h5", tmp_path / "tp2.h5").first_divergence is None


def test_the_suite_wants_a_folder(tmp_path, corpus_cache):
    runner = MpiCube(tmp_path, corpus_cache)
    r = runner.run("trace", "--suite", "edge", "--out", "x.h5")
    assert r.returncode == 2 and "--out x.h5: with --suite, give a folder" in r.stderr, r
    assert not (tmp_path / "x.h5").exists()
