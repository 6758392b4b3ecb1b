"""``info --experts``: where every expert and each shard of it sits, rank
by rank, and one dispatch step's all-to-all, drawn from the code's own
rules."""

from __future__ import annotations


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
