"""Size validation happens before any MPI call and names the fix."""

import pytest

from mpicube.core.config import ModelConfig
from mpicube.core.errors import ConfigError
from mpicube.parallel.grid import choose_layout, plan
from mpicube.parallel.gridspec import GridSpec

CFG = ModelConfig(vocab_size=256, n_ctx=16, n_layer=1, n_head=12, n_embd=144)


@pytest.mark.parametrize("tp,expected", [(1, "serial"), (2, "1d"), (4, "2d"), (6, "1d"), (8, "3d"),
                                         (9, "2d"), (27, "3d"), (64, "3d")])
def test_auto_layout(tp, expected):
    assert choose_layout("auto", tp) == expected


@pytest.mark.parametrize("layout,world,dp,depth,batch,cfg,message", [
    ("3d", 10, 1, 1, 8, CFG, "q^3; got 10: nearest valid sizes 8 or 27"),
    ("3d", 8, 1, 1, 6, CFG, "batch size per replica 6 must be divisible by q^2 = 4: use 4 or 8"),
    ("3d", 27, 1, 1, 9, ModelConfig(n_head=12, n_embd=132), "n_embd 132 must be divisible by q^2 = 9 (weights split q^2 ways): use 108 or 144"),
    ("3d", 8, 1, 1, 8, ModelConfig(n_head=9, n_embd=144), "n_head 9 must be divisible by q = 2: use 8 or 10"),
    ("2d", 6, 1, 1, 8, CFG, "nearest valid sizes 4 or 9"),
    ("2d", 4, 1, 1, 3, CFG, "batch size per replica 3 must be divisible by d*q = 2: use 2 or 4"),
    ("2.5d", 8, 1, 3, 8, CFG, "--depth 3 must divide the tensor-parallel size 8"),
    ("1d", 5, 1, 1, 8, CFG, "n_head 12 must be divisible by the tensor-parallel size 5"),
    ("serial", 2, 1, 1, 8, CFG, "runs on one rank per data-parallel replica"),
    ("auto", 6, 4, 1, 8, CFG, "--dp 4 must divide the world size 6; choose one of [1, 2, 3, 6]"),
    ("auto", 4, 2, 1, 7, CFG, "--batch-size 7 must be divisible by --dp 2"),
    ("4d", 4, 1, 1, 8, CFG, "unknown layout '4d'"),
    ("auto", 1, 1, 1, 8, ModelConfig(n_head=7, n_embd=144), "n_embd 144 must be divisible by n_head 7 (each head gets n_embd/n_head columns): use --n-head 6 or 8, or --n-embd 140 or 147"),
])
def test_bad_sizes_are_named(layout, world, dp, depth, batch, cfg, message):
    with pytest.raises(ConfigError) as err:
        plan(GridSpec(layout, dp=dp, depth=depth), cfg, batch, world)
    assert message in str(err.value)


def test_auto_with_a_depth_means_2_5d():
    """Only 2.5-D has a depth: auto takes it, the other layouts refuse it."""
    assert choose_layout("auto", 8, depth=2) == "2.5d"
    assert plan(GridSpec(depth=2), CFG, 8, 8)[1:] == ("2.5d", 8)
    for layout, world in (("1d", 4), ("2d", 4), ("3d", 8)):
        with pytest.raises(ConfigError, match="--depth 2 applies to the 2.5d layout only"):
            plan(GridSpec(layout, depth=2), CFG, 8, world)


def test_valid_plans():
    assert plan("auto", CFG, 16, 64)[1] == "3d"
    assert plan(GridSpec("2.5d", depth=2), CFG, 8, 8)[2] == 8
    assert plan(GridSpec(dp=2), CFG, 8, 16)[1:] == ("3d", 8)


def test_gridspec_rank_order_is_dp_pp_cp_tp():
    """world rank = ((d * pp + p) * cp + c) * tp + t: tp innermost, dp outermost
    (gridspec.py says why), and every rank has one coordinate tuple."""
    grid = GridSpec("1d", dp=2, pp=3, cp=2)
    world = 2 * 3 * 2 * 4
    seen = set()
    for rank in range(world):
        d, p, c, t = grid.coords(rank, world)
        assert rank == ((d * 3 + p) * 2 + c) * 4 + t
        seen.add((d, p, c, t))
    assert len(seen) == world
    assert GridSpec(dp=2).coords(5, 8) == (1, 0, 0, 1)          # d * tp + t, as before the other axes


def test_gridspec_sizes_are_validated():
    with pytest.raises(ConfigError, match=r"--dp 2 x --pp 3 = 6 must divide the world size 8"):
        GridSpec(dp=2, pp=3).tp(8)
    with pytest.raises(ConfigError, match="--cp must be at least 1, got 0"):
        GridSpec(cp=0).tp(8)
    assert GridSpec.of("3d") == GridSpec(layout="3d")
    assert GridSpec(dp=2, pp=2).words() == ", dp 2, pp 2 (1f1b)"       # a pipeline names its schedule
    assert GridSpec(pp=2, pp_schedule="interleaved", virtual_stages=2).words() == ", pp 2 (interleaved, V 2)"


def test_a_launch_resolves_its_plan_once(monkeypatch, tmp_path):
    """A run's plan is validated once (``planning.resolve``), with or
    without a default batch to choose: the builders (``build_parts``,
    ``build_layout``) consume the resolved plan and check nothing again.
    Every resolution starts with the model's sizes, so counting
    ``validate_model`` counts resolutions."""
    from mpi4py import MPI

    from mpicube.parallel import planning
    from mpicube.training.options import TrainOptions
    from mpicube.training.train import Trainer

    calls = []
    real = planning.validate_model
    monkeypatch.setattr(planning, "validate_model", lambda cfg: (calls.append(cfg), real(cfg)))
    monkeypatch.chdir(tmp_path)
    for batch in (None, 4):
        calls.clear()
        opts = TrainOptions(layout="serial", n_layer=1, n_head=2, n_embd=16, seq_len=8, batch_size=batch, steps=1,
                            grad_accum=2, recompute="blocks")
        Trainer(opts, MPI.COMM_SELF, keep_files=False).setup()
        assert len(calls) == 1, (batch, len(calls))


def test_two_plans_with_different_settings_live_in_one_process():
    """Overlap and the attention kind are plan fields (the command line
    reads MPICUBE_OVERLAP and MPICUBE_ATTENTION, nothing below it does):
    two layouts built side by side keep their own settings."""
    from mpi4py import MPI

    from mpicube.parallel.gridspec import Plan
    from mpicube.parallel.planning import resolve
    from mpicube.training.parts import Numerics, build_parts

    cfg = ModelConfig(vocab_size=11, n_ctx=4, n_layer=1, n_head=2, n_embd=8)
    a = build_parts(resolve(Plan("serial", overlap=False, attention="full"), cfg, 2, 1), MPI.COMM_SELF,
                    Numerics("float64"))
    b = build_parts(resolve(Plan("serial"), cfg, 2, 1), MPI.COMM_SELF, Numerics("float64"))
    assert (a.layout.overlap, a.layout.attention_kind) == (False, "full")
    assert (b.layout.overlap, b.layout.attention_kind) == (True, "blocks")
    with pytest.raises(ConfigError, match="unknown attention 'sparse'; choose one of blocks, full"):
        resolve(Plan("serial", attention="sparse"), cfg, 2, 1)


def test_env_is_read_by_the_command_line_only():
    """The environment switches become plan fields in one place."""
    from pathlib import Path

    from mpicube.cli.common import env_settings

    assert env_settings({}) == {"overlap": True, "attention": "blocks"}
    assert env_settings({"MPICUBE_OVERLAP": "0", "MPICUBE_ATTENTION": "full"}) == {"overlap": False,
                                                                                    "attention": "full"}
    root = Path(__file__).resolve().parents[1] / "mpicube"
    readers = sorted(str(p.relative_to(root)) for p in root.rglob("*.py")
                     if any(k in p.read_text() for k in ('"MPICUBE_OVERLAP"', '"MPICUBE_ATTENTION"')))
    assert readers == ["cli/common.py"], readers
