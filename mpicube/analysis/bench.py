"""``mpicube bench``: time training steps and put the figures beside the
cost model.

For each requested layout: warm-up steps, then timed steps on fixed random
tokens (data loading is not what is measured). Reports the median step time
and its spread, tokens/s, model FLOP/s and their fraction of a plain matmul
timed in the same process, the forward/backward/gradient-sync/optimizer split
and the time inside MPI, the measured communication beside the analytic
prediction, and memory per rank by category.

Model FLOPs per step (the usual dense count, causal mask not discounted):
6 N (P_blocks + V h) + 12 L N T h, with N = B T tokens, P_blocks the
parameters of the transformer blocks, V h the tied LM head; per rank it is
divided by the world size.

Under mixed precision the same-process matmul is the 16-bit GEMM the model
uses (``precision.matmul``: on CPUs the float32 conversion of the panels
included), with the plain float32 matmul of the same shape beside it, so the
conversion's cost is visible; memory and communication are reported in
bytes as well as elements, measured beside predicted.
"""

from __future__ import annotations

import resource
import time

import numpy as np

from ..device import kernels, precision
from ..ops import rng
from ..parallel import waiting
from .costmodel import Problem, step_traffic
from .costmemory import step_memory, step_memory_bytes
from ..training.step import make_step


def model_flops(cfg, batch_size: int, seq_len: int) -> float:
    """Training FLOPs of one step on the whole global batch."""
    h, L, V = cfg.n_embd, cfg.n_layer, cfg.vocab_size
    n_tokens = batch_size * seq_len
    block_params = cfg.n_params() - V * h - cfg.n_ctx * h - 2 * h
    return 6.0 * n_tokens * (block_params + V * h) + 12.0 * L * n_tokens * seq_len * h


def median_seconds(run, repeats: int = 5, min_seconds: float = 0.2, warmup: int = 2) -> float:
    """Median wall time of ``run()`` over at least ``repeats`` calls spanning
    ``min_seconds``, after ``warmup`` untimed calls: one short burst is at
    the mercy of whatever else the machine is doing."""
    for _ in range(warmup):
        run()
    times = []
    while len(times) < repeats or sum(times) < min_seconds:
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def gemm_rate(backend, m: int, k: int, n: int, repeats: int = 5, min_seconds: float = 0.2,
              dtype=None) -> float:
    """FLOP/s of a plain (m, k) x (k, n) matmul on this backend in ``dtype``
    (default the backend's; 16-bit formats through ``precision.matmul``, as
    the model runs them) (median_seconds)."""
    xp = backend.xp
    dtype = backend.dtype if dtype is None else dtype
    # uniform operands in [-0.5, 0.5): multipliers fed constants toggle fewer
    # bits, draw less power and can clock higher than on real data
    a = (rng.uniform(rng.make_key("gemm", 1), xp.arange(m * k, dtype=np.uint64)) - 0.5).astype(np.float32)
    b = (rng.uniform(rng.make_key("gemm", 2), xp.arange(k * n, dtype=np.uint64)) - 0.5).astype(np.float32)
    a, b = a.reshape(m, k).astype(dtype), b.reshape(k, n).astype(dtype)        # (m, k), (k, n)
    out = xp.empty((m, n), dtype=dtype)

    def run():
        backend.synchronize()
        precision.matmul(a, b, out=out)
        backend.synchronize()

    return 2.0 * m * k * n / median_seconds(run, repeats, min_seconds)


def bench_layout(parts, seq_len: int, warmup: int, steps: int, seed: int = 0, profile=None) -> dict:
    """Time ``steps`` training steps after ``warmup`` ones; figures for this rank
    (rank 0's are reported). ``profile`` (a function of the optimizer step
    giving an ``analysis.profile.ProfileSession``) profiles some of the
    steps, numbered from 1 with the warm-up ones; profiled steps are timed
    apart (``"profile"``: their median beside the others', the overhead) and
    left out of the figures when other steps are timed."""
    layout, store, model, counters, backend = parts.layout, parts.store, parts.model, parts.counters, parts.backend
    cfg = parts.cfg
    opt = make_step(store, layout.axes)          # --zero 1: zero.ShardedStep
    session = profile(opt) if profile is not None else None
    profiled, cpu = [], []                        # per timed step: whether it was profiled; its CPU seconds
    loss_scale = 1024.0 if backend.dtype == np.float16 else 1.0     # as float16 training scales the loss
    B = parts.batch_size                                                       # the step's, all micro-batches
    tokens = np.random.default_rng(seed).integers(0, cfg.vocab_size, (B, seq_len + 1))
    x, y = tokens[:, :-1], tokens[:, 1:]                                        # (B, T)
    phases = {"forward_s": [], "backward_s": [], "sync_s": [], "optimizer_s": [], "comm_s": [], "step_s": []}
    saved = 0
    for i in range(warmup + steps):
        counters.reset()
        if i == warmup:
            waiting.STATS.reset()                 # the timed steps' waits only
        if session is not None:
            session.begin(i + 1)
        cpu0 = time.process_time()
        marks = [time.perf_counter()]
        store.zero_grad()
        if parts.layout.fp8 is not None:          # --fp8 delayed: as accum.forward_backward does each step
            parts.layout.fp8.begin_step(i + 1)
        fwd = bwd = 0.0
        pipe = parts.pipeline
        if pipe is not None:            # --pp: forwards and backwards interleave; "fwd" is the whole schedule
            measure = (lambda m, v: None) if i == 0 else None                # peak saved: walked once, untimed
            t0 = time.perf_counter()
            pipe.forward_backward(parts, x, y, i + 1, loss_scale, after_forward=measure)
            backend.synchronize()
            fwd = time.perf_counter() - t0
            if i == 0:
                saved, saved_bytes = pipe.peak_saved              # a rerun block included
        for m in range(parts.grad_accum if pipe is None else 0):   # as accum.forward_backward, timed apart
            rows = parts.micro_rows(m)
            t0 = time.perf_counter()
            model.forward(x[rows], y[rows], step=i + 1, micro=m)
            backend.synchronize()
            t1 = time.perf_counter()
            saved, saved_bytes = model.saved_elements(), model.saved_bytes()
            model.backward(loss_scale=loss_scale)
            saved += model.recompute_peak_elements      # --recompute blocks: one rerun block on top
            saved_bytes += model.recompute_peak_bytes
            backend.synchronize()
            fwd, bwd = fwd + t1 - t0, bwd + time.perf_counter() - t1
        marks += [marks[0] + fwd, time.perf_counter()]
        opt.sync()
        norm = opt.grad_norm() / loss_scale
        marks.append(time.perf_counter())
        opt.step(1e-4, min(1.0, 1.0 / (norm + 1e-6)) / loss_scale)
        backend.synchronize()
        marks.append(time.perf_counter())
        cpu1 = time.process_time()
        if session is not None:
            session.end(i + 1, (marks[0], marks[-1]))
        if i >= warmup:
            profiled.append(session is not None and session.profiling(i + 1))
            cpu.append(cpu1 - cpu0)
            for key, t0, t1 in zip(("forward_s", "backward_s", "sync_s", "optimizer_s"), marks, marks[1:]):
                phases[key].append(t1 - t0)
            phases["step_s"].append(marks[-1] - marks[0])
            phases["comm_s"].append(counters.total_seconds())
    problem = Problem(cfg, layout.name, layout.axes.tp.size, layout.axes.dp.size,
                      layout.describe().get("depth", 1), B, seq_len, backend.dtype.name, layout.recompute,
                      zero=store.zero, grad_accum=parts.grad_accum, cp=layout.axes.cp.size,
                      sequence_parallel=getattr(layout, "sequence_parallel", False), **_pipeline_terms(parts),
                      fp8=layout.fp8.recipe.name if layout.fp8 is not None else "")   # --fp8's amaxes (costfp8)
    predicted, memory, memory_bytes = step_traffic(problem), step_memory(problem), step_memory_bytes(problem)
    mixed = any(profiled) and not all(profiled)
    if mixed:                                     # the figures from the steps run as without --profile
        profiled_times = [t for t, p in zip(phases["step_s"], profiled) if p]
        cpu_ratio = (np.median([c for c, p in zip(cpu, profiled) if p])
                     / np.median([c for c, p in zip(cpu, profiled) if not p]))
        phases = {key: [t for t, p in zip(v, profiled) if not p] for key, v in phases.items()}
    else:
        profiled_times = phases["step_s"] if any(profiled) else []
    step_times = np.array(phases["step_s"])
    median = float(np.median(step_times))
    exposed = float(np.median(np.array(phases["comm_s"]) / step_times))   # time in MPI calls and waits
    world = layout.axes.world.size
    flops_rank = model_flops(cfg, B, seq_len) / world
    first_layer = parts.pipeline.chunks[0][2][0] if parts.pipeline is not None else 0     # this stage's first block
    fc = store.grad[f"h.{first_layer}.mlp.c_fc.weight"].shape                  # (h_in local, h_out local)
    gemm_shape = (len(layout.mid_seqs) * seq_len // layout.axes.cp.size, len(layout.canonical_cols), fc[1])
    rate = gemm_rate(backend, *gemm_shape)
    rate32 = gemm_rate(backend, *gemm_shape, dtype=np.float32) if backend.mixed else rate
    return {
        **layout.describe(),
        "overlap": layout.overlap,      # collectives overlapped with GEMMs (MPICUBE_OVERLAP)
        "world": world,
        "depth": layout.describe().get("depth", 1),
        "step_time_s": median,
        "step_time_spread_s": [float(step_times.min()), float(step_times.max())],
        "tokens_per_s": B * seq_len / median,
        "batch_size": B,
        "grad_accum": parts.grad_accum,
        "kernels": kernels.describe(backend.device),
        "kernel_threads": kernels.fused.threads() if backend.device == "cpu" else None,   # at the end
        "device": backend.device,
        "dtype": backend.dtype.name,
        "tf32": backend.tf32,
        "recompute": layout.recompute,
        "model_flops_per_step": model_flops(cfg, B, seq_len),
        "flops_per_s_per_rank": flops_rank / median,
        "gemm_flops_per_s": rate,
        "gemm_float32_flops_per_s": rate32,
        "gemm_fraction": flops_rank / median / rate,
        "split": {key: float(np.median(v)) for key, v in phases.items() if key != "step_s"},
        "exposed_comm_fraction": exposed,
        # How this rank's collectives waited over the timed steps (parallel/waiting.py): how many
        # did not finish at their first test, how many outlived the young window and slept.
        "waits": {"mode": waiting.MODE, "per_step": waiting.STATS.waited / steps,
                  "slept_per_step": waiting.STATS.slept / steps, "seconds_per_step": waiting.STATS.seconds / steps},
        **({"profile": profile_figures(session, profiled_times, median if mixed else None,
                                       cpu_ratio if mixed else None)} if session is not None else {}),
        "comm": {"measured_elems": float(counters.total_elems()), "measured_msgs": counters.total_msgs(),
                 "measured_bytes": float(counters.total_bytes()),
                 "predicted_elems": float(predicted.total_elems()), "predicted_msgs": predicted.total_msgs(),
                 "predicted_bytes": float(predicted.total_bytes()),
                 "exact": counters.total_elems() == predicted.total_elems()
                 and counters.total_bytes() == predicted.total_bytes()
                 and counters.total_msgs() == predicted.total_msgs()},
        "memory": {"params": memory.params, "grads": memory.grads, "optimizer": memory.optimizer,
                   "activations": memory.activations, "measured_params": int(
                       sum(b.size for b in store.param_buffers()) if store.streams_gradients else store.flat_work.size),
                   "measured_activations": int(saved),
                   "bytes": {"params": memory_bytes.params, "grads": memory_bytes.grads,
                             "optimizer": memory_bytes.optimizer, "activations": memory_bytes.activations,
                             "measured_activations": int(saved_bytes)},
                   "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024},
    }


def profile_figures(session, profiled_times: list, plain_median: float, cpu_ratio: float = None) -> dict:
    """What ``--profile`` adds to a layout's results: the trace's path, its
    fractions (rank 0's, over the profiled steps) and the overhead, the
    median profiled timed step against the median of the others (when
    both ran), in wall time and in this process's CPU time (which the
    machine's other load moves much less)."""
    out = {"steps": [session.first, session.last], "trace": str(session.out_dir / "profile.json")}
    if profiled_times:
        median = float(np.median(profiled_times))
        out["profiled_step_s"] = median
        if plain_median is not None:
            out["plain_step_s"] = plain_median
            out["overhead"] = median / plain_median - 1.0
            out["overhead_cpu"] = float(cpu_ratio) - 1.0
    if session.summary is not None:
        total = session.summary["ranks"][0]["total"]
        out["trace_fractions"] = {k: total[k + "_fraction"] for k in
                                  ("compute", "exposed", "idle", "communication", "overlapped", "accounted")}
        out["max_accounting_error"] = max(r["total"]["max_accounting_error"]
                                          for r in session.summary["ranks"].values())
    return out


def _pipeline_terms(parts) -> dict:
    """The cost model's pipeline fields for this rank's stage (none without stages)."""
    pipe = parts.pipeline
    if pipe is None:
        return {}
    return {"pp": pipe.P, "pp_schedule": pipe.schedule, "virtual_stages": pipe.V, "stage": pipe.stage}


def format_table(results: list, dtype_bytes=None) -> str:
    """Human-readable summary of ``bench_layout`` results (memory from their
    byte counts; ``dtype_bytes`` is not used any more)."""
    head = (f"{'layout':<8} {'world':>5} {'step ms':>9} {'spread ms':>15} {'tok/s':>9} {'GFLOP/s':>8} "
            f"{'gemm%':>6} {'fwd':>6} {'bwd':>6} {'sync':>6} {'opt':>6} {'mpi':>6} "
            f"{'exposed':>8} {'comm bytes':>11} {'predicted':>11} {'mem MB':>8}")
    lines = [head, "-" * len(head)]
    for r in results:
        s, c, m = r["split"], r["comm"], r["memory"]["bytes"]
        mem = (m["params"] + m["grads"] + m["optimizer"] + m["activations"]) / 1e6
        spread = f"{r['step_time_spread_s'][0] * 1e3:.1f}-{r['step_time_spread_s'][1] * 1e3:.1f}"
        lines.append(
            f"{r['layout'] + ('' if r.get('overlap', True) else '/off'):<8} {r['world']:>5} {r['step_time_s'] * 1e3:>9.1f} {spread:>15} "
            f"{r['tokens_per_s']:>9.0f} {r['flops_per_s_per_rank'] / 1e9:>8.2f} {100 * r['gemm_fraction']:>5.1f}% "
            + " ".join(f"{s[k] * 1e3:>6.1f}" for k in ("forward_s", "backward_s", "sync_s", "optimizer_s", "comm_s"))
            + f" {100 * r['exposed_comm_fraction']:>7.1f}% {c['measured_bytes']:>11.4g} "
            f"{c['predicted_bytes']:>11.4g} {mem:>8.2f}")
    if results:
        r = results[0]
        lines.append(f"device {r['device']}, {r['dtype']}{' (TF32 GEMMs)' if r['tf32'] else ''}; "
                     f"kernels: {r['kernels'].split(',')[0]}; {r['flops_per_s_per_rank'] / 1e12:.3f} model TFLOP/s per rank")
        if r["gemm_float32_flops_per_s"] != r["gemm_flops_per_s"]:
            lines.append(f"{r['dtype']} GEMM (float32 accumulation, conversions included) "
                         f"{r['gemm_flops_per_s'] / 1e9:.2f} GFLOP/s, float32 GEMM of the same shape "
                         f"{r['gemm_float32_flops_per_s'] / 1e9:.2f} GFLOP/s")
    if results:
        w = results[0]["waits"]
        lines.append(f"waits (rank 0, wait {w['mode']}): {w['per_step']:.1f} collectives per step waited "
                     f"{w['seconds_per_step'] * 1e3:.1f} ms in all, {w['slept_per_step']:.2f} past the young "
                     f"window (slept)")
    lines.append("Times in ms per step (median); "
                 "gemm% = model FLOP/s per rank / same-process matmul FLOP/s; "
                 "mpi = time inside MPI calls (part of fwd/bwd/sync); exposed = mpi / step: communication nothing "
                 "overlapped (a layout/off row: its collectives blocking, MPICUBE_OVERLAP=0); "
                 "memory = params+grads+Adam+saved activations"
                 + ("; under --pp, fwd is the whole schedule (forwards and backwards interleave), rank 0 is "
                    "stage 0" if any(r.get("pp", 1) > 1 for r in results) else ""))
    return "\n".join(lines)


def threads_line(share, ran) -> str:
    """bench's one word on threads: the share decided for each rank and,
    when the fused kernels ended the timed steps on another count (the
    adaptive count lowers it while other processes hold cores), that too,
    so the report does not say two numbers without saying why."""
    from ..device.threads import ADAPT_VAR

    line = f"threads: {share.describe()}"
    if ran is not None and ran != share.threads:
        line += (f"; the fused kernels ended the timed steps on {ran} (lowered while other processes held "
                 f"cores; {ADAPT_VAR}=0 keeps {share.threads})")
    return line
