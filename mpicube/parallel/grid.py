"""From the MPI world to a layout: data-parallel x tensor-parallel axes.

world = dp x tp with the tensor-parallel ranks innermost (contiguous), so a
tensor-parallel group sits on as few nodes as possible: world rank
``d * tp + t`` is replica d, tensor-parallel rank t. All sizes are validated
before the first collective, so a bad size gives the same error on every rank
and no rank waits in a communicator split.
"""

from __future__ import annotations

from ..device.backend import Backend
from .comm import Comm, Counters
from ..core.config import ModelConfig
from ..core.errors import ConfigError
from ..core.intmath import integer_root
from .layouts import LAYOUTS
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


def split_world(world_size: int, dp: int) -> int:
    """Tensor-parallel size for ``dp`` replicas, or a ConfigError."""
    if dp < 1 or world_size % dp:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ConfigError(f"--dp {dp} must divide the world size {world_size}; choose one of {divisors}")
    return world_size // dp


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


def plan(name: str, cfg: ModelConfig, batch_size: int, world_size: int, dp: int = 1, depth: int = 1,
         grad_accum: int = 1, recompute: str = "none"):
    """(layout class, resolved name, tp size) after validating every size;
    pure: no MPI. ``batch_size`` is the step's global batch; with
    ``grad_accum`` N the layout runs micro-batches of batch_size / N
    sequences, and the layout's constraints apply to those (and, for
    ``recompute``, the sizes that mode needs)."""
    validate_model(cfg)
    if recompute not in RECOMPUTE_MODES:
        raise ConfigError(f"unknown recompute mode {recompute!r}; choose one of {', '.join(RECOMPUTE_MODES)}")
    tp = split_world(world_size, dp)
    resolved = choose_layout(name, tp, depth)
    if resolved not in LAYOUTS:
        raise ConfigError(f"unknown layout {name!r}; choose one of {', '.join(LAYOUT_CHOICES)}")
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
    return cls, resolved, tp


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


def batch_multiple(name: str, cfg: ModelConfig, world_size: int, dp: int = 1, depth: int = 1,
                   grad_accum: int = 1, recompute: str = "none") -> tuple:
    """(m, resolved layout, tp): the global batch sizes ``plan`` accepts
    for this layout, dp and gradient accumulation are the multiples of m."""
    tp = split_world(world_size, dp)
    resolved = choose_layout(name, tp, depth)
    plan(name, cfg, dp * grad_accum * tp, world_size, dp, depth, grad_accum, recompute)   # every non-batch error
    return dp * grad_accum * micro_split(LAYOUTS[resolved], cfg, tp, depth, recompute), resolved, tp


def default_batch(name: str, cfg: ModelConfig, world_size: int, dp: int = 1, depth: int = 1,
                  grad_accum: int = 1, at_least: int = DEFAULT_MIN_BATCH, recompute: str = "none") -> tuple:
    """(batch, why): the smallest global batch of at least ``at_least``
    sequences that the layout accepts, and the words that announce it.
    Why: a fixed default of 8 cannot run on 64 ranks in 3-D (q^2 = 16
    sequences per replica at least), so ``mpirun -n 64 mpicube train``
    would stop at once; pure, so every rank picks the same size."""
    m, resolved, tp = batch_multiple(name, cfg, world_size, dp, depth, grad_accum, recompute)
    batch = -(-at_least // m) * m
    extra = "".join(f", {k} {v}" for k, v in (("dp", dp), ("depth", depth), ("grad-accum", grad_accum)) if v != 1)
    return batch, f"batch {batch} (smallest of at least {at_least} that layout {resolved}, tp {tp}{extra} accepts)"


def saved_or_default_batch(saved, name: str, cfg: ModelConfig, world_size: int, dp: int = 1, depth: int = 1,
                           grad_accum: int = 1, recompute: str = "none") -> tuple:
    """(batch, kept, why) when no --batch-size is given: a model file's own
    training batch ``saved`` (None if it records none) if this layout takes
    it (kept True, why None), else ``default_batch`` and its words. The
    trainer (resuming) and ``mpicube eval`` both choose this way, so a run
    keeps its data order wherever it can."""
    if saved:
        try:
            plan(name, cfg, int(saved), world_size, dp, depth, grad_accum, recompute)
            return int(saved), True, None
        except ConfigError:
            pass
    batch, why = default_batch(name, cfg, world_size, dp, depth, grad_accum, recompute=recompute)
    return batch, False, why


def build_layout(name: str, cfg: ModelConfig, batch_size: int, backend: Backend, mpi_world,
                 dp: int = 1, depth: int = 1, counters: Counters = None, grad_accum: int = 1,
                 recompute: str = "none"):
    """Validate, then split the world and construct the layout object, for
    the micro-batch (``batch_size / grad_accum`` global sequences) that
    one forward pass runs."""
    cls, resolved, tp = plan(name, cfg, batch_size, mpi_world.Get_size(), dp, depth, grad_accum, recompute)
    counters = counters if counters is not None else Counters()
    rank = mpi_world.Get_rank()
    dp_rank, tp_rank = divmod(rank, tp)
    world = Comm(mpi_world, "world", backend, counters)
    tp_comm = Comm(mpi_world.Split(color=dp_rank, key=tp_rank), "tp", backend, counters)
    dp_comm = Comm(mpi_world.Split(color=tp_rank, key=dp_rank), "dp", backend, counters)
    return cls(cfg, Axes(world=world, dp=dp_comm, tp=tp_comm), batch_size // grad_accum, depth=depth,
               recompute=recompute)
