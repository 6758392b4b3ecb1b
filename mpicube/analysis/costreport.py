"""The report behind ``mpicube info``: one layout's sharding plan and
per-rank predictions, the four schemes side by side, and every memory
option (``--recompute``, ``--zero``) with what it costs. Pure arithmetic
over ``mpicube.analysis.costmodel``; nothing here runs a model."""

from __future__ import annotations

import re

from ..core.config import ModelConfig
from .costflops import step_flops
from .costcp import attention_split
from .costmodel import Problem, kv_param_sizes, local_param_sizes, step_traffic
from .costmemory import kv_cache_elems, step_memory, step_memory_bytes
from .fp8_report import fp8_report  # noqa: F401 (info --fp8's section, imported with the others)
from ..parallel.gridspec import GridSpec
from ..parallel.grid import plan
from ..parallel.layouts.base import RECOMPUTE_MODES
from ..model.gpt import gpt_params

SHARDED = {1: "optimizer state", 2: "optimizer state and gradients", 3: "optimizer state, gradients and weights"}


def comparison_depth(tp: int) -> int:
    """A depth for 2.5-D at this size: d = q when tp is a cube (Tesseract's
    usual choice), else the smallest d > 1 leaving a square grid."""
    from ..parallel.grid import integer_root

    q = integer_root(tp, 3)
    if q and q > 1:
        return q
    for d in range(2, tp + 1):
        if tp % d == 0 and integer_root(tp // d, 2):
            return d
    return 1


def _fmt(n) -> str:
    n = float(n)
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.4g}"


def _problem(name, cfg, batch_size, world_size, dp, depth, dtype="float32", recompute="none", grad_accum=1,
             zero=0, cp=1, sequence_parallel=False, ep=1, cp_kind="ring", ulysses=1, optimizer="adamw", hsdp=1):
    """A validated Problem, or the ConfigError's message (a mixture's
    plan checked as train checks it: ``planning.check_moe``; Ulysses'
    sizes as ``planning.resolve`` checks them)."""
    from ..core.errors import ConfigError
    from ..parallel.gridspec import Plan
    from ..parallel.planning import check_moe

    try:
        grid = GridSpec(name, dp=dp, cp=cp, depth=depth, sequence_parallel=sequence_parallel, cp_kind=cp_kind,
                        ulysses=ulysses, zero=zero, hsdp=hsdp)
        from ..parallel.planning import validate_hsdp

        validate_hsdp(grid)
        _, resolved, tp = plan(grid, cfg, batch_size, world_size, grad_accum, recompute)
        check_moe(Plan(resolved, dp=dp, cp=cp, depth=depth, sequence_parallel=sequence_parallel, zero=zero,
                       recompute=recompute, grad_accum=grad_accum, ep=ep), cfg, tp, resolved)
    except ConfigError as err:
        return str(err)
    return Problem(cfg, resolved, tp, dp, depth if resolved == "2.5d" else 1, batch_size, cfg.n_ctx, dtype,
                   recompute=recompute, grad_accum=grad_accum, zero=zero, cp=cp,
                   sequence_parallel=sequence_parallel, ep=ep, ulysses=grid.ulysses_size, optimizer=optimizer,
                   hsdp=hsdp)


def report(layout_name: str, cfg: ModelConfig, batch_size: int, world_size: int, dp: int = 1,
           depth: int = 1, dtype: str = "float32", recompute: str = "none", grad_accum: int = 1,
           zero: int = 0, cp: int = 1, sequence_parallel: bool = False, ep: int = 1, optimizer: str = "adamw",
           hsdp: int = 1) -> str:
    """Sharding plan and per-rank predictions for one layout (with the
    ``recompute`` mode's communication, memory and FLOPs, ``grad_accum``
    micro-batches, and with ``zero=1`` the optimizer state sharded over
    dp), then the four schemes side by side at the same world size, in
    bytes of ``dtype``'s real widths (mixed precision: 16-bit activations,
    panels and their sums, float32 statistics, gradient sums and optimizer
    state)."""
    from ..parallel.zero import validate

    validate(zero, dp)
    chosen = _problem(layout_name, cfg, batch_size, world_size, dp, depth, dtype, recompute, grad_accum, zero, cp,
                      sequence_parallel, ep, optimizer=optimizer, hsdp=hsdp)
    if isinstance(chosen, str):
        from ..core.errors import ConfigError

        raise ConfigError(chosen)
    lines = [f"layout {chosen.layout}: world {world_size} = dp {dp}" + (f" x cp {cp}" if cp > 1 else "")
             + f" x tp {chosen.tp}" + (f", ep {ep} of dp" + (" x cp" if cp > 1 else "") if ep > 1 else "")
             + (f", depth {chosen.depth}" if chosen.layout == "2.5d" else "")
             + (f", {SHARDED[chosen.zero]} sharded over dp (--zero {chosen.zero})" if chosen.sharded else "")
             + (f" in {hsdp} replicas of {dp // hsdp}-rank shard groups (--hsdp {hsdp})" if hsdp > 1 else "")
             + (", Muon (hidden matrices gathered whole over dp and tp)" if optimizer == "muon" else "")
             + (", sequence parallel (LayerNorm, dropout, residuals: T/tp positions)"
                if chosen.sequence_parallel else ""),
             f"batch {batch_size} sequences x {cfg.n_ctx} tokens per step"
             + (f", in {grad_accum} micro-batches of {batch_size // grad_accum}" if grad_accum > 1 else "")
             + f", --recompute {recompute}", "",
             "sharding plan (per rank):",
             f"  {'tensor':<28} {'global shape':>16} {'local elems':>12}  gradient summed over"]
    sizes, kv = local_param_sizes(chosen), kv_param_sizes(chosen)
    shown = {}
    for decl in gpt_params(cfg):
        key = decl.name.split(".", 2)[-1] if decl.name.startswith("h.") else decl.name
        key = re.sub(r"^moe\.experts\.\d+\.", "moe.experts.*.", key)    # one row for every expert
        if key in shown or decl.name not in sizes:
            continue
        shown[key] = True
        n, axis = sizes[decl.name]
        label = ("h.*." + key) if decl.name.startswith("h.") else key
        summed = axis or "-"
        if decl.name in kv:          # replicated kv heads: their k/v columns summed over the sharers
            summed = (f"{axis}, " if axis else "") + f"kv ({kv[decl.name][0]} k/v elements, {kv[decl.name][1]} ranks)"
        lines.append(f"  {label:<28} {str(decl.shape):>16} {n:>12}  {summed}")
    if cfg.moe:
        lines.append(f"  (h.*.moe.experts.*: {cfg.n_experts // ep} of the {cfg.n_experts} experts a rank"
                     + (f", their gradients summed over the {chosen.edp} ranks holding them (axis edp)" if ep > 1
                        else "") + ")")
    traffic, memory, nbytes = step_traffic(chosen), step_memory(chosen), step_memory_bytes(chosen)
    lines += ["", f"communication per rank per step ({dtype}: elements, bytes, messages):"]
    for axis in sorted(traffic.elems):
        lines.append(f"  {axis:<10} {_fmt(traffic.elems[axis]):>10} {_fmt(traffic.bytes[axis]) + 'B':>10} "
                     f"{traffic.msgs[axis]:>8}")
    lines.append(f"  {'total':<10} {_fmt(traffic.total_elems()):>10} {_fmt(traffic.total_bytes()) + 'B':>10} "
                 f"{traffic.total_msgs():>8}")
    lines += ["", f"memory per rank ({dtype}: elements, bytes):"]
    for field_name in ("params", "grads", "optimizer", "activations"):
        lines.append(f"  {field_name:<12} {_fmt(getattr(memory, field_name)):>10}  "
                     f"{_fmt(getattr(nbytes, field_name))}B")
    lines.append(f"  {'total':<12} {_fmt(memory.total()):>10}  {_fmt(nbytes.total())}B")
    tflops = float(step_flops(chosen)) / 1e12
    lines += ["", f"GEMM and attention FLOPs per rank per step (predicted, not measured): {tflops:.4g} T"]
    cache = kv_cache_elems(chosen)
    lines.append(f"generation's key/value cache per rank ({attention_split(chosen)[0]} of the {batch_size} "
                 f"sequences x {cfg.n_ctx} positions"
                 + (f", the kv latent {cfg.kv_lora_rank} and k_pe {cfg.qk_rope_head_dim} a token" if cfg.mla else
                    f", {cfg.kv_heads} kv heads" if cfg.llama else "") + f"): {_fmt(cache)} elements, "
                 f"{_fmt(cache * chosen.widths.act)}B")
    lines += ["", compare(cfg, batch_size, world_size, dp, dtype, grad_accum, zero, ep)]
    return "\n".join(lines)


def compare(cfg: ModelConfig, batch_size: int, world_size: int, dp: int = 1, dtype: str = "float32",
            grad_accum: int = 1, zero: int = 0, ep: int = 1) -> str:
    """1-D, 2-D, 2.5-D and 3-D at the same world size: communication and
    memory per rank in bytes of ``dtype``, and each one's ratio to 3-D."""
    tp = world_size // dp if world_size % dp == 0 else 0
    rows = []
    for name in ("1d", "2d", "2.5d", "3d"):
        depth = comparison_depth(tp) if name == "2.5d" and tp else 1
        rows.append((name, depth, _problem(name, cfg, batch_size, world_size, dp, depth, dtype,
                                           grad_accum=grad_accum, zero=zero, ep=ep)))
    base = next((p for n, _, p in rows if n == "3d" and not isinstance(p, str)), None)
    base_t = step_traffic(base).total_bytes() if base else None
    base_m = step_memory_bytes(base).total() if base else None
    lines = [f"all schemes at world {world_size} (dp {dp}{f', zero {zero}' if zero and dp > 1 else ''}), {dtype}, "
             "per rank per step:",
             f"  {'layout':<10} {'comm bytes':>11} {'messages':>9} {'memory':>10} {'comm/3d':>8} {'mem/3d':>7}"]
    for name, depth, p in rows:
        label = f"{name} d={depth}" if name == "2.5d" else name
        if isinstance(p, str):
            lines.append(f"  {label:<10} n/a: {p}")
            continue
        t, m = step_traffic(p), step_memory_bytes(p)
        ratio_t = f"{float(t.total_bytes() / base_t):.2f}x" if base_t else "-"
        ratio_m = f"{m.total() / base_m:.2f}x" if base_m else "-"
        lines.append(f"  {label:<10} {_fmt(t.total_bytes()) + 'B':>11} {t.total_msgs():>9} "
                     f"{_fmt(m.total()) + 'B':>10} {ratio_t:>8} {ratio_m:>7}")
    return "\n".join(lines)


def memory_options(cfg: ModelConfig, batch_size: int, world_size: int, dp: int = 1, dtype: str = "float32",
                   grad_accum: int = 1, ep: int = 1) -> str:
    """Every scheme under every ``--recompute`` mode (and ``--zero`` setting,
    where dp > 1 gives it replicas to shard over): memory per rank, and what
    each option costs against the same layout with none: extra bytes and
    messages moved and extra FLOPs, per rank per step. The question it
    answers is the paper's: which layout fits, and at what price."""
    tp = world_size // dp if world_size % dp == 0 else 0
    zeros = (0, 1, 2, 3) if dp > 1 else (0,)
    lines = [f"memory per rank by option, world {world_size} (dp {dp}), {dtype}, batch {batch_size}"
             + (f" in {grad_accum} micro-batches" if grad_accum > 1 else "") + ":",
             f"  {'layout':<10} {'recompute':<9} {'zero':>4} {'memory':>9} {'mem/none':>8} "
             f"{'+comm bytes':>11} {'+messages':>9} {'+FLOPs':>7}"]
    for name in ("1d", "2d", "2.5d", "3d"):
        depth = comparison_depth(tp) if name == "2.5d" and tp else 1
        label = f"{name} d={depth}" if name == "2.5d" else name
        base = _problem(name, cfg, batch_size, world_size, dp, depth, dtype, grad_accum=grad_accum, ep=ep)
        if isinstance(base, str):
            lines.append(f"  {label:<10} n/a: {base}")
            continue
        base_mem, base_t, base_f = step_memory_bytes(base).total(), step_traffic(base), step_flops(base)
        for recompute in RECOMPUTE_MODES:
            for zero in zeros:
                p = _problem(name, cfg, batch_size, world_size, dp, depth, dtype, recompute, grad_accum, zero, ep=ep)
                if isinstance(p, str):
                    lines.append(f"  {label:<10} {recompute:<9} {zero:>4} n/a: {p}")
                    continue
                mem, t, f = step_memory_bytes(p).total(), step_traffic(p), step_flops(p)
                lines.append(f"  {label:<10} {recompute:<9} {zero:>4} {_fmt(mem) + 'B':>9} "
                             f"{100 * mem / base_mem:>7.1f}% {_fmt(round(t.total_bytes() - base_t.total_bytes())) + 'B':>11} "
                             f"{t.total_msgs() - base_t.total_msgs():>9} {float((f - base_f) / base_f):>+6.0%}")
    if dp == 1:
        lines.append("  (--zero 1-3 shard the optimizer state, gradients and weights over data-parallel replicas: "
                     "with --dp 1 there are none)")
    return "\n".join(lines)


def zero_options(cfg: ModelConfig, batch_size: int, world_size: int, dp: int, dtype: str = "float32",
                 grad_accum: int = 1, recompute: str = "none", ep: int = 1) -> str:
    """Every scheme under --zero 0-3 (dp > 1): per rank, the weights,
    gradients and optimizer state ZeRO shards (their peak, the gathered
    and prefetched layers of --zero 3 included), what each step moves, and
    the yardstick of full sharding: 1/dp of --zero 0's weights + gradients
    + optimizer state plus one layer's gathered weights."""
    from ..parallel import zero as zero_mod

    tp = world_size // dp if world_size % dp == 0 else 0
    lines = [f"weights + gradients + optimizer state per rank by --zero, world {world_size} (dp {dp}), {dtype}:",
             f"  {'layout':<10} {'zero':>4} {'weights':>9} {'grads':>9} {'optimizer':>9} {'w+g+o':>9} "
             f"{'of zero 0':>9} {'0/dp+layer':>10} {'comm bytes':>11} {'messages':>9}"]
    for name in ("1d", "2d", "2.5d", "3d"):
        depth = comparison_depth(tp) if name == "2.5d" and tp else 1
        label = f"{name} d={depth}" if name == "2.5d" else name
        base = _problem(name, cfg, batch_size, world_size, dp, depth, dtype, recompute, grad_accum, ep=ep)
        if isinstance(base, str):
            lines.append(f"  {label:<10} n/a: {base}")
            continue
        m0 = step_memory_bytes(base)
        state0 = m0.params + m0.grads + m0.optimizer
        sizes = [(n, size) for n, (size, _) in local_param_sizes(base).items()]
        layer = max(dp * c for seg, _, c in zero_mod.segment_sizes(sizes, dp, 3) if seg != zero_mod.OUTSIDE)
        bar = state0 / dp + layer * base.widths.act
        for z in (0, 1, 2, 3):
            p = _problem(name, cfg, batch_size, world_size, dp, depth, dtype, recompute, grad_accum, z, ep=ep)
            if isinstance(p, str):
                lines.append(f"  {label:<10} {z:>4} n/a: {p}")
                continue
            m, t = step_memory_bytes(p), step_traffic(p)
            state = m.params + m.grads + m.optimizer
            lines.append(f"  {label:<10} {z:>4} {_fmt(m.params) + 'B':>9} {_fmt(m.grads) + 'B':>9} "
                         f"{_fmt(m.optimizer) + 'B':>9} {_fmt(state) + 'B':>9} {100 * state / state0:>8.1f}% "
                         f"{_fmt(bar) + 'B':>10} {_fmt(round(t.total_bytes())) + 'B':>11} {t.total_msgs():>9}")
    return "\n".join(lines)


def summary(layout_name: str, cfg: ModelConfig, batch_size: int, world_size: int, dp: int = 1, depth: int = 1,
            dtype: str = "float32", recompute: str = "none", grad_accum: int = 1, zero: int = 0, cp: int = 1,
            sequence_parallel: bool = False, ep: int = 1) -> dict:
    """The chosen layout and options, per rank per step, for ``info --json``:
    what a script sizing a job needs without parsing the report."""
    p = _problem(layout_name, cfg, batch_size, world_size, dp, depth, dtype, recompute, grad_accum, zero, cp,
                 sequence_parallel, ep)
    t, m = step_traffic(p), step_memory_bytes(p)
    return {"layout": p.layout, "tp": p.tp, "dp": p.dp, "cp": p.cp, "ep": p.ep, "sequence_parallel": p.sequence_parallel,
            "depth": p.depth, "batch_size": p.batch,
            "seq_len": p.seq_len, "dtype": p.dtype, "recompute": p.recompute, "zero": p.zero,
            "grad_accum": p.grad_accum,
            "memory_bytes_per_rank": int(m.total()),
            "memory_bytes_by_kind": {k: int(getattr(m, k)) for k in ("params", "grads", "optimizer", "activations")},
            "comm_elems_per_rank": float(t.total_elems()), "comm_bytes_per_rank": float(t.total_bytes()),
            "comm_msgs_per_rank": int(t.total_msgs()), "flops_per_rank": float(step_flops(p))}
