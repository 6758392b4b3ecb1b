"""``mpicube info``'s context-parallel table: memory per rank, ring traffic
and attention FLOPs for cp 1, 2, 4 and 8 around the same tensor-parallel
group, for each layout.

Why a table of its own: long sequences are where activations, not
weights, fill a rank (blockwise attention keeps O(T) per head, but every
linear input and GELU cache is still T x h per sequence), and cp is the
axis that divides them: each cp rank keeps T/cp positions of every
sequence, for the price of the K/V ring. The world grows with cp (world =
dp x cp x tp); the weights per rank stay those of the tp group.
"""

from __future__ import annotations

from ..core.config import ModelConfig
from .costflops import step_flops
from .costcp import ring_traffic, ulysses_traffic
from .costmodel import step_traffic
from .costmemory import step_memory_bytes

CP_SIZES = (1, 2, 4, 8)


def _fmt_bytes(n) -> str:
    n = float(n)
    for unit, scale in (("TiB", 2 ** 40), ("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def context_table(cfg: ModelConfig, batch_size: int, tp: int, dp: int = 1, dtype: str = "float32",
                  recompute: str = "none", cps=CP_SIZES, ep: int = 1) -> str:
    """For each layout on ``tp`` ranks (and ``dp`` replicas) and each cp:
    world, memory per rank (total and activations), bytes and messages
    on the cp axis per rank per step (the K/V ring and the weight
    gradients' sum over cp), and GEMM + attention TFLOPs per rank per step."""
    from .costreport import _problem, comparison_depth

    lines = [f"context parallelism at seq_len {cfg.n_ctx}, batch {batch_size}, tp {tp}, dp {dp}, {dtype} "
             "(per rank per step; world = dp x cp x tp):",
             f"  {'layout':<10} {'cp':>3} {'world':>6} {'memory':>10} {'activations':>12} {'cp bytes':>11} "
             f"{'cp msgs':>9} {'TFLOPs':>8}"]
    for name in ("1d", "2d", "2.5d", "3d"):
        depth = comparison_depth(tp) if name == "2.5d" else 1
        label = f"{name} d={depth}" if name == "2.5d" else name
        for cp in cps:
            world = dp * cp * tp
            p = _problem(name, cfg, batch_size, world, dp, depth, dtype, recompute, cp=cp, ep=ep)
            if isinstance(p, str):
                lines.append(f"  {label:<10} {cp:>3} {world:>6} n/a: {p}")
                continue
            m, t = step_memory_bytes(p), step_traffic(p)
            lines.append(f"  {label:<10} {cp:>3} {world:>6} {_fmt_bytes(m.total()):>10} "
                         f"{_fmt_bytes(m.activations):>12} {_fmt_bytes(t.bytes.get('cp', 0)):>11} "
                         f"{t.msgs.get('cp', 0):>9} {float(step_flops(p)) / 1e12:>8.4g}")
    return "\n".join(lines)


def context_tables(cfg: ModelConfig, batch_size: int, tp: int, dp: int = 1, dtype: str = "float32",
                   recompute: str = "none", ep: int = 1, kinds: bool = False) -> str:
    """``context_table``, and with ``kinds`` (info under --cp > 1, a dense
    model) ``cp_kind_table`` after it."""
    text = context_table(cfg, batch_size, tp, dp, dtype, recompute, ep=ep)
    if kinds and not cfg.moe:
        text += "\n\n" + cp_kind_table(cfg, batch_size, tp, dp, dtype, recompute)
    return text


def cp_kind_table(cfg: ModelConfig, batch_size: int, tp: int, dp: int = 1, dtype: str = "float32",
                  recompute: str = "none", cps=CP_SIZES[1:], hybrid: int = 2) -> str:
    """For each layout on ``tp`` ranks and each cp: the attention traffic
    per rank per step of the ring (K/V shifts, axis cp), Ulysses (the
    all-to-alls, axis ulysses) and the hybrid of Ulysses groups of
    ``hybrid`` ranks with a ring over cp / ``hybrid`` of them: bytes, then
    messages. n/a where the plan is refused (Ulysses needs cp to divide
    each tensor-parallel rank's heads). The weights' gradient sum over cp
    is the same for all three and left out."""
    from .costreport import _problem, comparison_depth

    def cell(name, depth, cp, kind, u):
        p = _problem(name, cfg, batch_size, dp * cp * tp, dp, depth, dtype, recompute, cp=cp, cp_kind=kind,
                     ulysses=u)
        if isinstance(p, str):
            return "n/a"
        t = ring_traffic(p)
        t.add(ulysses_traffic(p))
        nbytes = sum(t.bytes.values()) * p.grad_accum
        return f"{_fmt_bytes(nbytes)} / {sum(t.msgs.values()) * p.grad_accum}"

    lines = [f"context-parallel kinds at seq_len {cfg.n_ctx}, batch {batch_size}, tp {tp}, dp {dp}, {dtype}: "
             "attention traffic per rank per step (bytes / messages):",
             f"  {'layout':<10} {'cp':>3} {'ring':>20} {'ulysses':>20} {f'hybrid u={hybrid}':>20}"]
    for name in ("1d", "2d", "2.5d", "3d"):
        depth = comparison_depth(tp) if name == "2.5d" else 1
        label = f"{name} d={depth}" if name == "2.5d" else name
        for cp in cps:
            hyb = cell(name, depth, cp, "hybrid", hybrid) if cp > hybrid and cp % hybrid == 0 else "-"
            lines.append(f"  {label:<10} {cp:>3} {cell(name, depth, cp, 'ring', 1):>20} "
                         f"{cell(name, depth, cp, 'ulysses', 1):>20} {hyb:>20}")
    return "\n".join(lines)
