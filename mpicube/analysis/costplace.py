"""``info --experts``: where every expert and each shard of it sits, rank
by rank, and one dispatch step's all-to-all, drawn from the code's own
rules rather than a rule written again here.

How, without MPI: each rank's layout object is built by its own class
(``Resolved.cls``, the constructor ``grid.build_layout`` calls) on paper
communicators (``Paper``: a size and a rank, ``split`` answering with
more paper), so the layout derives its grid coordinates (1-D's t, 2-D and
2.5-D's (l, r, c), the cube's (i, j, k)) and its sequences as it does in
a run; its ep coordinates come from ``grid.ep_coords``, the rule
``build_layout`` splits by; ``experts.model_specs`` then picks and shards
the rank's experts with the layout's ``shard``: the ParamSpec indices a
run's store holds (``tests/parallel_check.py`` checks each rank's row
against its store). The all-to-all: each ep rank's tokens routed by
``ops.moe.route`` on seeded random logits, kept by ``ops.moe.dispatch``,
sent by ``experts.Dispatch.destinations``.
"""

from __future__ import annotations

import numpy as np

from ..ops import moe as router_ops
from ..parallel.experts import Dispatch, expert_of, local_experts, model_specs
from ..parallel.grid import ep_coords
from ..parallel.layouts.base import Axes
from ..parallel.schedules import layer_split


class Paper:
    """A communicator on paper: what a layout's constructor and ``shard``
    read of one (size, rank; a split's members are not worked out: no
    shard index depends on them)."""

    backend = None

    def __init__(self, axis: str, size=None, rank=None):
        self.axis, self.size, self.rank = axis, size, rank

    def split(self, axis: str, color, key) -> "Paper":
        return Paper(axis)


def rank_layout(run, rank: int):
    """(layout, (d, p, c, t), (ep group, ep rank)) of world rank ``rank``
    of the resolved plan ``run``, built on paper."""
    plan = run.plan
    d, p, c, t = plan.coords(rank, run.world_size)
    group, ep_rank, edp_rank = ep_coords(plan, d, c)
    axes = Axes(world=Paper("world", run.world_size, rank), dp=Paper("dp", plan.dp, d), tp=Paper("tp", run.tp, t),
                pp=Paper("pp", plan.pp, p), cp=Paper("cp", plan.cp, c), ep=Paper("ep", plan.ep, ep_rank),
                edp=Paper("edp", plan.dp * plan.cp // plan.ep, edp_rank))
    extra = {"sequence_parallel": True} if plan.sequence_parallel else {}
    layout = run.cls(run.cfg, axes, run.micro_batch, depth=plan.depth, recompute=plan.recompute, **extra)
    return layout, (d, p, c, t), (group, ep_rank)


def grid_words(layout) -> str:
    """The layout's own coordinates of this rank: 't', '(l, r, c)' or '(i, j, k)'."""
    for names in (("i", "j", "k"), ("l", "r", "c"), ("t",)):
        if all(hasattr(layout, n) for n in names):
            return ",".join(str(getattr(layout, n)) for n in names)
    return "-"


def spans(index) -> str:
    """Global indices as runs: '0..7167 | 14336..21503'."""
    index = np.asarray(index)
    if index.size == 0:
        return "-"
    breaks = np.flatnonzero(np.diff(index) != 1) + 1
    return " | ".join(f"{run[0]}..{run[-1]}" for run in np.split(index, breaks))


def placement_rows(run) -> list:
    """One dict per world rank: its coordinates, ep rank, the layers its
    stage holds, its experts, and per expert the (rows, columns) of
    ``c_fc`` ([gate | up]) and of ``c_proj`` it holds, the copies of that
    shard inside the tp group, and the ranks its gradients are summed with
    (the expert-data group: same stage, tp rank and ep rank)."""
    from ..model.moe import moe_params

    cfg, plan = run.cfg, run.plan
    chunks = layer_split(cfg.n_layer, plan.pp * plan.virtual_stages)
    out, keys = [], []
    for rank in range(run.world_size):
        layout, (d, p, c, t), (group, ep_rank) = rank_layout(run, rank)
        specs = [s for s in model_specs(layout, moe_params(cfg, 0, 0.02, 0.02)) if getattr(s, "expert", False)]
        experts = sorted({expert_of(s.name) for s in specs})
        assert experts == list(local_experts(cfg.n_experts, layout.axes.ep))
        by = {s.name: s for s in specs}
        fc, proj = (by[f"h.0.moe.experts.{experts[0]}.{n}.weight"] for n in ("c_fc", "c_proj"))
        layers = [i for v in range(plan.virtual_stages) for i in chunks[v * plan.pp + p]]
        out.append({"rank": rank, "d": d, "p": p, "c": c, "t": t, "grid": grid_words(layout), "ep": ep_rank,
                    "layers": layers, "experts": experts, "c_fc": fc.index, "c_proj": proj.index,
                    "copies": fc.replicas})
        keys.append((p, t, ep_rank))
    for row, key in zip(out, keys):
        row["summed"] = [r["rank"] for r, k in zip(out, keys) if k == key and r["rank"] != row["rank"]]
    return out


def placement_table(run) -> str:
    """``info --experts``: ``placement_rows`` as a table."""
    plan, cfg = run.plan, run.cfg
    coords = {"1d": "t", "2d": "l,r,c", "2.5d": "l,r,c", "3d": "i,j,k"}.get(run.layout, "-")
    axes = f"dp {plan.dp}" + (f" x pp {plan.pp}" if plan.pp > 1 else "") + (f" x cp {plan.cp}" if plan.cp > 1 else "")
    lines = [f"experts on {run.world_size} ranks ({axes} x tp {run.tp}, --ep {plan.ep}"
             + (" of dp x cp" if plan.ep > 1 and plan.cp > 1 else "") + f"): "
             f"rank = ((d pp + p) cp + c) tp + t; layout {run.layout}, grid coordinates ({coords})",
             f"  c_fc (h, 2F) = [gate | up], c_proj (F, h); h {cfg.n_embd}, F {cfg.ffn}; each row: rows x columns",
             "  rank   d  p  c  t  grid    ep  layers   experts  c_fc rows x [gate | up] columns          "
             "c_proj rows x columns       copies  gradients summed with"]
    for r in placement_rows(run):
        fc, proj = r["c_fc"], r["c_proj"]
        layers = f"{r['layers'][0]}..{r['layers'][-1]}" if r["layers"] else "-"
        experts = f"{r['experts'][0]}..{r['experts'][-1]}"
        summed = ", ".join(map(str, r["summed"])) if r["summed"] else "-"
        lines.append(f"  {r['rank']:4d} {r['d']:3d} {r['p']:2d} {r['c']:2d} {r['t']:2d}  {r['grid']:<7} {r['ep']:2d}  "
                     f"{layers:<8} {experts:<8} " + f"{spans(fc[0])} x {spans(fc[1])}".ljust(40)
                     + f" {spans(proj[0])} x {spans(proj[1])}".ljust(28) + f" {r['copies']:4d}    {summed}")
    return "\n".join(lines)


def dispatch_picture(run, seed: int = 0) -> str:
    """One dispatch step of one MoE layer and micro-batch: the ep group of
    world rank 0 (its replicas at tensor-parallel rank 0 of stage 0),
    each member's tokens routed by ``ops.moe.route`` on random logits
    (seeded), kept by ``ops.moe.dispatch``, and how many rows each member
    sends to each (``Dispatch.destinations``: the all-to-all-v's counts;
    the outputs come back along the same pairs, and backward repeats both).
    A capacity is applied exactly where one rank's tokens are the only
    ones of its replica and position (serial and 1-D without --cp: the
    drop order's offsets are the earlier replicas' counts); elsewhere the
    dropless choice is shown."""
    cfg, plan = run.cfg, run.plan
    E, K, g = cfg.n_experts, cfg.top_k, plan.ep
    rng = np.random.default_rng(seed)
    members, kept, before = [], [], np.zeros(E, dtype=np.int64)
    exact = cfg.capacity_factor and run.layout in ("serial", "1d") and plan.cp == 1
    cap = router_ops.capacity(cfg.capacity_factor, K, run.micro_batch * cfg.n_ctx, E) if exact else None
    for rank in range(run.world_size):
        layout, (d, p, c, t), (group, ep_rank) = rank_layout(run, rank)
        if p or t or group:
            continue
        n = len(layout.canonical_seqs) * (cfg.n_ctx // plan.cp)                 # this rank's token rows
        logits = rng.standard_normal((n, E))                                     # (n, E)
        _, chosen, _, _, _ = router_ops.route(logits, K, cfg.norm_topk)         # (n, K)
        _, expert, counts = router_ops.dispatch(chosen, E, cap, before if cap else None)
        before = before + counts
        members.append((rank, ep_rank, n))
        kept.append(np.bincount(expert, minlength=E))                           # (E,) kept rows per expert
    send = np.stack([Dispatch.destinations(k, g) for k in kept])                 # (g, g) rows src -> dst
    per = E // g
    lines = [f"one dispatch step (a layer, one micro-batch, seed {seed}): the ep group of rank 0, its "
             f"{g} ranks at tp rank 0, top {K} of {E} experts on random logits"
             + (f", capacity {cap} per expert" if cap else
                (", dropless (the capacity's drops are not drawn on this layout)" if cfg.capacity_factor else
                 ", dropless")),
             "  rows sent (all-to-all-v), from ep rank (row) to ep rank (column), its experts above it:",
             "  " + " " * 22 + "".join(f"{f'e{r * per}..{r * per + per - 1}':>10}" for r in range(g))
             + f"{'sent away':>11}{'kept':>7}"]
    for (rank, ep_rank, n), row, k in zip(members, send, kept):
        lines.append(f"  ep {ep_rank} (rank {rank:3d}, {n:5d} tok)"
                     + "".join(f"{int(v):>10}" for v in row)
                     + f"{int(row.sum() - row[ep_rank]):>11}{int(k.sum()):>7}")
    lines.append("  " + f"{'received':<22}" + "".join(f"{int(v):>10}" for v in send.sum(axis=0)))
    got = np.stack(kept).sum(axis=0)                                             # (E,) rows per expert
    lines.append("  rows per expert: " + ", ".join(f"e{e} {int(v)}" for e, v in enumerate(got))
                 + f"; each rank's row off the diagonal leaves it, the diagonal stays")
    return "\n".join(lines)
