"""Expert parallelism's all-to-all traffic for one rank and one step, from
the routing it measured (dropless dispatch sends what the router chose,
so the figure can only follow the step; under a capacity it is bounded by
C rows per expert).

What ``parallel.experts.Dispatch`` does per MoE layer and forward pass:
one exchange of the per-expert counts (``Ialltoall``: E/g integers to each
of the g-1 peers, 8 bytes each), the rows to the experts' ranks and the
outputs back (``Ialltoallv``, in the activations' format, one message per
peer with rows; a rank's rows for its own experts never go over the wire,
so they are not counted); backward sends the output gradients and brings
the input gradients back the same way, reusing the counts. ``--recompute blocks``
reruns the forward (its exchanges included) inside backward. The
gradient norm adds one all-reduce of a float64 over ep (each rank's
experts' squares, ``gradients.global_grad_norm``).
"""

from __future__ import annotations

from fractions import Fraction

from .costbase import Traffic


def ep_traffic(routes, g: int, rank: int, n_experts: int, row: int, width: int, forwards: int = 1,
               norm: bool = True) -> Traffic:
    """Traffic on axis "ep" of one step: ``routes`` lists (rows sent to,
    rows received from) each ep rank, (g,) each, one pair per MoE layer
    and micro-batch; ``rank`` this rank's ep rank, ``row`` the elements of
    a row (the hidden size), ``width`` the activations' bytes, ``forwards``
    forward passes per layer (2 under --recompute blocks), ``norm`` whether
    the step took the gradient norm."""
    t = Traffic()
    if g == 1:
        return t
    if norm:
        t.allreduce("ep", g, 1, width=8)
    for sent, received in routes:
        others = [j for j in range(g) if j != rank]
        t._add("ep", g, (g - 1) * (n_experts // g), g - 1, forwards, 8)             # the counts
        out = Fraction(sum(int(sent[j]) for j in others) * row)
        back = Fraction(sum(int(received[j]) for j in others) * row)
        t._add("ep", g, out, sum(1 for j in others if sent[j]), forwards + 1, width)       # rows, dy out
        t._add("ep", g, back, sum(1 for j in others if received[j]), forwards + 1, width)  # outputs, dx back
    return t


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
               grad_accum: int = 1, cp: int = 1) -> str:
    """``info``'s section for a mixture of experts on the serial or 1-D
    layout: where the experts sit, their parameters and FLOPs per rank, and
    the all-to-all per rank per step under uniform routing (dropless
    dispatch sends what the router chooses; a capacity bounds it). Under
    ``cp`` > 1 the ep ranks come from dp x cp and a rank routes its T/cp
    positions."""
    E, K, L, h, F = cfg.n_experts, cfg.top_k, cfg.n_layer, cfg.n_embd, cfg.ffn
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
    if ep > 1:
        rows = tokens // grad_accum * K // ep                # rows to each ep rank per layer and micro-batch
        routes = [([rows] * ep, [rows] * ep)] * (L * grad_accum)
        t = ep_traffic(routes, ep, 0, E, h, width, forwards=2 if recompute == "blocks" else 1)
        lines.append(f"  all-to-all per rank per step (axis ep, uniform routing: {rows} rows to each ep rank per "
                     f"layer and micro-batch): {_size(float(t.elems['ep']))} elements, "
                     f"{_size(float(t.bytes['ep']))}B, {t.msgs['ep']} messages")
        if cfg.capacity_factor:
            from ..ops.moe import capacity

            cap = capacity(cfg.capacity_factor, K, batch_size // grad_accum * cfg.n_ctx, E)
            lines.append(f"  capacity: at most {cap} tokens per expert per layer and micro-batch; a rank sends at "
                         f"most {capacity_bound(tokens // grad_accum, K, cap, E, ep)} rows per layer and pass")
    lines.append("  (the communication and memory tables of the dense model are not printed for a mixture yet)")
    return "\n".join(lines)


def placement_table(cfg, world: int, dp: int, ep: int, layout: str, cp: int = 1, pp: int = 1) -> str:
    """Where every expert and each shard of it sits, rank by rank, from
    the rules the code uses: ``gridspec.Plan.coords`` (replica d, tp rank
    t), ``experts.local_experts`` (ep rank d % ep holds E/ep experts; the
    replicas d with the same d % ep sum their gradients) and the 1-D
    layout's column split of each expert's [gate | up] (``split_index``,
    groups of F) and row split of its down projection. The 2-D, 2.5-D
    and 3-D layouts split an expert by their own rules (docs/moe.md), and
    --cp and --pp renumber the ranks: those are refused by name until the
    table reads them (ConfigError)."""
    from ..core.errors import ConfigError
    from ..parallel.experts import local_experts
    from ..parallel.gridspec import Plan
    from ..parallel.params import split_index

    if layout not in ("serial", "1d") or cp != 1 or pp != 1:
        what = f"--layout {layout}" if layout not in ("serial", "1d") else f"--cp {cp}" if cp != 1 else f"--pp {pp}"
        raise ConfigError(f"--experts draws where experts sit on the serial and 1-D layouts without --cp and --pp "
                          f"so far, not with {what}")
    plan = Plan(layout, dp=dp, ep=ep)
    tp, F = plan.tp(world), cfg.ffn

    class Rank:                                          # what local_experts reads of a Comm
        def __init__(self, size, rank):
            self.size, self.rank = size, rank

    lines = [f"experts on {world} ranks (dp {dp} x tp {tp}, --ep {ep}): rank = d x tp + t",
             "  rank   d   t  ep rank  experts    c_fc columns (gate | up)       c_proj rows   gradients summed with"]
    for rank in range(world):
        d, _, _, t = plan.coords(rank, world)
        mine = local_experts(cfg.n_experts, Rank(ep, d % ep))
        cols = split_index(2 * F, tp, t, groups=2)
        gate, up = cols[:len(cols) // 2], cols[len(cols) // 2:]
        rows = split_index(F, tp, t)
        peers = [e * tp + t for e in range(dp) if e % ep == d % ep and e != d]
        lines.append(f"  {rank:4d} {d:3d} {t:3d} {d % ep:8d}  {mine.start}..{mine.stop - 1:<6d}"
                     f" {gate[0]}..{gate[-1]} | {up[0]}..{up[-1]}".ljust(64)
                     + f" {rows[0]}..{rows[-1]}".ljust(14)
                     + ("ranks " + ", ".join(map(str, peers)) if peers else "-"))
    return "\n".join(lines)
