"""From the MPI world to a layout: a resolved plan's axes (gridspec.py
gives the rank order, tensor-parallel ranks innermost) become one
communicator each. Every size was validated by ``planning.resolve``
before the first collective, so a bad size gives the same error on every
rank and no rank waits in a communicator split; nothing here checks again.

``plan``, ``default_batch`` and ``saved_or_default_batch`` are the older
entry points of that validation, for the cost reports (which try many
hypothetical plans) and the API: each is one ``resolve``.
"""

from __future__ import annotations

from mpi4py import MPI

from ..core.config import ModelConfig
from ..core.intmath import integer_root  # noqa: F401 (re-exported for tools and reports)
from .comm import Comm, Counters
from .gridspec import Plan, hsdp_coords
from .layouts.base import Axes
from .planning import (DEFAULT_MIN_BATCH, LAYOUT_CHOICES, Resolved, check_sequence_parallel,  # noqa: F401
                       choose_layout, micro_split, resolve, validate_axes, validate_model)


def _with_modes(grid, grad_accum, recompute) -> Plan:
    """``grid`` as a Plan, with the loose grad-accum and recompute of the older signatures (None: the plan's)."""
    grid = Plan.of(grid)
    changes = {k: v for k, v in (("grad_accum", grad_accum), ("recompute", recompute)) if v is not None}
    return grid.but(**changes) if changes else grid


def plan(grid, cfg: ModelConfig, batch_size: int, world_size: int, grad_accum: int = None, recompute: str = None):
    """(layout class, resolved name, tp) of ``resolve``; ``grid`` is a Plan
    or a layout name, ``grad_accum``/``recompute`` override its own."""
    run = resolve(_with_modes(grid, grad_accum, recompute), cfg, batch_size, world_size)
    return run.cls, run.layout, run.tp


def default_batch(grid, cfg: ModelConfig, world_size: int, grad_accum: int = None, at_least: int = DEFAULT_MIN_BATCH,
                  recompute: str = None) -> tuple:
    """(batch, why): the smallest global batch of at least ``at_least``
    sequences that the plan accepts, and the words that announce it."""
    run = resolve(_with_modes(grid, grad_accum, recompute), cfg, None, world_size, at_least=at_least)
    return run.batch_size, run.batch_note


def saved_or_default_batch(saved, grid, cfg: ModelConfig, world_size: int, grad_accum: int = None,
                           recompute: str = None) -> tuple:
    """(batch, kept, why) when no --batch-size is given: ``saved`` (None if
    there is none) if this plan takes it (kept True, why None), else
    ``default_batch`` and its words."""
    run = resolve(_with_modes(grid, grad_accum, recompute), cfg, None, world_size, saved=saved)
    return run.batch_size, run.batch_kept, run.batch_note


def build_layout(run: Resolved, backend, mpi_world, counters: Counters = None, recorder=None):
    """Split the world into one communicator per axis (the order of
    gridspec.py) and construct the layout object of the resolved plan
    ``run``, for the micro-batch (``batch_size / grad_accum`` global
    sequences) that one forward pass runs. Every axis gets a
    communicator, of size 1 where the axis is unused, so no code asks
    whether an axis exists. ``recorder`` (``profiler.Recorder``, under
    ``--profile``) goes to the world Comm, and every axis split from it
    inherits it (``Comm.split``)."""
    grid, tp = run.plan, run.tp
    counters = counters if counters is not None else Counters()
    d, p, c, t = grid.coords(mpi_world.Get_rank(), mpi_world.Get_size())

    world = Comm(mpi_world, "world", backend, counters, recorder=recorder)

    def split(axis: str, color: tuple, key: int) -> Comm:
        # color: the coordinates of every other axis, as one integer
        flat = 0
        for value, size in zip(color, (grid.dp, grid.pp, grid.cp, tp)):
            flat = flat * size + value
        return world.split(axis, flat, key)

    axes = Axes(world=world,
                dp=split("dp", (0, p, c, t), d),
                tp=split("tp", (d, p, c, 0), t),
                pp=split("pp", (d, 0, c, t), p),
                cp=split("cp", (d, p, 0, t), c))
    if grid.hsdp > 1:                    # --hsdp R: shard groups of dp/R consecutive replicas, R of them
        group, shard = hsdp_coords(d, grid.dp, grid.hsdp)
        axes.dp_shard = axes.dp.split("dp", group, shard)        # ZeRO-3 inside (the "dp" of fsdp's collectives)
        axes.dp_replica = axes.dp.split("hsdp", shard, group)    # the chunk's all-reduce across replicas
    U = grid.ulysses_size                # --cp-kind ulysses/hybrid: groups of U consecutive cp ranks
    axes.cp.ulysses = U                  # read by context.local_positions (through context.ulysses_of)
    if U > 1:
        axes.cp_group = axes.cp.split("ulysses", c // U, c % U)   # the all-to-all's ranks (parallel/ulysses.py)
        axes.cp_ring = axes.cp.split("cp", c % U, c // U)         # the ring over the groups, same heads
    ep = grid.ep                         # --ep: groups of ep consecutive replicas (parallel/experts.py)
    group, ep_rank, edp_rank = ep_coords(grid, d, c)
    if ep > 1 and grid.cp > 1:           # folded into dp x cp, as Megatron does: q = d cp + c
        plane = split("dpcp", (0, p, 0, t), d * grid.cp + c)
        axes.ep = plane.split("ep", group, ep_rank)
        axes.edp = plane.split("edp", ep_rank, edp_rank)
    else:
        axes.ep = axes.dp.split("ep", group, ep_rank)
        axes.edp = axes.dp.split("edp", ep_rank, edp_rank) if ep > 1 else axes.dp   # ep 1: every replica
    extra = {"sequence_parallel": True} if grid.sequence_parallel else {}
    return run.cls(run.cfg, axes, run.micro_batch, depth=grid.depth, recompute=grid.recompute,
                   overlap=grid.overlap, attention=grid.attention, fp8=grid.fp8, **extra)


def ep_coords(grid, d: int, c: int) -> tuple:
    """(ep group, ep rank, expert-data rank) of replica ``d``'s context
    rank ``c``: groups of ep consecutive replicas (d // ep, d % ep), or
    under --ep with --cp of ep consecutive q = d cp + c (the fold); the
    expert-data group is the ranks of the same ep rank. Pure, so
    ``analysis.costplace`` draws from it what ``build_layout`` splits."""
    ep = grid.ep
    q = d * grid.cp + c if ep > 1 and grid.cp > 1 else d
    return q // ep, q % ep, q // ep


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
    return pp.derive(sub, "tied") if inside else None
