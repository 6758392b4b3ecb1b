"""``info --fp8``: what a recipe quantizes in each GEMM, what its scales
cost, and a picture of its tiles over one sharded weight, drawn from the
code that places the shards (``parallel.split``) and the recipe's groups
(``ops.fp8_recipes``), so the picture cannot drift from what runs."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..model.gpt import gpt_params
from ..ops.fp8_recipes import GEMMS, Recipe
from ..parallel.split import split_decl, split_index
from .costfp8 import PER_LINEAR, REPLICATED_PER_LINEAR

OPERANDS = {"forward": (("x", "x (tokens x K_in)"), ("w", "W^T (K_out x K_in)")),
            "dgrad": (("dy", "dy (tokens x K_out)"), ("w", "W (K_in x K_out)")),
            "wgrad": (("x", "x^T (K_in x tokens)"), ("dy", "dy^T (K_out x tokens)"))}
CONTRACTION = {"forward": "K_in", "dgrad": "K_out", "wgrad": "the tokens"}


def group_words(group) -> str:
    if group == "tensor":
        return "one scale for the tensor"
    if group == "row":
        return "one scale per row"
    kind, b = group
    return {"tile": f"1 x {b} tiles", "block": f"{b} x {b} blocks", "mx": f"1 x {b} blocks, E8M0 scale"}[kind]


def gemm_lines(recipe: Recipe) -> list:
    """One line per GEMM: each operand's format and scaling group."""
    lines = []
    for gemm in GEMMS:
        parts = [f"{words} {recipe.format(role).name}, {group_words(recipe.group(role, gemm))}"
                 for role, words in OPERANDS[gemm]]
        lines.append(f"  {gemm:8s} (contraction over {CONTRACTION[gemm]}): " + "; ".join(parts))
    return lines


def scale_line(recipe: Recipe) -> str:
    if recipe.name == "mxfp8":
        return "  scales: X = 2^(floor(log2 amax) - 8), an E8M0 byte per block (OCP MX v1.0)"
    if recipe.name == "delayed":
        return (f"  scales: fmt_max / amax, amax the {recipe.history_rule} of the last {recipe.history} steps' "
                f"(float32; 1 until there is a history)")
    pow2 = ", rounded down to a power of two" if recipe.power_of_2 else ""
    return f"  scales: fmt_max / amax of the group, float32{pow2}"


def reduction_line(recipe: Recipe, run) -> str:
    """Which ranks each scale's amax is reduced over, per linear and micro-batch."""
    cfg, blocks = run.cfg, run.plan.recompute == "blocks"
    holders = ", their amaxes over the ranks holding the expert (its tp group and expert-data replicas)"
    experts = ("; a mixture's experts as the layout's linears, on every batch of rows they run on"
               + (holders if run.plan.ep > 1 else "") if cfg.moe else "")
    if recipe.name in ("tensorwise", "delayed"):
        per = PER_LINEAR[run.layout] + (run.layout == "3d" and run.plan.recompute == "gathers") + 2 * blocks
        latent = (f"; {REPLICATED_PER_LINEAR + 2 * blocks} for each of MLA's replicated down-projections"
                  if cfg.mla else "")
        return (f"  amax all-reduces: {per} float32 scalars per linear per micro-batch on layout {run.layout} "
                f"(one per quantization of x, W or dy) over the stage's ranks (tp x cp x dp; axis fp8)"
                + latent + experts)
    if recipe.name == "rowwise":
        latent = ("; MLA's replicated down-projections: x's rows over the hidden split, wgrad's token rows "
                  "(the stage's ranks under --sequence-parallel)" if cfg.mla else "")
        return ("  amax all-reduces: a row's amax over the ranks holding the rest of the row (1-D: tp for a "
                "row-split operand, dp x cp for wgrad's token rows; 2-D, 2.5-D: the grid's row or column, and "
                "its column's depth slices, rows and dp x cp replicas for the token rows; 3-D: a line of the "
                "cube for x and dy, a plane for W^T, and a plane with the dp x cp replicas for the token rows)"
                + latent + experts)
    return "  amax all-reduces: none (a tile or block never straddles a shard, so each rank scales its own)"


def scale_count(recipe: Recipe, role: str, gemm: str, rows: int, k: int) -> int:
    """Scales of one operand (rows, k), contraction along k, as ``gemm`` quantizes it."""
    group = recipe.group(role, gemm)
    if group == "tensor":
        return 1
    if group == "row":
        return rows
    kind, b = group
    return -(-rows // b) * -(-k // b) if kind == "block" else rows * -(-k // b)


def logical_linears(cfg, n: int) -> list:
    """(tokens, K_in, K_out) of every quantized linear of the logical model
    in one micro-batch of ``n`` tokens: each block's sharded linears (an
    MTP depth's block too; a mixture's attention and shared experts), MLA's
    REPLICATED down-projections, and a mixture's experts under balanced
    routing (each of the E runs on n K / E tokens)."""
    from ..analysis.costmla import replicated_outputs
    from ..analysis.costparams import dense_linears

    out = []
    for i in range(cfg.n_blocks):
        out += [(n, k_in, k_out) for k_in, k_out, _ in dense_linears(cfg, 1, i)]
        out += [(n, cfg.n_embd, r) for r in (replicated_outputs(cfg) if cfg.mla else [])]
        if cfg.is_moe(i):
            rows, h, F = n * cfg.top_k // cfg.n_experts, cfg.n_embd, cfg.moe_ffn
            out += [(rows, h, 2 * F), (rows, F, h)] * cfg.n_experts
    return out


def cost_lines(recipe: Recipe, run, cfg) -> list:
    """The logical model's FP8 figures for one micro-batch (all ranks
    together): the GEMM operands' bytes in FP8 against the master format,
    the scales' bytes, and delayed's amax histories (float64, per linear
    and operand), over every quantized linear (``logical_linears``)."""
    n = run.micro_batch * (run.seq_len or cfg.n_ctx)                     # tokens of one micro-batch
    linears = logical_linears(cfg, n)
    shape = {("x", "forward"): lambda t, a, b: (t, a), ("w", "forward"): lambda t, a, b: (b, a),
             ("dy", "dgrad"): lambda t, a, b: (t, b), ("w", "dgrad"): lambda t, a, b: (a, b),
             ("x", "wgrad"): lambda t, a, b: (a, t), ("dy", "wgrad"): lambda t, a, b: (b, t)}
    elems = scales = 0
    for tokens, k_in, k_out in linears:
        for (role, gemm), of in shape.items():
            rows, k = of(tokens, k_in, k_out)
            elems += rows * k
            scales += scale_count(recipe, role, gemm, rows, k)
    scale_bytes = scales * (1 if recipe.mx else 4)
    routed = (f"; a mixture's experts under balanced routing, {n * cfg.top_k // cfg.n_experts:,} tokens each"
              if cfg.moe else "")
    lines = [f"  costs, one micro-batch of {n:,} tokens over {len(linears):,} linears (all ranks together{routed}):",
             f"    FP8 operands {human(elems)}B quantized (6 per linear: x, W, dy twice each), "
             f"{human(elems * 2)}B in bfloat16, {human(elems * 4)}B in float32",
             f"    scales {human(scale_bytes)}B ({scales:,} of {'1 byte, E8M0' if recipe.mx else '4 bytes'})"]
    if recipe.name == "delayed":
        history = len(linears) * 3 * recipe.history * 8
        lines.append(f"    amax histories {human(history)}B kept (and checkpointed): {len(linears)} linears x "
                     f"x, W, dy x {recipe.history} steps, float64")
    return lines


def run_problem(recipe: Recipe, run, cfg, dtype: str):
    """The cost model's Problem of ``run`` (stage 0) for model ``cfg`` under ``recipe``."""
    from ..analysis.costbase import Problem

    plan = run.plan
    return Problem(cfg, run.layout, run.tp, plan.dp, plan.depth if run.layout == "2.5d" else 1, run.batch_size,
                   run.seq_len or cfg.n_ctx, dtype, recompute=plan.recompute, grad_accum=plan.grad_accum,
                   zero=plan.zero, pp=plan.pp, pp_schedule=plan.pp_schedule, virtual_stages=plan.virtual_stages,
                   sequence_parallel=plan.sequence_parallel, cp=plan.cp, ulysses=plan.ulysses_size, ep=plan.ep,
                   hsdp=plan.hsdp, fp8=recipe.name)


def traffic_lines(recipe: Recipe, run, cfg, dtype: str) -> list:
    """What the recipe adds to one rank's step traffic (stage 0), axis by
    axis, as the cost model prices it (``costfp8``: the amax all-reduces
    of every quantized linear, a mixture's experts on balanced routing
    and MLA's replicated ones included, and 3-D's second gathers; the
    combo launches hold every FP8 case's measured counters to it)."""
    from ..analysis.costmodel import step_traffic

    p = run_problem(recipe, run, cfg, dtype)
    with_fp8, without = step_traffic(p), step_traffic(replace(p, fp8=""))
    added = []
    for axis in sorted(set(with_fp8.elems) | set(without.elems)):
        elems = with_fp8.elems.get(axis, 0) - without.elems.get(axis, 0)
        msgs = with_fp8.msgs.get(axis, 0) - without.msgs.get(axis, 0)
        size = with_fp8.bytes.get(axis, 0) - without.bytes.get(axis, 0)
        if elems or msgs:
            added.append(f"{axis} {human(float(elems))} elements, {human(float(size))}B, {msgs:,} messages")
    return [f"  traffic the recipe adds per rank per step ({run.layout}, stage 0, {dtype}; the cost model's): "
            + ("; ".join(added) or "none")]


def memory_lines(recipe: Recipe, run, cfg, dtype: str) -> list:
    """What the recipe changes in one rank's memory (pipeline stage 0), as
    the memory model prices it (``costmemory``, ``costfp8``; the combo
    launches hold it equal to what every FP8 case keeps): the activations
    kept for backward with and without the recipe (a grid layout's
    quantized copies under a tensor scale; 3-D's local X in place of the
    gathered X and W under a tile or row recipe), and delayed's amax
    histories. Quantized values are held in the activation format, as the
    emulation computes with them."""
    from ..analysis.costfp8 import history_elems
    from ..analysis.costmemory import step_memory_bytes

    p = run_problem(recipe, run, cfg, dtype)
    with_fp8 = step_memory_bytes(p, dropout=False).activations
    without = step_memory_bytes(replace(p, fp8=""), dropout=False).activations
    change = with_fp8 - without
    held = history_elems(p, recipe.history) * 8
    words = "the same" if change == 0 else f"{'+' if change > 0 else '-'}{human(abs(change))}B"
    return [f"  memory per rank ({run.layout}, stage 0, {dtype}, no dropout): activations kept for backward "
            f"{human(with_fp8)}B ({words} against no --fp8), amax histories {human(held)}B"
            + (" (float64)" if held else "")]


def human(n: float) -> str:
    """1234567 -> '1.23M' (as the cost report writes sizes)."""
    for unit, size in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:g}"


def owners(n: int, parts: int, index_of) -> np.ndarray:
    """(n,) the part holding each position of a dimension of length n."""
    who = np.full(n, -1)
    for t in range(parts):
        who[index_of(t)] = t
    return who


def tile_picture(recipe: Recipe, run, cfg) -> list:
    """The attention's first weight (C x [q | k | v]) on a 1-D layout (or
    serial), one character per b x b region of its blocks (tiles of x run
    along its rows, of dy along its columns): the digit is the
    tensor-parallel rank holding it, '|' a shard boundary."""
    b = recipe.block
    decl = next(d for d in gpt_params(cfg) if d.role == "w_column")    # h.0's first linear: c_attn / qkv
    rows, cols = decl.shape
    tp = run.tp if run.layout in ("1d", "serial") else 1
    col_owner = owners(cols, tp, lambda t: split_decl(decl, tp, t))
    col_owner = col_owner[::b]                                          # one per block of columns
    cells = "".join(str(o) if o < 10 else chr(ord("a") + o - 10) for o in col_owner)
    bounds = [0] + [i for i in range(1, len(cells)) if cells[i] != cells[i - 1]] + [len(cells)]
    row = "|" + "|".join(cells[a:c] for a, c in zip(bounds, bounds[1:])) + "|"
    lines = [f"  {decl.name} ({rows} x {cols}) on layout {run.layout} tp {tp}: one character per {b} x {b} "
             f"elements, the digit the rank holding them, '|' a shard boundary"]
    shown = min(rows // b, 4)
    for r in range(shown):
        lines.append(f"    rows {r * b:6d}  {row}")
    if rows // b > shown:
        lines.append(f"    ... {rows // b - shown} more rows of blocks alike")
    runs = len(bounds) - 1
    lines.append(f"  every block lies inside one shard ({runs} runs of columns, each a multiple of {b})")
    return lines


def fp8_report(recipe: Recipe, run, cfg, dtype: str = None) -> str:
    lines = [f"fp8 {recipe.name}: every linear's GEMM operands quantized (x and W in e4m3, dy in "
             f"{recipe.grad_format}), accumulated in {recipe.accumulate}"]
    lines += gemm_lines(recipe)
    lines.append(scale_line(recipe))
    lines.append(reduction_line(recipe, run))
    if recipe.block and run.layout in ("1d", "serial"):
        lines += tile_picture(recipe, run, cfg)
    lines += cost_lines(recipe, run, cfg)
    if dtype is not None:
        lines += memory_lines(recipe, run, cfg, dtype)
        lines += traffic_lines(recipe, run, cfg, dtype)
    return "\n".join(lines)


__all__ = ["fp8_report", "split_index"]
