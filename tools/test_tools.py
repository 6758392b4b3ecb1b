"""Fast checks of the analysis tools (not part of CI, which runs tests/):

    PYTHONPATH=. python -m pytest -q tools/test_tools.py

The placement test launches small MPI jobs and compares the communicators
mpicube really builds with the ones tools/perfmodel.py derives on paper.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(HERE), str(ROOT)]

from mpicube.core.config import ModelConfig  # noqa: E402

import perfmodel as pm  # noqa: E402


def _env():
    env = dict(os.environ, MPIR_CVAR_ENABLE_HEAVY_YIELD="1", MPIEXEC_TIMEOUT="120")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    return env


# --------------------------------------------------------------------------- placement


def report_groups(layout: str, dp: int, depth: int) -> None:
    """Under mpiexec: print, on rank 0, {axis: [world ranks of each communicator]}."""
    from mpi4py import MPI

    from mpicube.device.backend import make_backend
    from mpicube.parallel.grid import build_layout
    from mpicube.parallel.planning import resolve
    from mpicube.parallel.gridspec import GridSpec

    world = MPI.COMM_WORLD
    cfg = ModelConfig(vocab_size=61, n_ctx=8, n_layer=1, n_head=12, n_embd=36)
    run = resolve(GridSpec(layout, dp=dp, depth=depth), cfg, 36 * dp, world.Get_size())
    lay = build_layout(run, make_backend("cpu", "float64"), world)
    comms = [lay.axes.tp, lay.axes.dp, lay.axes.world]
    comms += [v for v in vars(lay).values() if hasattr(v, "axis") and hasattr(v, "mpi")]
    mine = {}
    for c in comms:
        ranks = MPI.Group.Translate_ranks(c.mpi.Get_group(), list(range(c.size)), world.Get_group())
        mine[c.axis] = sorted(ranks)
    everyone = world.gather(mine, root=0)
    if world.rank == 0:
        out = {}
        for d in everyone:
            for axis, ranks in d.items():
                out.setdefault(axis, set()).add(tuple(ranks))
        print(json.dumps({axis: sorted(map(list, g)) for axis, g in out.items()}))


@pytest.mark.parametrize("ranks,layout,dp,depth", [(8, "3d", 1, 1), (16, "3d", 2, 1), (8, "2.5d", 1, 2),
                                                   (8, "2d", 2, 1), (4, "1d", 1, 1)])
def test_axis_groups_match_mpicube(ranks, layout, dp, depth):
    mpiexec = Path(sys.executable).parent / "mpiexec"
    proc = subprocess.run([str(mpiexec), "-n", str(ranks), sys.executable, __file__, layout, str(dp), str(depth)],
                          capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=180)
    assert proc.returncode == 0, proc.stderr
    real = json.loads(proc.stdout.strip().splitlines()[-1])
    paper = pm.axis_groups(layout, ranks // dp, depth, dp)
    for axis, groups in real.items():
        assert sorted(groups) == sorted(paper[axis]), axis


def test_spans_of_the_cube_on_4_gpu_nodes():
    groups = pm.axis_groups("3d", 64)
    spans = {axis: pm.axis_span(g, 4) for axis, g in groups.items()}
    assert not spans["k"].inter                                   # k is innermost: one node
    assert spans["j"].inter and spans["j"].flows == 4             # 4 j-rings leave every node
    assert spans["i"].inter and spans["i"].flows == 4
    assert spans["ik"].nodes == 4 and spans["ik"].flows == 1      # 4 members per node, one ring edge out
    one_d = pm.axis_span(pm.axis_groups("1d", 64)["tp"], 4)
    assert one_d.nodes == 16 and one_d.flows == 1


# --------------------------------------------------------------------------- model pieces


def test_grid_sizes():
    assert pm.grid_sizes("1d", 64) == [(2, 1), (4, 1), (8, 1), (16, 1), (32, 1), (64, 1)]
    assert [p for p, _ in pm.grid_sizes("2d", 27)] == [4, 9, 16, 25]
    assert pm.grid_sizes("2.5d", 64) == [(8, 2), (27, 3), (64, 4)]
    assert pm.grid_sizes("3d", 64) == [(8, 1), (27, 1), (64, 1)]


def test_make_problem_reports_mpicube_message():
    cfg = ModelConfig(vocab_size=256, n_ctx=16, n_layer=1, n_head=12, n_embd=144)
    assert "divisible" in pm.make_problem("3d", cfg, 10, 8)
    assert pm.make_problem("3d", cfg, 16, 8).tp == 8


def test_flops_agree_with_bench():
    from mpicube.analysis.bench import model_flops

    cfg = ModelConfig(vocab_size=50257, n_ctx=1024, n_layer=4, n_head=64, n_embd=1024)
    prob = pm.make_problem("3d", cfg, 16, 64)
    ours = pm.flops_per_rank(prob) * 64
    # bench leaves ln_f (2h parameters) out of the block count; nothing else differs
    assert abs(ours - model_flops(cfg, 16, 1024)) == 6 * 16 * 1024 * 2 * 1024


def test_comm_time_is_alpha_beta():
    cfg = ModelConfig(vocab_size=256, n_ctx=16, n_layer=2, n_head=16, n_embd=256)
    prob = pm.make_problem("2d", cfg, 16, 16)
    flat = pm.Cluster(gpus_per_node=16, alpha_intra=0.0, intra_bw=1e9, bytes_per_elem=2)
    nbytes = pm.step_traffic(pm.in_format(prob, flat)).total_bytes()    # float16: real widths per collective
    assert pm.step_time(prob, flat)["comm"] == pytest.approx(float(nbytes) / 1e9)
    slow = flat.with_(gpus_per_node=4, nic_bw=1e9, alpha_inter=1e-6)
    assert pm.step_time(prob, slow)["comm"] > pm.step_time(prob, flat)["comm"]


# --------------------------------------------------------------------------- the scripts


def test_scaling_analytic_runs(tmp_path):
    proc = subprocess.run([sys.executable, str(HERE / "scaling.py"), "--out", str(tmp_path)],
                          capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr
    rows = list(csv.DictReader(open(tmp_path / "scaling_analytic.csv")))
    three = [r for r in rows if r["layout"] == "3d" and r["scaling"] == "strong"]
    assert [int(r["p"]) for r in three] == [8, 27, 64]
    weak = [r for r in rows if r["scaling"] == "weak" and r["comm_elems"]]
    assert len({r["flops_per_rank"] for r in weak}) == 1           # batch rule: same work on every rank
    assert (tmp_path / "analytic_strong_comm.png").stat().st_size > 0


def test_project_json():
    proc = subprocess.run([sys.executable, str(HERE / "project.py"), "--json"], capture_output=True, text=True,
                          env=_env(), cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert set(doc["layouts"]) == {"1d", "2d", "2.5d", "3d"}
    assert doc["layouts"]["3d"]["vs_3d"] == 1.0
    assert doc["paper"] == {"1d/3d": 2.32, "2d/3d": 1.57}
    assert all(s["ratios"]["1d/3d"] > 0 for s in doc["sensitivity"])


def test_gpu_check_records_instead_of_failing(tmp_path):
    """tools/gpu_check.py on a machine without a GPU: its env step runs in a
    child, what is missing is recorded, and summary.json and the log appear."""
    cmd = [sys.executable, str(HERE / "gpu_check.py"), "--only", "env", "--out", str(tmp_path), "--budget-s", "60"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=120)
    env = json.loads((tmp_path / "summary.json").read_text())["steps"]["env"]
    assert proc.returncode == (0 if env["ok"] else 1), proc.stderr
    assert env["mpi_library"] and "seconds" in env and "cuda" in env
    assert "=== env" in (tmp_path / "gpu_check.log").read_text()
    bad = subprocess.run(cmd[:2] + ["--only", "env,bogus"], capture_output=True, text=True, env=_env(), timeout=60)
    assert bad.returncode == 2 and "unknown step(s) bogus" in bad.stderr


if __name__ == "__main__":
    report_groups(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
