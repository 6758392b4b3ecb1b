"""``info``'s section for a mixture of experts: where the experts sit,
their parameters, FLOPs and memory per rank, and the all-to-all per rank
per step under uniform routing (``moe_report``), with the bound a
capacity puts on it (``capacity_bound``).

The all-to-all itself (``ep_traffic``, in ``costexperts``) follows what
``parallel.experts.Dispatch`` does per MoE layer and forward pass: one
exchange of the per-expert counts (``Ialltoall``: E/g integers to each of
the g-1 peers, 8 bytes each), the rows to the experts' ranks and the
outputs back (``Ialltoallv``, in the activations' format, one message per
peer with rows; a rank's rows for its own experts never go over the wire,
so they are not counted); backward sends the output gradients and brings
the input gradients back the same way, reusing the counts. ``--recompute
blocks`` reruns the forward (its exchanges included) inside backward. The
gradient norm adds one all-reduce of a float64 over ep (each rank's
experts' squares, ``gradients.global_grad_norm``).
"""

from __future__ import annotations

from .costexperts import ep_traffic, grid


def capacity_bound(n_tokens_rank: int, top_k: int, cap: int, n_experts: int, g: int) -> int:
    """Rows one rank can send to the others per layer and pass under a
    capacity: its own choices, at most K per token, and at most C per
    expert for each of the (g-1) E/g experts it does not hold."""
    return min(n_tokens_rank * top_k, cap * (g - 1) * (n_experts // g))


def _size(n) -> str:
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.3g}"


def moe_report(cfg, batch_size: int, world: int, dp: int, ep: int, tp: int, width: int, recompute: str = "none",
               grad_accum: int = 1, cp: int = 1, layout: str = None, depth: int = 1, dtype: str = "float32",
               zero: int = 0, pp: int = 1, schedule: str = "1f1b", virtual: int = 1) -> str:
    """``info``'s section for a mixture of experts: where the experts sit,
    their parameters and FLOPs per rank, the all-to-all per rank per step
    under uniform routing (dropless dispatch sends what the router
    chooses; a capacity bounds it), and, given the ``layout``, the experts'
    memory per rank (``expert_memory``). Under ``cp`` > 1 the ep ranks
    come from dp x cp and a rank routes its T/cp positions."""
    E, K, L, h, F = cfg.n_experts, cfg.top_k, cfg.n_layer - min(cfg.first_k_dense, cfg.n_layer), cfg.n_embd, cfg.moe_ffn
    per = E // ep
    expert = 3 * h * F                                   # one expert's parameters
    tokens = batch_size // dp * cfg.n_ctx // cp          # this rank's tokens per step (its positions under cp)
    holders = dp * cp // ep                              # ranks holding each expert (its edp group)
    lines = [f"mixture of experts: {E} experts, top {K}, "
             + (f"capacity factor {cfg.capacity_factor:g}" if cfg.capacity_factor else "dropless")
             + f"; --ep {ep}: each rank holds {per} of the {E} experts of every layer (E/ep), each expert "
               + (f"held by {holders} replica{'s' if holders != 1 else ''} (dp/ep)" if cp == 1 else
                  f"held by {holders} rank{'s' if holders != 1 else ''} of dp x cp (dp cp/ep)"),
             f"  expert parameters per rank: {_size(L * per * expert // tp)} ({L} layers x {per} expert{'s' if per > 1 else ''} x 3 h F"
             + (f" / tp {tp}" if tp > 1 else "") + f"), of {_size(L * E * expert)} in all",
             f"  expert FLOPs per token (forward, active): {_size(2 * L * K * expert)}"
             f" (2 x {L} layers x top {K} x 3 h F); the router {_size(2 * L * h * E)}"]
    p = None
    if layout is not None:
        from .costpipereport import pipeline_problem
        from .costreport import _problem

        if pp > 1:                   # stage 0's layers (every stage holds as many experts a layer)
            p = pipeline_problem(layout, cfg, batch_size, world, dp, depth, pp, schedule, virtual, dtype, recompute,
                                 grad_accum, zero, cp, ep=ep)
        else:
            p = _problem(layout, cfg, batch_size, world, dp, depth, dtype, recompute, grad_accum, zero, cp, ep=ep)
    # the token rows this rank routes per micro-batch: its replica's positions, split further by a
    # 2-D, 2.5-D or 3-D layout's rows (costexperts.grid); without a layout, the replica's
    micro = grid(p)[0] if p is not None and not isinstance(p, str) else tokens // grad_accum
    if ep > 1:
        rows = micro * K // ep                               # rows to each ep rank per layer and micro-batch
        routes = [([rows] * ep, [rows] * ep)] * (L * grad_accum)
        t = ep_traffic(routes, ep, 0, E, h, width, forwards=2 if recompute == "blocks" else 1)
        lines.append(f"  all-to-all per rank per step (axis ep, uniform routing: {rows} rows to each ep rank per "
                     f"layer and micro-batch): {_size(float(t.elems['ep']))} elements, "
                     f"{_size(float(t.bytes['ep']))}B, {t.msgs['ep']} messages")
        if cfg.capacity_factor:
            from ..ops.moe import capacity

            cap = capacity(cfg.capacity_factor, K, batch_size // grad_accum * cfg.n_ctx, E)
            lines.append(f"  capacity: at most {cap} tokens per expert per layer and micro-batch; a rank sends at "
                         f"most {capacity_bound(micro, K, cap, E, ep)} rows per layer and pass")
    if p is not None:
        lines += expert_memory(p) if not isinstance(p, str) else [f"  (memory: n/a: {p})"]
    lines.append("  (the tables below price the whole model for this routing: the experts' activations, their "
                 "linears' collectives" + (", the all-to-all (axis ep) and their gradient sums (axis edp)"
                                           if ep > 1 else "") + " included)")
    return "\n".join(lines)


def expert_memory(p) -> list:
    """``info``'s lines on a mixture's memory per rank: the experts'
    parameters, gradients and AdamW moments (E/ep experts, each sharded
    by the layout; --zero cuts their state over the expert-data group of
    dp cp/ep ranks, or dp without --ep), and what one MoE layer keeps for
    backward per micro-batch, part by part, for the routing
    ``costexperts`` prices: balanced when dropless, the exact bound under
    a capacity."""
    from ..parallel.experts import expert_of
    from .costexperts import capacity_rows, expected_rows, layer_parts
    from .costmodel import local_param_sizes
    from .costparams import moe_layers

    w, cfg = p.widths, p.cfg
    sizes = local_param_sizes(p)
    x = sum(n for name, (n, _) in sizes.items() if expert_of(name) is not None)
    share = p.edp if p.ep > 1 else p.dp          # the ranks holding the same experts: what --zero cuts them over

    def cut(level: int) -> int:                  # elements of the experts' state --zero shards from ``level`` on
        return -(-x // share) if p.sharded and p.zero >= level else x

    shards = {1: "the moments", 2: "the gradients and moments", 3: "the weights, gradients and moments"}
    where = (f"over the {share} ranks of their expert-data group" if p.ep > 1 else f"over dp {p.dp}")
    lines = [f"  expert memory per rank ({p.dtype}): parameters {_size(cut(3))} elements ({_size(cut(3) * w.act)}B), "
             f"gradients {_size(cut(2) * w.grad)}B, AdamW moments {_size(2 * cut(1) * w.grad)}B"
             + (f" (--zero {p.zero}: {shards[p.zero]} {where}"
                + ("; the gathered layers' slots come on top" if p.zero >= 2 else "") + ")" if p.sharded else "")]
    rows = capacity_rows(p) if cfg.capacity_factor else expected_rows(p)
    how = ("the capacity's bound" if cfg.capacity_factor else "balanced routing")
    parts = layer_parts(p, rows)
    width = {"act": w.act, "stat": w.stat, "grad": w.grad}
    total = sum(n * width[k] for k, n in parts.values())
    lines.append(f"  activations of one MoE layer per rank and micro-batch ({how}: {rows.sent} rows sent, "
                 f"{rows.run} run by its {cfg.n_experts // p.ep} expert{'s' if cfg.n_experts // p.ep > 1 else ''}): "
                 f"{_size(total)}B = "
                 + ", ".join(f"{name} {_size(n * width[k])}B" for name, (k, n) in parts.items())
                 + f"; {moe_layers(p)} MoE layer{'s' if moe_layers(p) != 1 else ''}"
                 + (" of stage 0" if p.pp > 1 else "") + f" {_size(moe_layers(p) * total)}B"
                 + (" (--recompute blocks: one layer's at a time)" if p.recompute == "blocks" else ""))
    return lines
