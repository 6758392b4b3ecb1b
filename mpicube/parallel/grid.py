"""From the MPI world to a layout: a GridSpec's axes (gridspec.py gives
the rank order, tensor-parallel ranks innermost) become one communicator
each. All sizes are validated before the first collective, so a bad size
gives the same error on every rank and no rank waits in a communicator
split.
"""

from __future__ import annotations

from mpi4py import MPI

from ..device.backend import Backend
from .comm import Comm, Counters
from ..core.config import ModelConfig
from ..core.errors import ConfigError
from ..core.intmath import integer_root
from . import context
from .layouts import LAYOUTS
from .gridspec import GridSpec
from .schedules import check_pipeline
from .layouts.base import RECOMPUTE_MODES, Axes, nearest_multiples

LAYOUT_CHOICES = ("auto",) + tuple(LAYOUTS)
DEFAULT_MIN_BATCH = 8      # a default batch is the smallest valid one of at least this many sequences


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


def validate_axes(grid: GridSpec) -> None:
    """Combinations of axes this build cannot run, refused with one line
    (pure: TrainOptions.validate calls it before any communicator)."""
    if grid.pp > 1 and grid.cp > 1:
        raise ConfigError(f"--pp {grid.pp} with --cp {grid.cp}: pipeline stages and context parallelism do not "
                          f"compose yet; use one of them (--pp 1 or --cp 1)")


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


def plan(grid, cfg: ModelConfig, batch_size: int, world_size: int, grad_accum: int = 1, recompute: str = "none"):
    """(layout class, resolved name, tp size) after validating every size;
    pure: no MPI. ``grid`` is a GridSpec (or a layout name). ``batch_size``
    is the step's global batch; with ``grad_accum`` N the layout runs
    micro-batches of batch_size / N sequences, and the layout's constraints
    apply to those (and, for ``recompute``, the sizes that mode needs)."""
    grid = GridSpec.of(grid)
    validate_model(cfg)
    if recompute not in RECOMPUTE_MODES:
        raise ConfigError(f"unknown recompute mode {recompute!r}; choose one of {', '.join(RECOMPUTE_MODES)}")
    tp = grid.tp(world_size)
    validate_axes(grid)
    check_pipeline(cfg.n_layer, grid.pp, grid.pp_schedule, grid.virtual_stages, grad_accum)
    context.validate(cfg.n_ctx, grid.cp)
    dp, depth = grid.dp, grid.depth
    resolved = choose_layout(grid.layout, tp, depth)
    if resolved not in LAYOUTS:
        raise ConfigError(f"unknown layout {grid.layout!r}; choose one of {', '.join(LAYOUT_CHOICES)}")
    if grad_accum < 1:
        raise ConfigError(f"--grad-accum must be at least 1, got {grad_accum}")
    if batch_size % dp:
        raise ConfigError(f"--batch-size {batch_size} must be divisible by --dp {dp}")
    if depth != 1 and resolved != "2.5d":
        raise ConfigError(f"--depth {depth} applies to the 2.5d layout only (layout {resolved}): "
                          f"drop --depth, or use --layout 2.5d")
    cls = LAYOUTS[resolved]
    per_replica = batch_size // dp
    if per_replica % grad_accum:
        divisors = [d for d in range(1, per_replica + 1) if per_replica % d == 0]
        raise ConfigError(f"--grad-accum {grad_accum} must divide the batch per replica {per_replica} "
                          f"(--batch-size {batch_size} / --dp {dp}): use --batch-size "
                          f"{nearest_multiples(batch_size, dp * grad_accum)}, or --grad-accum one of {divisors}")
    micro = per_replica // grad_accum
    if grad_accum > 1:
        split = micro_split(cls, cfg, tp, depth, recompute)
        if micro % split:
            raise ConfigError(f"layout {resolved}: the micro-batch per replica {micro} (--batch-size {batch_size} "
                              f"/ --dp {dp} / --grad-accum {grad_accum}) must be divisible by {split}: use "
                              f"--batch-size {nearest_multiples(batch_size, dp * grad_accum * split)}")
    cls.validate(cfg, tp, micro, depth, recompute)
    if grid.sequence_parallel:
        check_sequence_parallel(grid, cls, resolved, cfg, tp, recompute)
    return cls, resolved, tp


def check_sequence_parallel(grid, cls, resolved: str, cfg: ModelConfig, tp: int, recompute: str) -> None:
    """--sequence-parallel: the 1-D layout, alone with dp, T divisible by tp."""
    if resolved != "1d":
        raise ConfigError(f"--sequence-parallel applies to the 1d layout only (layout {resolved}): "
                          f"use --layout 1d, or drop --sequence-parallel")
    for name in ("pp", "cp"):
        if getattr(grid, name) > 1:
            raise ConfigError(f"--sequence-parallel with --{name} {getattr(grid, name)} is not built yet; "
                              f"use --{name} 1")
    cls.validate_sequence(cfg, tp, cfg.n_ctx, recompute)


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


def batch_multiple(grid, cfg: ModelConfig, world_size: int, grad_accum: int = 1, recompute: str = "none") -> tuple:
    """(m, resolved layout, tp): the global batch sizes ``plan`` accepts
    for this grid and gradient accumulation are the multiples of m."""
    grid = GridSpec.of(grid)
    tp = grid.tp(world_size)
    resolved = choose_layout(grid.layout, tp, grid.depth)
    plan(grid, cfg, grid.dp * grad_accum * tp, world_size, grad_accum, recompute)   # every non-batch error
    return grid.dp * grad_accum * micro_split(LAYOUTS[resolved], cfg, tp, grid.depth, recompute), resolved, tp


def default_batch(grid, cfg: ModelConfig, world_size: int, grad_accum: int = 1, at_least: int = DEFAULT_MIN_BATCH,
                  recompute: str = "none") -> tuple:
    """(batch, why): the smallest global batch of at least ``at_least``
    sequences that the layout accepts, and the words that announce it.
    Why: a fixed default of 8 cannot run on 64 ranks in 3-D (q^2 = 16
    sequences per replica at least), so ``mpirun -n 64 mpicube train``
    would stop at once; pure, so every rank picks the same size."""
    grid = GridSpec.of(grid)
    m, resolved, tp = batch_multiple(grid, cfg, world_size, grad_accum, recompute)
    batch = -(-at_least // m) * m
    extra = grid.words() + (f", grad-accum {grad_accum}" if grad_accum != 1 else "")
    return batch, f"batch {batch} (smallest of at least {at_least} that layout {resolved}, tp {tp}{extra} accepts)"


def saved_or_default_batch(saved, grid, cfg: ModelConfig, world_size: int, grad_accum: int = 1,
                           recompute: str = "none") -> tuple:
    """(batch, kept, why) when no --batch-size is given: a model file's own
    training batch ``saved`` (None if it records none) if this layout takes
    it (kept True, why None), else ``default_batch`` and its words. The
    trainer (resuming) and ``mpicube eval`` both choose this way, so a run
    keeps its data order wherever it can."""
    if saved:
        try:
            plan(grid, cfg, int(saved), world_size, grad_accum, recompute)
            return int(saved), True, None
        except ConfigError:
            pass
    batch, why = default_batch(grid, cfg, world_size, grad_accum, recompute=recompute)
    return batch, False, why


def build_layout(grid, cfg: ModelConfig, batch_size: int, backend: Backend, mpi_world,
                 counters: Counters = None, grad_accum: int = 1, recompute: str = "none"):
    """Validate, then split the world into one communicator per axis (the
    order of gridspec.py) and construct the layout object, for the
    micro-batch (``batch_size / grad_accum`` global sequences) that one
    forward pass runs. Every axis gets a communicator, of size 1 where the
    axis is unused, so no code asks whether an axis exists."""
    grid = GridSpec.of(grid)
    cls, resolved, tp = plan(grid, cfg, batch_size, mpi_world.Get_size(), grad_accum, recompute)
    counters = counters if counters is not None else Counters()
    d, p, c, t = grid.coords(mpi_world.Get_rank(), mpi_world.Get_size())

    def split(axis: str, color: tuple, key: int) -> Comm:
        # color: the coordinates of every other axis, as one integer
        flat = 0
        for value, size in zip(color, (grid.dp, grid.pp, grid.cp, tp)):
            flat = flat * size + value
        return Comm(mpi_world.Split(color=flat, key=key), axis, backend, counters)

    axes = Axes(world=Comm(mpi_world, "world", backend, counters),
                dp=split("dp", (0, p, c, t), d),
                tp=split("tp", (d, p, c, 0), t),
                pp=split("pp", (d, 0, c, t), p),
                cp=split("cp", (d, p, 0, t), c))
    extra = {"sequence_parallel": True} if grid.sequence_parallel else {}
    return cls(cfg, axes, batch_size // grad_accum, depth=grid.depth, recompute=recompute, **extra)


def tied_pair(axes: Axes):
    """The pair of pipeline stages that hold the tied ``wte`` (stage 0, the
    lookup; stage P-1, the head) at this rank's (d, c, t), as a Comm on
    axis "tied"; None on the other stages and without stages. Collective
    over ``axes.pp``: every stage calls it."""
    pp = axes.pp
    if pp.size == 1:
        return None
    inside = pp.rank in (0, pp.size - 1)
    sub = pp.mpi.Split(color=0 if inside else MPI.UNDEFINED, key=pp.rank)
    return Comm(sub, "tied", pp.backend, pp.counters) if inside else None
