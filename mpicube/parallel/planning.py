"""A ``Plan`` (gridspec.py) checked against a model, a world size and a
batch, once: ``resolve`` returns the ``Resolved`` plan that every builder
(``grid.build_layout``, ``training.parts.build_parts``) consumes without
validating again.

Why one function: the checks used to be spread over the options, the
layout factory, the parts builder, ZeRO and the batch chooser, and a
launch ran them up to five times, in orders that differed between
commands (``info`` named one error, ``train`` another). Here they run in
one order for every command, pure (no MPI call), so every rank reaches
the same verdict before the first collective and names the nearest valid
values the same way. The composition refusals (``validate_axes``,
``check_sequence_parallel``, ``zero.validate``) live here too, so lifting
one is a change in one place.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional

from ..core.config import ModelConfig
from ..core.errors import ConfigError
from ..core.intmath import integer_root
from . import context, ulysses
from .fp8 import check_plan as check_fp8
from .gridspec import ATTENTION_KINDS, Plan
from .layouts import LAYOUTS
from .layouts.base import RECOMPUTE_MODES, nearest_multiples
from .schedules import VEE_SCHEDULES, ZB_SCHEDULES, check_pipeline
from .zero import validate as validate_zero

LAYOUT_CHOICES = ("auto",) + tuple(LAYOUTS)
DEFAULT_MIN_BATCH = 8      # a default batch is the smallest valid one of at least this many sequences


@dataclass(frozen=True)
class Resolved:
    """A plan after ``resolve``: every size checked, ``auto`` and the
    default batch decided. Builders read it and check nothing again."""

    plan: Plan
    cfg: ModelConfig            # the model as built (its n_ctx sizes the position table)
    world_size: int
    tp: int                     # tensor-parallel ranks: what dp x pp x cp leaves of the world
    layout: str                 # the resolved layout name (never "auto")
    batch_size: int             # global sequences per step (all micro-batches)
    seq_len: Optional[int] = None        # positions each sequence runs (None: not known, cfg.n_ctx at most)
    batch_note: Optional[str] = None     # how a default batch was chosen (None: given or kept)
    batch_kept: bool = False             # the saved batch (a resumed run's, a checkpoint's) was kept
    pipeline_note: Optional[str] = None  # a large bubble, said to the user (schedules.check_pipeline)
    tp_note: Optional[str] = None        # a tensor-parallel layout asked for on one tensor-parallel rank

    @property
    def cls(self):
        """The layout class."""
        return LAYOUTS[self.layout]

    @property
    def micro_batch(self) -> int:
        """Global sequences of one micro-batch (what the layout is built for)."""
        return self.batch_size // self.plan.grad_accum


def choose_layout(name: str, tp_size: int, depth: int = 1) -> str:
    """Resolve ``auto``: 2.5-D when a depth is given (only 2.5-D has one),
    else 3-D on a cube, 2-D on a square, 1-D otherwise."""
    if name != "auto":
        return name
    if depth > 1:
        return "2.5d"
    if tp_size == 1:
        return "serial"
    if integer_root(tp_size, 3):
        return "3d"
    if integer_root(tp_size, 2):
        return "2d"
    return "1d"


def validate_axes(grid: Plan) -> None:
    """Combinations of axes this build cannot run, refused with one line.
    Every pairing of dp, pp, cp and sequence parallelism composes now (the
    step driver cuts each micro-batch to this rank's positions whatever
    the pipeline does with it); what is left refused is --zero 2/3 with
    pp or cp (``zero.validate``) and sequence parallelism on a layout
    other than 1-D (``check_sequence_parallel``). Kept as the one place a
    future refusal of a pairing goes."""


def validate_hsdp(plan: Plan) -> None:
    """--hsdp R: R replicas of dp/R-way ZeRO-3 shard groups (parallel.fsdp
    inside a group, an all-reduce across them)."""
    R = plan.hsdp
    if R == 1:
        return
    fits = [r for r in range(2, plan.dp) if plan.dp % r == 0 and plan.dp // r > 1]
    if R < 1 or plan.dp % R or plan.dp // R < 2:
        raise ConfigError(f"--hsdp {R} must divide --dp {plan.dp} into replicas of 2 or more shards: use --hsdp "
                          + (f"one of {fits}" if fits else "1 (--dp has no such split)"))
    if plan.zero != 3:
        raise ConfigError(f"--hsdp {R} shards the weights ZeRO-3-wise inside each replica: use --zero 3 "
                          f"(got --zero {plan.zero})")
    if plan.ep != 1:
        raise ConfigError(f"--hsdp {R} with --ep {plan.ep}: the expert-data groups are not split into replicas "
                          f"here; drop --hsdp or --ep")


def validate_model(cfg: ModelConfig) -> None:
    """Sizes that no layout can run."""
    for name in ("vocab_size", "n_ctx", "n_layer", "n_head", "n_embd"):
        if getattr(cfg, name) < 1:
            raise ConfigError(f"{name} must be at least 1, got {getattr(cfg, name)}")
    if cfg.n_embd % cfg.n_head:
        heads = [d for d in range(1, cfg.n_embd + 1) if cfg.n_embd % d == 0]
        near = sorted(heads, key=lambda d: (abs(d - cfg.n_head), d))[:2]
        below = cfg.n_embd // cfg.n_head * cfg.n_head
        sizes = " or ".join(str(v) for v in (below, below + cfg.n_head) if v > 0)
        raise ConfigError(f"n_embd {cfg.n_embd} must be divisible by n_head {cfg.n_head} "
                          f"(each head gets n_embd/n_head columns): use --n-head "
                          f"{' or '.join(map(str, sorted(near)))}, or --n-embd {sizes}")


def check_moe(plan: Plan, cfg: ModelConfig, tp: int, name: str = "serial") -> None:
    """The sizes a mixture of experts needs: --ep dividing the experts and
    dp x cp (the ep ranks are taken from them). Every layout and axis
    runs it (docs/moe.md)."""
    if not cfg.moe:
        if plan.ep != 1:
            raise ConfigError(f"--ep {plan.ep} needs a mixture of experts (--n-experts, --arch mixtral)")
        return
    ep, E = plan.ep, cfg.n_experts
    if ep < 1:
        raise ConfigError(f"--ep must be at least 1, got {ep}")
    if E % ep:
        raise ConfigError(f"--ep {ep} must divide --n-experts {E}: use --ep "
                          f"{' or '.join(str(d) for d in range(1, E + 1) if E % d == 0 and (plan.dp * plan.cp) % d == 0)}")
    ranks = plan.dp * plan.cp         # the ep ranks come from dp x cp (folded as Megatron does)
    if ranks % ep:
        fits = (d for d in range(1, ranks + 1) if ranks % d == 0 and E % d == 0)
        raise ConfigError(f"--ep {ep} must divide --dp {plan.dp}" + (f" x --cp {plan.cp}" if plan.cp > 1 else "")
                          + f" (the expert-parallel ranks are data-parallel replicas"
                          + (" and context-parallel ranks" if plan.cp > 1 else "")
                          + f"): use --ep {' or '.join(map(str, fits))}")


LATENT_LAYOUTS = ("serial", "1d", "2d", "2.5d", "3d")      # where --arch deepseek_v3's latent attention runs so far


def check_latent(plan: Plan, cfg: ModelConfig, tp: int, name: str) -> None:
    """Multi-head latent attention (--arch deepseek_v3) runs on every
    layout (heads split as each splits them; on 2-D, 2.5-D and 3-D the
    latents split as the hidden size, so their ranks must divide), with
    dp, pp, cp, zero and 1-D's --sequence-parallel."""
    if not cfg.mla:
        return
    if tp > 1 and name not in LATENT_LAYOUTS:
        raise ConfigError(f"--arch deepseek_v3 runs on layouts {', '.join(LATENT_LAYOUTS)} (with --dp, --pp, "
                          f"--cp, --zero) so far, not {name}: use --layout 1d, 2d or 2.5d")
    if name in ("2d", "2.5d", "3d") and tp > 1:     # the latents split as the hidden size: q ways (3-D's weights q^2)
        q = math.isqrt(tp // plan.depth) if name != "3d" else round(tp ** (1 / 3))
        split = q * q if name == "3d" else q
        for option, rank in (("--kv-lora-rank", cfg.kv_lora_rank), ("--q-lora-rank", cfg.q_lora_rank)):
            if rank % split:
                raise ConfigError(f"{option} {rank} must be divisible by {split} on layout {name} "
                                  f"(a latent is split as the hidden size is): use {option} "
                                  f"{nearest_multiples(rank, split)}")


def resolve(plan, cfg: ModelConfig, batch_size: Optional[int], world_size: int, *, seq_len: Optional[int] = None,
            saved: Optional[int] = None, at_least: int = DEFAULT_MIN_BATCH) -> Resolved:
    """The single validation of a run: ``plan`` (a Plan or a layout name)
    against the model ``cfg`` run on sequences of ``seq_len`` positions
    (None: cfg.n_ctx), ``world_size`` ranks and the global ``batch_size``.
    Without a batch: the ``saved`` one (a resumed run's, a checkpoint's)
    if the plan takes it, else the smallest of at least ``at_least`` that
    it takes. Pure: no MPI. Raises ConfigError, one line naming the
    nearest valid values."""
    plan = Plan.of(plan)
    validate_zero(plan.zero, plan.dp, plan.pp, plan.cp)
    validate_hsdp(plan)
    validate_axes(plan)
    validate_model(cfg)
    run_cfg = cfg if seq_len is None else replace(cfg, n_ctx=seq_len)    # what the T-dependent sizes see
    cls, name, tp, note = _check_choices(plan, run_cfg, world_size)
    check_moe(plan, cfg, tp, name)
    check_latent(plan, cfg, tp, name)
    kept, why = False, None
    if batch_size is None:
        batch_size, kept, why = _choose_batch(plan, cls, name, run_cfg, tp, saved, at_least)
    _check_batch(plan, cls, name, run_cfg, tp, batch_size)
    if plan.sequence_parallel:
        check_sequence_parallel(plan, cls, name, run_cfg, tp)
    check_fp8(plan.fp8, run_cfg, cls, tp, plan.depth, plan.cp, plan.dp, plan.cp_kind, plan.ep)
    return Resolved(plan, cfg, world_size, tp, name, batch_size, seq_len, why, kept, note,
                    one_rank_note(plan, name, tp, world_size))


SMALLEST_TP = {"1d": 2, "2d": 4, "3d": 8}      # 2.5d: 4 x depth (q = 2)


def one_rank_note(plan, name: str, tp: int, world_size: int) -> Optional[str]:
    """A line for ``--layout 1d|2d|2.5d|3d`` that got one tensor-parallel
    rank (``mpicube train --layout 3d`` without mpiexec runs the serial
    model and says nothing else): the world it probably meant, the
    smallest that layout splits (q = 2), times the other axes."""
    if tp != 1 or plan.layout != name or name not in (*SMALLEST_TP, "2.5d"):
        return None
    smallest = SMALLEST_TP.get(name, 4 * plan.depth)
    others = world_size                       # tp 1: the world is dp x pp x cp
    return (f"layout {name} on {world_size} rank(s) has 1 tensor-parallel rank: it runs as the serial model; "
            f"its smallest split takes {smallest} tensor-parallel ranks: mpiexec -n {smallest * others}")


def _check_choices(plan: Plan, cfg: ModelConfig, world_size: int) -> tuple:
    """(layout class, name, tp, pipeline note): every check but the batch's."""
    if plan.recompute not in RECOMPUTE_MODES:
        raise ConfigError(f"unknown recompute mode {plan.recompute!r}; choose one of {', '.join(RECOMPUTE_MODES)}")
    if plan.attention not in ATTENTION_KINDS:
        raise ConfigError(f"unknown attention {plan.attention!r}; choose one of {', '.join(ATTENTION_KINDS)}")
    tp = plan.tp(world_size)
    note = check_pipeline(cfg.n_layer, plan.pp, plan.pp_schedule, plan.virtual_stages, plan.grad_accum)
    if plan.pp_schedule in ZB_SCHEDULES and plan.zero >= 2:
        raise ConfigError(f"--pp-schedule {plan.pp_schedule} defers weight gradients past the block's backward, "
                          f"where --zero {plan.zero} reduce-scatters them: use --zero 0 or 1, or --pp-schedule 1f1b")
    if cfg.mtp_depth and plan.pp > 1 and plan.pp_schedule in VEE_SCHEDULES:
        raise ConfigError(f"--mtp-depth runs its modules on the last pipeline stage, and --pp-schedule "
                          f"{plan.pp_schedule} folds the model's end back onto stage 0: use --pp-schedule zb-h1 "
                          f"or 1f1b")
    name = choose_layout(plan.layout, tp, plan.depth)
    if name not in LAYOUTS:
        raise ConfigError(f"unknown layout {plan.layout!r}; choose one of {', '.join(LAYOUT_CHOICES)}")
    if plan.depth != 1 and name != "2.5d":          # before anything asks the layout for its grid
        raise ConfigError(f"--depth {plan.depth} applies to the 2.5d layout only (layout {name}): "
                          f"drop --depth, or use --layout 2.5d")
    ulysses.validate(plan, cfg, LAYOUTS[name].head_coords(tp, plan.depth, 0)[0])
    context.validate(cfg.n_ctx, plan.cp, plan.ulysses_size)
    if plan.grad_accum < 1:
        raise ConfigError(f"--grad-accum must be at least 1, got {plan.grad_accum}")
    return LAYOUTS[name], name, tp, note


def _check_batch(plan: Plan, cls, name: str, cfg: ModelConfig, tp: int, batch_size: int) -> None:
    """The global batch against dp, the micro-batches and the layout."""
    dp, accum, depth = plan.dp, plan.grad_accum, plan.depth
    if batch_size % dp:
        raise ConfigError(f"--batch-size {batch_size} must be divisible by --dp {dp}")
    per_replica = batch_size // dp
    if per_replica % accum:
        divisors = [d for d in range(1, per_replica + 1) if per_replica % d == 0]
        raise ConfigError(f"--grad-accum {accum} must divide the batch per replica {per_replica} "
                          f"(--batch-size {batch_size} / --dp {dp}): use --batch-size "
                          f"{nearest_multiples(batch_size, dp * accum)}, or --grad-accum one of {divisors}")
    micro = per_replica // accum
    if accum > 1:
        split = micro_split(cls, cfg, tp, depth, plan.recompute)
        if micro % split:
            raise ConfigError(f"layout {name}: the micro-batch per replica {micro} (--batch-size {batch_size} "
                              f"/ --dp {dp} / --grad-accum {accum}) must be divisible by {split}: use "
                              f"--batch-size {nearest_multiples(batch_size, dp * accum * split)}")
    cls.validate(cfg, tp, micro, depth, plan.recompute)


def _choose_batch(plan: Plan, cls, name: str, cfg: ModelConfig, tp: int, saved, at_least: int) -> tuple:
    """(batch, kept, why) when none is given: ``saved`` if the plan takes
    it, else the smallest multiple of the accepted step of at least
    ``at_least``. Why: a fixed default of 8 cannot run on 64 ranks in 3-D
    (q^2 = 16 sequences per replica at least)."""
    if saved:
        try:
            _check_batch(plan, cls, name, cfg, tp, int(saved))
            return int(saved), True, None
        except ConfigError:
            pass
    m = plan.dp * plan.grad_accum * micro_split(cls, cfg, tp, plan.depth, plan.recompute)
    batch = -(-at_least // m) * m
    extra = plan.words() + (f", grad-accum {plan.grad_accum}" if plan.grad_accum != 1 else "")
    return batch, False, f"batch {batch} (smallest of at least {at_least} that layout {name}, tp {tp}{extra} accepts)"


def check_sequence_parallel(grid: Plan, cls, resolved: str, cfg: ModelConfig, tp: int) -> None:
    """--sequence-parallel: the 1-D layout, T/cp (the positions a context-
    parallel rank holds, T without cp) divisible by tp. Under --cp the tp
    ranks split the cp rank's two chunks into tp runs, so the 2C chunks
    need not divide by tp one by one."""
    if resolved != "1d":
        raise ConfigError(f"--sequence-parallel applies to the 1d layout only (layout {resolved}): "
                          f"use --layout 1d, or drop --sequence-parallel")
    if grid.cp > 1 and (cfg.n_ctx // grid.cp) % tp:
        step = 2 * grid.cp * tp // math.gcd(2, tp)      # T must be a multiple of 2C and of C x tp
        raise ConfigError(f"--sequence-parallel with --cp {grid.cp} splits the {cfg.n_ctx // grid.cp} positions "
                          f"of a context-parallel rank over the {tp} tensor-parallel ranks: use a sequence "
                          f"length (--seq-len) of {nearest_multiples(cfg.n_ctx, step)}")
    cls.validate_sequence(cfg, tp, cfg.n_ctx, grid.recompute)


def micro_split(cls, cfg: ModelConfig, tp: int, depth: int, recompute: str = "none") -> int:
    """The smallest batch per replica (per micro-batch) that layout ``cls``
    accepts for this model; the accepted ones are its multiples (every
    layout's batch constraint is a divisibility: 1, d*q or q^2, all dividing
    tp). Raises the layout's ConfigError for what no batch can fix."""
    cls.validate(cfg, tp, tp, depth, recompute)    # a multiple of every split: only the model can fail
    for split in range(1, tp + 1):
        if tp % split == 0:
            try:
                cls.validate(cfg, tp, split, depth, recompute)
                return split
            except ConfigError:
                continue
    return tp
