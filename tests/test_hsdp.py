"""--hsdp R (issue 46): the dp replicas as R replicas of dp/R-way ZeRO-3
shard groups. Whole training steps on every combination it joins equal
serial with traffic and memory equal to the cost model in
tests/test_combo_matrix.py (HSDP_CASES); here the cost model's own terms,
the command line (a checkpoint moves between HSDP, ZeRO-3 and serial) and
the bad input."""

import json

import pytest
from conftest import TINY

from mpicube.analysis.costmodel import Problem, step_traffic
from mpicube.core.config import ModelConfig
from mpicube.core.errors import ConfigError
from mpicube.parallel.gridspec import Plan
from mpicube.parallel.planning import resolve

CFG = ModelConfig(vocab_size=61, n_ctx=16, n_layer=2, n_head=4, n_embd=16)


def test_traffic_model_shards_over_the_group_and_sums_over_replicas():
    """Under --hsdp 2 on dp 4 the reduce-scatters and gathers run over the
    2-rank group, not 4, and the chunk (twice ZeRO-3's over 4) is summed
    once over the 2 replicas."""
    flat = step_traffic(Problem(CFG, "serial", 1, 4, 1, 8, 16, "float64", zero=3))
    hsdp = step_traffic(Problem(CFG, "serial", 1, 4, 1, 8, 16, "float64", zero=3, hsdp=2))
    two = step_traffic(Problem(CFG, "serial", 1, 2, 1, 8, 16, "float64", zero=3))
    assert hsdp.msgs["dp"] == two.msgs["dp"] and hsdp.elems["dp"] == two.elems["dp"]
    assert flat.msgs["dp"] > hsdp.msgs["dp"]
    assert hsdp.msgs["hsdp"] == 2 and hsdp.elems["hsdp"] > 0 and "hsdp" not in flat.msgs


@pytest.mark.parametrize("plan,message", [
    (Plan(dp=4, zero=3, hsdp=3),
     r"^--hsdp 3 must divide --dp 4 into replicas of 2 or more shards: use --hsdp one of \[2\]$"),
    (Plan(dp=4, zero=3, hsdp=4), r"^--hsdp 4 must divide --dp 4"),
    (Plan(dp=4, zero=1, hsdp=2), r"^--hsdp 2 shards the weights ZeRO-3-wise inside each replica: use --zero 3"),
])
def test_bad_sizes(plan, message):
    with pytest.raises(ConfigError, match=message):
        resolve(plan, CFG, 8, 4)


def test_checkpoints_move_between_hsdp_zero3_and_serial(mpicube, tiny_shard):
    """3 steps on 4 ranks (--dp 4 --zero 3 --hsdp 2) equal 1 step there, a
    checkpoint and 2 more resumed on 2 ranks with plain --zero 3, and
    evaluate to serial's loss; a bad --hsdp is one line, exit 2."""
    args = [*TINY, "--dtype", "float64", "--dropout", "0.1", "--steps", "3", "--data", str(tiny_shard)]
    r = mpicube.run("train", *args, "--dp", "4", "--zero", "3", "--hsdp", "2", "--out", "hsdp", n=4)
    assert r.returncode == 0, r
    r = mpicube.run("train", *args, "--dp", "4", "--zero", "3", "--hsdp", "2", "--out", "moved", "--stop-after", "1",
                    n=4)
    assert r.returncode == 0, r
    r = mpicube.run("train", *args, "--dp", "2", "--zero", "3", "--out", "moved", "--resume", n=2)
    assert r.returncode == 0, r
    r = mpicube.run("train", *args, "--out", "serial")
    assert r.returncode == 0, r
    last = {run: json.loads((mpicube.cwd / run / "metrics.jsonl").read_text().splitlines()[-1])
            for run in ("hsdp", "moved", "serial")}
    assert {m["step"] for m in last.values()} == {3}
    for run in ("hsdp", "moved"):
        assert abs(last[run]["loss"] - last["serial"]["loss"]) <= 1e-10 * abs(last["serial"]["loss"]), last
    r = mpicube.run("train", *args, "--dp", "4", "--zero", "3", "--hsdp", "3", "--out", "bad", n=4)
    assert r.returncode == 2 and r.error_lines() == [
        "error: --hsdp 3 must divide --dp 4 into replicas of 2 or more shards: use --hsdp one of [2]"], r
    assert not (mpicube.cwd / "bad").exists()


def test_the_page_shows_what_the_code_draws():
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "tools/hsdp_pictures.py", "--check", "docs/hsdp.md"], cwd=root,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_traces_agree_with_serial(mpicube, tiny_shard):
    """trace (full logical tensors, dropout masks, gradients, parameters)
    of --hsdp 2 over dp 4 with --zero 3, and of --cp 4 --cp-kind hybrid
    --ulysses 2, both under --optimizer muon, agree with a serial Muon
    trace tensor by tensor."""
    args = [*TINY[2:], "--dtype", "float64", "--dropout", "0.1", "--steps", "2", "--data", str(tiny_shard),
            "--layout", "serial", "--optimizer", "muon"]
    for name, n, extra in (("hsdp.h5", 4, ["--dp", "4", "--zero", "3", "--hsdp", "2"]),
                           ("hybrid.h5", 4, ["--cp", "4", "--cp-kind", "hybrid", "--ulysses", "2"]),
                           ("serial.h5", 1, [])):
        r = mpicube.run("trace", *args, *extra, "--out", name, n=n)
        assert r.returncode == 0, r
    for name in ("hsdp.h5", "hybrid.h5"):
        r = mpicube.run("compare", name, "serial.h5")
        assert r.returncode == 0 and "all tensors agree" in r.stdout, r
