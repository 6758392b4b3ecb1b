"""``--grad-accum N`` and default batch sizes (issue 13, items 3 and 4).

Accumulation must not change the trajectory: every layout, running a step as
N micro-batches through the trainer's own code (mpicube.training.accum), follows the
serial model run on the whole batch at once (float64, 1e-10), with measured
communication and memory equal to the cost model; and ``mpicube train`` with
and without accumulation logs the same losses. Without --batch-size, a
command picks the smallest batch of at least 8 that its layout accepts, so
``mpiexec -n 27 mpicube train`` runs as typed.
"""

import json

import pytest
from conftest import TINY, paired, read_metrics
from mpirun import ROOT, mpiexec

from mpicube.core.config import ModelConfig
from mpicube.analysis.costmodel import Problem, step_traffic
from mpicube.analysis.costmemory import activation_elems
from mpicube.core.errors import ConfigError
from mpicube.parallel.grid import default_batch, plan
from mpicube.parallel.gridspec import GridSpec

CFG = ModelConfig(vocab_size=256, n_ctx=64, n_layer=4, n_head=12, n_embd=144)   # train's default model


# --------------------------------------------------------------------------- default batch sizes (pure)


@pytest.mark.parametrize("world,kwargs,batch,words", [
    (1, {}, 8, "layout serial, tp 1 accepts"),
    (8, {}, 8, "layout 3d, tp 8 accepts"),
    (27, {}, 9, "layout 3d, tp 27 accepts"),
    (64, {}, 16, "layout 3d, tp 64 accepts"),
    (16, {"dp": 2}, 8, "layout 3d, tp 8, dp 2 accepts"),
    (4, {"name": "1d"}, 8, "layout 1d, tp 4 accepts"),
    (18, {"dp": 2}, 12, "layout 2d, tp 9, dp 2 accepts"),
    (8, {"depth": 2}, 8, "layout 2.5d, tp 8, depth 2 accepts"),
    (64, {"grad_accum": 2}, 32, "layout 3d, tp 64, grad-accum 2 accepts"),
    (27, {"grad_accum": 3}, 27, "layout 3d, tp 27, grad-accum 3 accepts"),
])
def test_default_batch_is_the_smallest_that_fits(world, kwargs, batch, words):
    kwargs = dict(kwargs)
    name = kwargs.pop("name", "auto")
    grid = GridSpec(name, dp=kwargs.get("dp", 1), depth=kwargs.get("depth", 1))
    accum = kwargs.get("grad_accum", 1)
    got, why = default_batch(grid, CFG, world, accum)
    assert got == batch
    assert why == f"batch {batch} (smallest of at least 8 that {words})"
    plan(grid, CFG, got, world, accum)
    for smaller in range(8, got):
        with pytest.raises(ConfigError):
            plan(grid, CFG, smaller, world, accum)


def test_default_batch_names_what_no_batch_can_fix():
    """A model the layout cannot split is refused for what it is, not as a batch size."""
    with pytest.raises(ConfigError, match="n_head 10 must be divisible by q = 4"):
        default_batch("auto", ModelConfig(n_head=10, n_embd=160), 64)


@pytest.mark.parametrize("batch,dp,accum,message", [
    (8, 1, 0, "--grad-accum must be at least 1, got 0"),
    (8, 1, 3, "--grad-accum 3 must divide the batch per replica 8 (--batch-size 8 / --dp 1): use --batch-size "
              "6 or 9, or --grad-accum one of [1, 2, 4, 8]"),
    (16, 2, 3, "--grad-accum 3 must divide the batch per replica 8 (--batch-size 16 / --dp 2)"),
    (16, 1, 2, "layout 3d: the micro-batch per replica 8 (--batch-size 16 / --dp 1 / --grad-accum 2) must be "
               "divisible by 16: use --batch-size 32"),
])
def test_the_micro_batch_is_validated(batch, dp, accum, message):
    with pytest.raises(ConfigError) as err:
        plan(GridSpec(dp=dp), CFG, batch, 64 * dp, accum)
    assert message in str(err.value)


def test_cost_model_scales_with_the_micro_batch():
    """Activations are those of one micro-batch; the layout's traffic comes N
    times at micro-batch sizes, the gradient synchronisation once."""
    whole, accum = (Problem(CFG, "3d", 8, 2, 1, 32, 64, "float32", grad_accum=n) for n in (1, 2))
    half = Problem(CFG, "3d", 8, 2, 1, 16, 64, "float32")
    assert activation_elems(accum) == activation_elems(half) < activation_elems(whole)
    t_accum, t_half = step_traffic(accum), step_traffic(half)
    assert t_accum.elems["dp"] == t_half.elems["dp"]                  # gradient sync once per step
    assert t_accum.msgs["world"] == 2 * t_half.msgs["world"]          # the loss, once per micro-batch
    for axis in ("i", "j", "k"):
        assert t_accum.elems[axis] == 2 * t_half.elems[axis]


# --------------------------------------------------------------------------- every layout vs serial


# Accumulation on every layout, with dp, every pipeline schedule, cp,
# sequence parallelism, every zero and recompute mode and 16 bits, equal
# to serial on the whole batch, runs in tests/test_combo_matrix.py; here
# the device path.


@pytest.mark.timeout(300)
@pytest.mark.parametrize("env,words", [
    ({"PYTHONPATH": f"{ROOT / 'tests' / 'fake_gpu'}:{ROOT}", "MPICUBE_CHECK_DEVICE": "gpu"}, "device=gpu dtype=float64"),
], ids=["gpu-stand-in"])
def test_accumulating_2d_on_the_gpu_path(env, words):
    """Dropout indices per micro-batch on the device (CI's CuPy stand-in)."""
    proc = mpiexec(4, ["-m", "mpi4py", "tests/parallel_check.py", "2d", 1, 1, 0.1], timeout=240,
                   env={**env, "MPICUBE_CHECK_ACCUM": "2"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"OK 2d world=4 dp=1 depth=1 {words} recompute=none accum=2" in proc.stdout


# --------------------------------------------------------------------------- the command line


@pytest.mark.timeout(300)
def test_train_with_grad_accum_follows_the_same_trajectory(mpicube, tmp_path, tiny_shard):
    """Same seed and data, dropout on, two replicas: the losses, gradient
    norms and validation losses of --grad-accum 2 are those of one pass."""
    args = [*TINY, "--dp", "2", "--steps", "3", "--dtype", "float64", "--dropout", "0.1", "--data", tiny_shard,
            "--eval-every", "3", "--eval-batches", "2"]
    runs = {}
    for accum in (1, 2):
        r = mpicube.run("train", *args, "--grad-accum", accum, "--out", f"run{accum}", n=2, timeout=240)
        assert r.returncode == 0, r
        runs[accum] = read_metrics(tmp_path / f"run{accum}")
    assert "batch 4 in 2 micro-batches of 2" in r.stdout
    (steps1, evals1), (steps2, evals2) = runs[1], runs[2]
    assert [s["step"] for s in steps2] == [1, 2, 3] and len(evals2) == 1
    for a, b in paired(steps1, steps2):
        assert abs(a["loss"] - b["loss"]) <= 1e-10 * abs(a["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-10 * a["grad_norm"]
    assert abs(evals1[0]["val_loss"] - evals2[0]["val_loss"]) <= 1e-10 * evals1[0]["val_loss"]
    assert steps1[1]["loss"] != steps1[0]["loss"]                          # it did train
    config = json.loads((tmp_path / "run2" / "config.json").read_text())
    assert config["train"]["grad_accum"] == 2 and config["train"]["batch_size"] == 4


@pytest.mark.timeout(300)
@pytest.mark.parametrize("extra,message", [
    (["--grad-accum", "0"], "error: --grad-accum must be at least 1, got 0"),
    (["--grad-accum", "3"], "error: --grad-accum 3 must divide the batch per replica 4"),
])
def test_bad_grad_accum_is_one_line(mpicube, extra, message):
    r = mpicube.run("train", *TINY, "--steps", "1", "--out", "run", *extra)
    assert r.returncode == 2, r
    lines = r.error_lines()
    assert len(lines) == 1 and lines[0].startswith(message), r
    assert "Traceback" not in r.stdout + r.stderr


@pytest.mark.timeout(400)
@pytest.mark.parametrize("ranks,batch,layout", [(8, 8, "3d, tp 8"), (27, 9, "3d, tp 27")])
def test_train_runs_as_typed(mpicube, tmp_path, ranks, batch, layout):
    """`mpiexec -n P mpicube train --steps 2`: no model or batch options."""
    r = mpicube.run("train", "--steps", "2", "--out", "run", n=ranks, timeout=360,
                    env={"MPIEXEC_TIMEOUT": "330"})
    assert r.returncode == 0, r
    announce = [line for line in r.stdout.splitlines() if " parameters, layout " in line]
    assert len(announce) == 1, r
    assert f"batch {batch} (smallest of at least 8 that layout {layout} accepts)" in announce[0], r
    steps, _ = read_metrics(tmp_path / "run")
    assert [s["step"] for s in steps] == [1, 2]
    assert json.loads((tmp_path / "run" / "config.json").read_text())["train"]["batch_size"] == batch


def test_info_announces_the_default_batch(mpicube):
    r = mpicube.run("info", "-n", "64", "--grad-accum", "2")
    assert r.returncode == 0, r
    assert "batch 32 (smallest of at least 8 that layout 3d, tp 64, grad-accum 2 accepts)" in r.stdout
    assert "batch 32 sequences x 64 tokens per step, in 2 micro-batches of 16" in r.stdout
