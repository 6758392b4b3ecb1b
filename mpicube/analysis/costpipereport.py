"""The pipeline part of ``mpicube info``: one run's stages (layers, memory,
traffic per link class, bubble), and the grid of (tp layout, pp, dp,
schedule) combinations a user would weigh at a world size. Pure arithmetic
over the cost model; nothing here runs a model.

Link classes follow the rank order of ``parallel.gridspec`` (dp, pp, cp,
tp; tp innermost): "tp" is the tensor-parallel layout's own axes (one
node when tp fits in one), "cp" the context-parallel ring and its weight
gradient sum (ranks tp apart), "pp" the stage boundaries and the tied wte's
gradient sum between the first and the last stage (ranks tp apart and
(pp-1) tp apart, times cp), "dp" the replicas' gradient sums (ranks pp cp
tp apart),
"world" the step's few scalars (loss, norm under --zero 1). A byte is
cross-node when the group it moves in spans more than one node of
``ranks_per_node`` consecutive ranks (``axis_span``: 3-D's k axis spans q
ranks, j q^2, i and the planes q^3; 2-D's row q, col q^2; cp cp tp; pp
and the tied pair pp cp tp, dp and world the world), exact for node sizes and grids that
are powers of two.
"""

from __future__ import annotations

from ..core.config import ModelConfig
from ..core.errors import ConfigError
from ..parallel.grid import plan
from ..parallel.gridspec import GridSpec, Plan
from ..parallel.planning import check_moe
from ..parallel.schedules import check_pipeline, check_pp_world
from .costmemory import step_memory_bytes
from .costmodel import Problem, step_traffic
from .costbubble import DEFAULT_RATES, modelled_bubble
from .costpipe import bubble, peak_in_flight, stage_problem
from .costreport import SHARDED

CLASSES = ("tp", "cp", "pp", "dp", "world")
RANKS_PER_NODE = 8


def link_class(axis: str) -> str:
    """The link class of a traffic axis."""
    if axis in ("pp", "tied"):
        return "pp"
    if axis in ("cp", "dp", "world"):
        return axis
    if axis in ("ep", "edp"):          # a mixture's ranks, taken from dp (x cp)
        return "dp"
    return "tp"


def axis_span(p: Problem, axis: str) -> int:
    """Consecutive ranks one group of ``axis`` spans (tp innermost)."""
    if axis == "cp":
        return p.tp * p.cp
    if axis in ("pp", "tied"):
        return p.tp * p.cp * p.pp
    if axis in ("dp", "world", "ep", "edp"):
        return p.tp * p.cp * p.pp * p.dp
    if p.layout == "3d":
        q = round(p.tp ** (1 / 3))
        return {"k": q, "j": q * q}.get(axis, p.tp)
    if p.layout in ("2d", "2.5d"):
        q = round((p.tp // p.depth) ** 0.5)
        return {"row": q, "col": q * q}.get(axis, p.tp)
    return p.tp


def pipeline_problem(layout: str, cfg: ModelConfig, batch_size: int, world_size: int, dp: int = 1,
                     depth: int = 1, pp: int = 1, schedule: str = "1f1b", virtual: int = 1,
                     dtype: str = "float32", recompute: str = "none", grad_accum: int = 1, zero: int = 0,
                     cp: int = 1, sequence_parallel: bool = False, ep: int = 1):
    """A validated Problem (stage 0) for dp x pp x cp x tp, or the
    ConfigError's message. The layout is validated as the tensor-parallel
    group of one stage with its cp ring (world / (dp pp) ranks, cp and
    --sequence-parallel included), the pipeline by ``check_pipeline``."""
    try:
        GridSpec(layout, dp=dp, pp=pp, cp=cp).tp(world_size)
        tp = check_pp_world(world_size // cp, pp, dp)
        check_pipeline(cfg.n_layer, pp, schedule, virtual, grad_accum)
        grid = GridSpec(layout, dp=dp, cp=cp, depth=depth, sequence_parallel=sequence_parallel)
        _, resolved, tp = plan(grid, cfg, batch_size, tp * dp * cp, grad_accum, recompute)
        check_moe(Plan(resolved, dp=dp, pp=pp, cp=cp, depth=depth, sequence_parallel=sequence_parallel, zero=zero,
                       recompute=recompute, grad_accum=grad_accum, ep=ep), cfg, tp, resolved)
    except ConfigError as err:
        return str(err)
    return Problem(cfg, resolved, tp, dp, depth if resolved == "2.5d" else 1, batch_size, cfg.n_ctx, dtype,
                   recompute=recompute, zero=zero, grad_accum=grad_accum, pp=pp, pp_schedule=schedule,
                   virtual_stages=virtual, cp=cp, sequence_parallel=sequence_parallel, ep=ep)


def stage_figures(p: Problem, ranks_per_node: int = RANKS_PER_NODE) -> list:
    """Per stage: {"stage", "layers", "in_flight", "memory", "bytes": {class: bytes}, "cross_node"}."""
    out = []
    for s in range(p.pp):
        sp = stage_problem(p, s)
        t = step_traffic(sp)
        by_class = dict.fromkeys(CLASSES, 0)
        for axis, b in t.bytes.items():
            by_class[link_class(axis)] += b
        out.append({"stage": s, "layers": sp.layers, "in_flight": peak_in_flight(sp) if p.pp > 1 else 1,
                    "memory": step_memory_bytes(sp).total(), "bytes": by_class,
                    "cross_node": sum(b for axis, b in t.bytes.items() if axis_span(sp, axis) > ranks_per_node)})
    return out


def worst(p: Problem, ranks_per_node: int = RANKS_PER_NODE) -> dict:
    """The largest per-rank figure over the stages (the rank that sizes the job)."""
    figs = stage_figures(p, ranks_per_node)
    return {"memory": max(f["memory"] for f in figs), "cross_node": max(f["cross_node"] for f in figs),
            "bytes": {c: max(f["bytes"][c] for f in figs) for c in CLASSES}, "bubble": bubble(p) if p.pp > 1 else 0.0}


def _fmt(n) -> str:
    n = float(n)
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.3g}"


def stages_report(p: Problem, ranks_per_node: int = RANKS_PER_NODE) -> str:
    """One line per stage of the chosen run (a cp bytes column under --cp)."""
    name = p.pp_schedule + (f", {p.virtual_stages} virtual stages" if p.virtual_stages > 1 else "")
    ring = p.cp > 1
    order = "dp, pp, cp, tp" if ring else "dp, pp, tp"
    lines = [f"pipeline: {p.pp} stages, {name}, {p.grad_accum} micro-batches; bubble {bubble(p):.1%} of the step "
             f"(idle share, equal work per layer); rank order {order} with tp innermost",
             f"  {'stage':<6} {'layers':<14} {'in flight':>9} {'memory':>9} {'tp bytes':>9} "
             + (f"{'cp bytes':>9} " if ring else "") + f"{'pp bytes':>9} {'dp bytes':>9} {'cross-node':>10}"]
    split = p.chunk_layers
    for f in stage_figures(p, ranks_per_node):
        sp = stage_problem(p, f["stage"])
        chunks = [split[k] for k in sp.stage_chunks]
        layers = ",".join(f"{r.start}-{r.stop - 1}" if len(r) > 1 else str(r.start) for r in chunks)
        extra = ("+embed" if sp.has_embed else "") + ("+head" if sp.has_head else "")
        b = f["bytes"]
        lines.append(f"  {f['stage']:<6} {layers + extra:<14} {f['in_flight']:>9} {_fmt(f['memory']) + 'B':>9} "
                     f"{_fmt(b['tp']) + 'B':>9} " + (f"{_fmt(b['cp']) + 'B':>9} " if ring else "")
                     + f"{_fmt(b['pp']) + 'B':>9} {_fmt(b['dp']) + 'B':>9} {_fmt(f['cross_node']) + 'B':>10}")
    lines.append(f"  modelled bubble {modelled_bubble(p):.1%} of the step (this run's F, B and W FLOPs and "
                 f"elementwise bytes per stage, embeddings and head included, at stated rates: "
                 f"{DEFAULT_RATES.describe()})")
    return "\n".join(lines)


def combinations(cfg: ModelConfig, batch_size: int, world_size: int, dtype: str = "float32",
                 recompute: str = "none", zero: int = 0, ranks_per_node: int = RANKS_PER_NODE,
                 max_tp: int = None, ep: int = 1) -> list:
    """Every (layout, tp, pp, dp, schedule, V, N) at this world size that
    the sizes accept, with tp at most ``max_tp``: auto layouts (3-D on a
    cube, 2-D on a square, 1-D otherwise), pp from 1 up to n_layer, 1F1B
    and interleaved with the smallest V > 1 that divides the layers, and
    the largest N the batch and the layout take (a multiple of pp under
    interleaved), with or without a pipeline: the smallest micro-batch
    holds the least and, in a pipeline, leaves the smallest bubble, for
    the same bytes (only more, smaller messages), so a fair comparison
    gives every row its own best N."""
    rows = []
    for tp in [d for d in range(1, min(max_tp or world_size, world_size) + 1) if world_size % d == 0]:
        for pp in [d for d in range(1, cfg.n_layer + 1) if (world_size // tp) % d == 0]:
            dp = world_size // (tp * pp)
            schedules = [("1f1b", 1)] if pp == 1 else [("1f1b", 1)] + [
                ("interleaved", v) for v in range(2, cfg.n_layer // pp + 1) if cfg.n_layer % (pp * v) == 0][:1]
            for schedule, v in schedules:
                per_replica = batch_size // dp
                for n in range(per_replica, 0, -1):
                    if per_replica % n or (schedule == "interleaved" and n % pp):
                        continue
                    p = pipeline_problem("auto", cfg, batch_size, world_size, dp, 1, pp, schedule, v, dtype,
                                         recompute, n, zero if dp > 1 else 0, ep=ep)
                    if not isinstance(p, str):
                        rows.append((p, worst(p, ranks_per_node)))
                        break
    return rows


def combinations_report(cfg: ModelConfig, batch_size: int, world_size: int, dtype: str = "float32",
                        recompute: str = "none", zero: int = 0, ranks_per_node: int = RANKS_PER_NODE,
                        ep: int = 1) -> str:
    """The table of ``combinations``, per rank per step (the rank with the
    most of each), sorted by cross-node bytes; marks the pipelines whose
    memory and cross-node bytes are both below the best run without one
    (a mixture's: those whose dp x cp --ep divides)."""
    rows = combinations(cfg, batch_size, world_size, dtype, recompute, zero, ranks_per_node, ep=ep)
    flat = [(p, w) for p, w in rows if p.pp == 1]
    best = min(flat, key=lambda r: (r[1]["cross_node"], r[1]["memory"]), default=None)
    lines = [f"dp x pp x tp at world {world_size}, batch {batch_size}, {dtype}, --recompute {recompute}"
             + (f", --zero {zero} where dp > 1" if zero else "") + f"; nodes of {ranks_per_node} ranks; per rank per step:",
             f"  {'layout':<6} {'tp':>3} {'pp':>3} {'dp':>4} {'schedule':<14} {'N':>3} {'memory':>9} "
             f"{'tp bytes':>9} {'pp bytes':>9} {'dp bytes':>9} {'cross-node':>10} {'bubble':>7}"]
    if not rows:
        lines.append("  (no combination fits this batch: try a larger --batch-size)")
    for p, w in sorted(rows, key=lambda r: (r[1]["cross_node"], r[1]["memory"])):
        sched = "-" if p.pp == 1 else p.pp_schedule + (f" V={p.virtual_stages}" if p.virtual_stages > 1 else "")
        mark = ""
        if best is not None and p is best[0]:
            mark = "  <- best without pp"
        elif best is not None and p.pp > 1 and w["memory"] < best[1]["memory"] and \
                w["cross_node"] < best[1]["cross_node"]:
            mark = "  * below it in both"
        b = w["bytes"]
        lines.append(f"  {p.layout:<6} {p.tp:>3} {p.pp:>3} {p.dp:>4} {sched:<14} {p.grad_accum:>3} "
                     f"{_fmt(w['memory']) + 'B':>9} {_fmt(b['tp']) + 'B':>9} {_fmt(b['pp']) + 'B':>9} "
                     f"{_fmt(b['dp']) + 'B':>9} {_fmt(w['cross_node']) + 'B':>10} {w['bubble']:>6.1%}{mark}")
    return "\n".join(lines)



def _chosen(layout, cfg, batch_size, world_size, dp, depth, pp, schedule, virtual, dtype, recompute, grad_accum,
            zero, cp=1, sequence_parallel=False, ep=1) -> Problem:
    from ..parallel.zero import validate

    validate(zero, dp)
    p = pipeline_problem(layout, cfg, batch_size, world_size, dp, depth, pp, schedule, virtual, dtype, recompute,
                         grad_accum, zero, cp, sequence_parallel, ep)
    if isinstance(p, str):
        raise ConfigError(p)
    return p


def pipeline_report(layout: str, cfg: ModelConfig, batch_size: int, world_size: int, dp: int, depth: int, pp: int,
                    schedule: str, virtual: int, dtype: str = "float32", recompute: str = "none",
                    grad_accum: int = 1, zero: int = 0, ranks_per_node: int = RANKS_PER_NODE,
                    cp: int = 1, sequence_parallel: bool = False, ep: int = 1) -> str:
    """``info --pp``: the grid, every stage's layers, in-flight micro-batch
    chunks, memory and traffic per link class, and the bubble."""
    p = _chosen(layout, cfg, batch_size, world_size, dp, depth, pp, schedule, virtual, dtype, recompute,
                grad_accum, zero, cp, sequence_parallel, ep)
    head = (f"layout {p.layout}: world {world_size} = dp {dp} x pp {pp}" + (f" x cp {p.cp}" if p.cp > 1 else "")
            + f" x tp {p.tp}" + (f", depth {p.depth}" if p.layout == "2.5d" else "")
            + (", sequence parallel (LayerNorm, dropout, residuals: T/tp positions)" if p.sequence_parallel else "")
            + (f", {SHARDED[p.zero]} sharded over dp (--zero {p.zero})" if p.sharded else ""))
    body = (f"batch {batch_size} sequences x {cfg.n_ctx} tokens per step in {grad_accum} micro-batches of "
            f"{batch_size // grad_accum}, --recompute {recompute}, {dtype}; per rank per step "
            f"(bytes; cross-node: nodes of {ranks_per_node} ranks)")
    return "\n".join([head, body, "", stages_report(p, ranks_per_node)])


def pipeline_summary(layout: str, cfg: ModelConfig, batch_size: int, world_size: int, dp: int, depth: int, pp: int,
                     schedule: str, virtual: int, dtype: str = "float32", recompute: str = "none",
                     grad_accum: int = 1, zero: int = 0, ranks_per_node: int = RANKS_PER_NODE,
                     cp: int = 1, sequence_parallel: bool = False, ep: int = 1) -> dict:
    """``info --pp --json``: the run and the rank with the most of each
    figure over the stages, and every stage's."""
    p = _chosen(layout, cfg, batch_size, world_size, dp, depth, pp, schedule, virtual, dtype, recompute,
                grad_accum, zero, cp, sequence_parallel, ep)
    w = worst(p, ranks_per_node)
    stages = [{"stage": f["stage"], "layers": f["layers"], "in_flight": f["in_flight"],
               "memory_bytes_per_rank": int(f["memory"]), "cross_node_bytes_per_rank": float(f["cross_node"]),
               "comm_bytes_by_class": {c: float(b) for c, b in f["bytes"].items()}}
              for f in stage_figures(p, ranks_per_node)]
    return {"layout": p.layout, "tp": p.tp, "dp": p.dp, "pp": p.pp, "cp": p.cp,
            "sequence_parallel": p.sequence_parallel, "depth": p.depth, "pp_schedule": p.pp_schedule,
            "virtual_stages": p.virtual_stages, "batch_size": p.batch, "seq_len": p.seq_len, "dtype": p.dtype,
            "recompute": p.recompute, "zero": p.zero, "grad_accum": p.grad_accum, "bubble": w["bubble"],
            "modelled_bubble": modelled_bubble(p),
            "memory_bytes_per_rank": int(w["memory"]), "cross_node_bytes_per_rank": float(w["cross_node"]),
            "comm_bytes_by_class": {c: float(b) for c, b in w["bytes"].items()}, "stages": stages}
