"""--recompute {none,gathers,blocks}: the same numbers as none on every
layout, measured memory and communication equal to the cost model, the
paper-scale memory targets, and the command line."""

import json
import subprocess
from pathlib import Path

import pytest
from conftest import PYTHON, TINY
from mpirun import job_env, mpiexec

from mpicube.core.config import ModelConfig
from mpicube.analysis.costflops import step_flops
from mpicube.analysis.costmodel import Problem, step_traffic
from mpicube.analysis.costmemory import kept_and_rerun_terms, step_memory_bytes
from mpicube.analysis.costreport import _problem
from mpicube.core.errors import ConfigError
from mpicube.parallel.grid import plan
from mpicube.parallel.layouts.base import RECOMPUTE_MODES

HERE = Path(__file__).resolve().parent

# Every layout in every mode, with dp, pipeline schedules, cp, sequence
# parallelism, zero, --grad-accum and 16 bits, equal to serial with
# traffic and saved activations (+ one rerun block) equal to the model:
# tests/test_combo_matrix.py. Here the modes side by side, and the device path.


@pytest.mark.timeout(300)
@pytest.mark.parametrize("ranks,layout,depth", [(8, "3d", 1), (4, "2d", 1), (2, "1d", 1)])
def test_modes_equal_none_after_three_steps(ranks, layout, depth):
    """none, gathers and blocks side by side in one job: equal to 1e-12,
    and gathers/blocks keep less and move more than none (2-D here also
    covers the modes CASES leaves out for 2-D/2.5-D)."""
    proc = mpiexec(ranks, ["-m", "mpi4py", "tests/recompute_check.py", layout, depth], timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"OK recompute {layout} world={ranks}" in proc.stdout


# --------------------------------------------------------------------------- cost model, no MPI

PAPER = ModelConfig(vocab_size=50257, n_ctx=2048, n_layer=24, n_head=64, n_embd=8192)
PAPER_LAYOUTS = [("1d", 1), ("2d", 1), ("2.5d", 4), ("3d", 1)]


def paper(layout, depth, mode, dtype="float32"):
    p = _problem(layout, PAPER, 64, 64, 1, depth, dtype, mode)
    assert isinstance(p, Problem), p
    return p


@pytest.mark.parametrize("dropout", [False, True])
def test_paper_scale_cube_gathers_fits_in_2d_memory(dropout):
    """64 ranks, h 8192, 24 layers, 64 heads, batch 64 x 2048, vocab 50257:
    3-D with --recompute gathers needs no more memory per rank (params,
    grads, AdamW, activations) than 2-D with none; 3-D with none needs more."""
    for dtype in ("float32", "bfloat16"):
        cube = step_memory_bytes(paper("3d", 1, "gathers", dtype), dropout).total()
        cube_none = step_memory_bytes(paper("3d", 1, "none", dtype), dropout).total()
        two_d = step_memory_bytes(paper("2d", 1, "none", dtype), dropout).total()
        assert cube <= two_d < cube_none, (dtype, cube, two_d, cube_none)


@pytest.mark.parametrize("layout,depth", PAPER_LAYOUTS)
def test_paper_scale_blocks_below_a_quarter(layout, depth):
    """--recompute blocks brings every layout's activations below 25% of
    its none figure, with and without GPT-2's dropout 0.1, and its total
    too, except 2.5-D (d = 4, weights replicated over depth): with
    blockwise attention (no T x T probabilities or masks kept) its
    parameters, gradients and AdamW moments alone are over 33% of its none
    figure."""
    for dropout in (True, False):
        none = step_memory_bytes(paper(layout, depth, "none"), dropout)
        blocks = step_memory_bytes(paper(layout, depth, "blocks"), dropout)
        assert blocks.activations < 0.25 * none.activations
        fixed = none.params + none.grads + none.optimizer
        if layout != "2.5d":
            assert blocks.total() < 0.25 * none.total(), (layout, dropout, blocks.total() / none.total())
        else:
            assert fixed > 0.33 * none.total() and blocks.total() < 0.45 * none.total()


def test_modes_trade_memory_for_traffic_and_flops():
    """At a small size on every layout: gathers and blocks keep fewer
    activations and move more than none; blocks adds one forward of the
    blocks to the FLOPs, gathers none; blocks keeps what forward keeps plus
    one block's caches."""
    cfg = ModelConfig(vocab_size=61, n_ctx=8, n_layer=3, n_head=4, n_embd=16)
    for layout, world, depth in [("1d", 4, 1), ("2d", 4, 1), ("2.5d", 8, 2), ("3d", 8, 1)]:
        p = {m: _problem(layout, cfg, 16, world, 1, depth, "float64", m) for m in RECOMPUTE_MODES}
        mem = {m: step_memory_bytes(p[m], True).activations for m in p}
        moved = {m: step_traffic(p[m]).total_bytes() for m in p}
        assert mem["gathers"] < mem["none"] and mem["blocks"] < mem["none"], layout
        assert moved["gathers"] > moved["none"] and moved["blocks"] > moved["none"], layout
        flops = {m: step_flops(p[m]) for m in p}
        assert flops["gathers"] == flops["none"] < flops["blocks"] < 4 / 3 * flops["none"]
        kept, rerun = kept_and_rerun_terms(p["blocks"], True)
        none_kept, _ = kept_and_rerun_terms(p["none"], True)
        rows = none_kept["stat"] - cfg.n_layer * rerun["stat"]       # ln_f's rstd: one per token row
        heads = {"1d": world, "2d": 2, "2.5d": 2, "3d": 2}[layout]     # the head split of these grids
        assert rows > 0 and rerun["stat"] == 2 * rows + rows * cfg.n_head // heads   # ln_1, ln_2 rstd; lse
    serial = {m: _problem("serial", cfg, 16, 1, 1, 1, "float64", m) for m in RECOMPUTE_MODES}
    assert step_memory_bytes(serial["gathers"]) == step_memory_bytes(serial["none"])
    assert step_traffic(serial["gathers"]) == step_traffic(serial["none"])


def test_step_flops_of_serial_gpt2_small():
    """The usual count for GPT-2 small (B 8, T 1024): 3 x the linears'
    forward 2 x (12 L h^2 + V h) per token; blockwise attention's two
    products on the 36 of 64 blocks of 128 at or below the diagonal,
    7 products in all (forward 2, backward 5), 9 under --recompute blocks;
    cp 4 divides the replica's work by 4 (chunks of 128: the same blocks)."""
    cfg = ModelConfig(vocab_size=50257, n_ctx=1024, n_layer=12, n_head=12, n_embd=768)
    p = Problem(cfg, "serial", 1, 1, 1, 8, 1024)
    N, L, h, T = 8 * 1024, 12, 768, 1024
    linears = 2 * N * (12 * L * h * h + 50257 * h)
    product = 2 * 8 * 36 * 128 * 128 * h * L                          # one attention product, every layer
    assert step_flops(p) == 3 * linears + 7 * product
    blocks = Problem(cfg, "serial", 1, 1, 1, 8, 1024, recompute="blocks")
    assert step_flops(blocks) == 3 * linears + 2 * N * 12 * L * h * h + 9 * product
    # cp 4: chunks of 128, each rank's 2 query chunks against 8 key chunks, 36 chunk pairs in all again
    assert step_flops(Problem(cfg, "serial", 1, 1, 1, 8, 1024, cp=4)) == step_flops(p) / 4


def test_oned_row_shards_need_divisible_rows():
    """1-D keeps replicated activations as 1/p row shards under gathers and
    blocks: B_dp*T must split p ways, else one message naming valid sizes."""
    cfg = ModelConfig(vocab_size=61, n_ctx=6, n_layer=1, n_head=4, n_embd=16)
    plan("1d", cfg, 3, 4)                                 # none: any batch
    for mode in ("gathers", "blocks"):
        with pytest.raises(ConfigError, match=r"--recompute .* divisible by 4: use a batch size per replica "
                                              r"of 2 or 4"):
            plan("1d", cfg, 3, 4, recompute=mode)
        plan("1d", cfg, 4, 4, recompute=mode)
    with pytest.raises(ConfigError, match="unknown recompute mode"):
        plan("3d", cfg, 8, 8, recompute="all")


# --------------------------------------------------------------------------- command line


def run_cases(tmp_path, cases, corpus_cache) -> list:
    spec = tmp_path / "cases.json"
    spec.write_text(json.dumps([[str(a) for a in case] for case in cases]))
    env = job_env({"MPICUBE_CACHE": str(corpus_cache)}, timeout=300)
    proc = subprocess.run([PYTHON, str(HERE / "cli_cases.py"), str(spec)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_command_line(tmp_path, corpus_cache):
    """--recompute on info, train and bench; an unknown mode is one line and
    exit 2; gathers on the serial layout says so once; a 1-D size that
    cannot be row-sharded is one line and exit 2."""
    tiny = ["--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--seq-len", "16", "--batch-size", "4"]
    cases = [
        ["info", "--layout", "3d", "-n", "8", "--recompute", "gathers"],
        ["info", "--layout", "3d", "-n", "8"],
        ["info", "--recompute", "everything"],
        ["train", "--recompute", "all", "--steps", "1"],
        ["info", "--layout", "1d", "-n", "4", "--recompute", "blocks", "--batch-size", "1", "--seq-len", "3"],
        ["train", "--layout", "serial", *tiny, "--steps", "2", "--out", "run", "--recompute", "gathers",
         "--log-every", "1"],
        ["train", "--layout", "serial", *tiny, "--steps", "2", "--out", "run_blocks", "--recompute", "blocks",
         "--log-every", "1"],
        ["bench", "--layout", "serial", "--layout", "serial", *tiny, "--steps", "1", "--warmup-steps", "0",
         "--recompute", "gathers", "--json"],
    ]
    info_g, info_n, bad_info, bad_train, bad_rows, train_g, train_b, bench = run_cases(tmp_path, cases,
                                                                                       corpus_cache)
    assert info_g["status"] == 0 and info_n["status"] == 0, (info_g, info_n)
    assert any("--recompute gathers" in line for line in info_g["out"])
    memory = [line for line in info_g["out"] if line.strip().startswith("activations")]
    memory_none = [line for line in info_n["out"] if line.strip().startswith("activations")]
    assert memory and memory != memory_none
    assert any("FLOPs per rank per step" in line for line in info_g["out"])
    for bad in (bad_info, bad_train):
        assert bad["status"] == 2 and len(bad["err"]) == 1 and "--recompute" in bad["err"][0], bad
    assert bad_rows["status"] == 2 and len(bad_rows["err"]) == 1, bad_rows
    assert "batch size per replica of 4" in bad_rows["err"][0], bad_rows
    note = "note: --recompute gathers: nothing is gathered on the serial layout"
    assert train_g["status"] == 0, train_g
    assert train_g["out"].count(note) == 1, train_g["out"]
    assert train_b["status"] == 0 and not any("--recompute" in line for line in train_b["out"]), train_b
    losses = [[json.loads(line)["loss"] for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()
               if '"loss"' in line] for run in ("run", "run_blocks")]
    assert len(losses[0]) == 2 and losses[0] == losses[1]
    config = json.loads((tmp_path / "run_blocks" / "config.json").read_text())
    assert config["train"]["recompute"] == "blocks"
    assert bench["status"] == 0, bench
    assert bench["out"].count(note) == 1, bench["out"]
    result = json.loads(bench["out"][-1])["results"][0]
    assert result["recompute"] == "gathers" and result["comm"]["exact"]
    assert result["memory"]["measured_activations"] == result["memory"]["activations"]


def test_row_shards_checked_against_seq_len_of_a_model_file(mpicube):
    """With --init-from the model's context may be longer than --seq-len:
    1-D row shards split B_dp x seq_len rows, checked before the first step."""
    r = mpicube.run("train", *TINY, "--steps", "1", "--out", "model")
    assert r.returncode == 0, r
    r = mpicube.run("train", "--layout", "1d", "--init-from", "model", "--seq-len", "3", "--batch-size", "1",
                    "--recompute", "gathers", "--steps", "1", "--out", "again", n=2)
    assert r.returncode == 2, r
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "1 x 3 token rows per replica" in lines[0], r


@pytest.mark.timeout(300)
@pytest.mark.parametrize("ranks,layout,mode,env", [
    (2, "1d", "blocks", {"MPICUBE_CHECK_DEVICE": "gpu", "PYTHONPATH": f"{HERE / 'fake_gpu'}:{HERE.parent}"}),
], ids=["1d-n2-blocks-gpu-standin"])
def test_recompute_on_gpu(ranks, layout, mode, env):
    """The GPU path (CI's CuPy stand-in, tests/fake_gpu): still serial's
    numbers, and memory and traffic equal the model in bytes."""
    proc = mpiexec(ranks, ["-m", "mpi4py", "tests/parallel_check.py", layout, 1, 1, 0.1], timeout=240,
                   env={"MPICUBE_CHECK_RECOMPUTE": mode, **env})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"OK {layout} world={ranks} dp=1 depth=1" in proc.stdout and f"recompute={mode}" in proc.stdout
