"""The bubble table of docs/pipeline.md: for 1F1B and the zero-bubble
schedules on one model and batch (2 ranks, ``--pp 2``), the formula's
bubble and the cost model's at its stated rates (both as ``mpicube info``
prints them), the cost model's at rates measured on this machine before
the runs, the measured one of a profiled run (``mpicube timeline``), and
a replay: the same simulator as the cost model's, fed each action's
measured duration from the run's profile instead of the model's FLOPs and
bytes (with the model's transfers and no time between actions). The replay
splits the gap between model and measurement in two: model -> replay is
what the model gets wrong about the phases' lengths; replay -> measured is
time outside the phases (the interpreter between actions, receives that
wait on a late sender, a loaded machine's time slices).

The rates (``measure_rates``, printed above the table) are taken before
the trainings, on one thread (the BLAS's and the fused kernels'), as
each rank of the runs has one core: the GEMM rate from the run's own
GEMMs (a block's four linears, forward, dX and dW, at the run's shapes,
through the code's own fixed-panel GEMM);
the memory rate from elementwise passes the model counts (a block's
forward passes but attention's, at the run's shapes, over their bytes as
``analysis.costpasses`` counts them: arrays of this size sit in cache,
so a large copy would misstate them, and the mix of plain and
transcendental passes is the model's), the two timed in turn; the
time an action from a profiled calibration run (a small model, ZBV:
many actions, little work): the time inside each rank's first-to-last
phase that is neither a phase nor a receive's wait, per action the
executor ran there. That one is taken from a run because it is the
executor's and the profiler's own time, which a timed loop outside them
would not see; it is a separate run so that no figure of the table is
fitted to the runs it is set beside.

    PYTHONPATH=. python tools/bubble_table.py --train --runs runs   # rates, 4 runs (mpiexec -n 2), the table
    PYTHONPATH=. python tools/bubble_table.py --runs runs           # the table from runs already there
    PYTHONPATH=. python tools/bubble_table.py --check docs/pipeline.md

It wants one free core per rank: on a busy machine the measured column
(and the measured rates) say more about the machine than about the
schedule. ``--check`` holds the page's formula and model columns to what
the code gives now, the measured-rates column at the rates the page
states (no runs: tests/test_costpipe.py runs it).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mpicube.analysis.costbubble import Rates, modelled_bubble, transfer_seconds  # noqa: E402
from mpicube.analysis.costpasses import ACTIVATION, NORM  # noqa: E402
from mpicube.analysis.costpipe import schedule_of  # noqa: E402
from mpicube.analysis.costpipereport import _chosen, pipeline_summary  # noqa: E402
from mpicube.analysis.profile_summary import _top_level, _union  # noqa: E402
from mpicube.analysis.timeline import PIPELINE_PHASES, load, pipeline_bubble  # noqa: E402
from mpicube.core.config import ModelConfig  # noqa: E402
from mpicube.parallel.schedules import COMPUTE, simulate  # noqa: E402

SCHEDULES = (("1F1B", "1f1b", 1), ("ZB-H1", "zb-h1", 1), ("ZBV", "zbv", 2), ("DualPipeV", "dualpipev", 2))
MODEL = ["--n-layer", "8", "--n-embd", "256", "--n-head", "8", "--seq-len", "128"]
RUN = ["--layout", "serial", "--pp", "2", "--batch-size", "16", "--grad-accum", "8"]
CFG = ModelConfig(n_layer=8, n_embd=256, n_head=8, n_ctx=128)
TOKENS = 16 // 8 * 128                 # one micro-batch's tokens on a rank: batch / grad-accum x seq-len
CALIBRATION = ["--layout", "serial", "--pp", "2", "--pp-schedule", "zbv", "--virtual-stages", "2",
               "--n-layer", "4", "--n-embd", "256", "--n-head", "8", "--seq-len", "128", "--batch-size", "16",
               "--grad-accum", "8", "--steps", "3", "--profile", "2:3"]
CALIBRATION_CFG = ModelConfig(n_layer=4, n_embd=256, n_head=8, n_ctx=128)
RATES_LINE = re.compile(r"Rates measured[^:]*: ([0-9.]+), ([0-9.]+) and ([0-9.]+) GFLOP/s \([^)]*\), ([0-9.]+) GB/s, "
                        r"([0-9.]+) us an action")
PHASE_OF = {"forward": "forward", "backward": "backward", "backward_input": "backward",
            "backward_weight": "backward weight"}


def info_figures(schedule: str, virtual: int) -> tuple:
    """(formula, model) bubbles as ``mpicube info`` computes them for the run."""
    args = ("serial", CFG, 16, 2, 1, 1, 2, schedule, virtual)
    s = pipeline_summary(*args, grad_accum=8)
    return s["bubble"], s["modelled_bubble"], _chosen(*args, "float32", "none", 8, 0)


def train(runs: Path, schedule: str, virtual: int) -> Path:
    out = runs / f"bubble-{schedule}"
    _launch([*RUN, "--pp-schedule", schedule, *(["--virtual-stages", str(virtual)] if virtual > 1 else []),
             *MODEL, "--steps", "4", "--profile", "3:4"], out)
    return out


def _launch(options: list, out: Path) -> None:
    cmd = ["mpiexec", "-n", "2", sys.executable, "-m", "mpicube", "train", *options, "--out", str(out)]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    subprocess.run(cmd, check=True, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)


def compute_rates(repeats: int = 40) -> tuple:
    """(F's, B's and W's GEMM FLOP/s, the passes' B/s) of one thread:
    ``gemm_work``'s three kinds and ``passes_work`` timed in turn, the
    median of each, so that all see the same moments of the machine's load
    and their ratios (all the bubble sees) hold better than any one."""
    gemms, (passes, nbytes) = gemm_work(), passes_work()
    work = [run for run, _ in gemms] + [passes]
    for fn in work:
        fn()                                                         # warm: caches, numba's compiled kernels
    times = [[] for _ in work]
    for _ in range(repeats):
        for fn, out in zip(work, times):
            t = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t)
    median = [sorted(t)[len(t) // 2] for t in times]
    return tuple(flops / m for (_, flops), m in zip(gemms, median)) + (nbytes / median[-1],)


def gemm_work() -> list:
    """[(run, FLOPs)] for F, B and W: one thread's GEMMs of a GPT-2 block's
    four linears (c_attn, attn c_proj, c_fc, mlp c_proj) at one
    micro-batch's tokens, forward (X W), dX (dY W^T) and dW (X^T dY) apart,
    through the code's own GEMM (``precision.matmul``: fixed panels,
    ``device.gemm_threads``), which runs below a whole one-call GEMM of
    the same shape. A BLAS packs transposed operands otherwise, so the
    three kinds of the same sizes run at different rates."""
    import numpy as np

    from mpicube.device.precision import matmul

    rng = np.random.default_rng(0)
    C = CFG.n_embd
    shapes = ((C, 3 * C), (C, C), (C, 4 * C), (4 * C, C))            # (in, out) of each linear
    xs = [rng.standard_normal((TOKENS, i), dtype=np.float32) for i, _ in shapes]        # (N, in)
    ws = [rng.standard_normal(s, dtype=np.float32) for s in shapes]                     # (in, out)
    dys = [rng.standard_normal((TOKENS, o), dtype=np.float32) for _, o in shapes]       # (N, out)
    flops = sum(2 * TOKENS * i * o for i, o in shapes)
    operands = list(zip(xs, ws, dys))
    return [(lambda: [matmul(x, w) for x, w, _ in operands], flops),
            (lambda: [matmul(dy, w.T) for _, w, dy in operands], flops),
            (lambda: [matmul(x.T, dy) for x, _, dy in operands], flops)]


def passes_work() -> tuple:
    """(run, bytes): one thread's work on the elementwise passes of a GPT-2 block's
    forward as the code makes them, at the run's shapes: the two
    LayerNorms on (N, C), the four linears' bias adds, the GELU on (N, 4C)
    and the two residual adds (attention's passes sit between its
    products and are left out), over their bytes as
    ``analysis.costpasses`` counts them. The same mix of plain passes and
    transcendental ones (GELU's tanh) as the model prices."""
    import numpy as np

    from mpicube import ops
    from mpicube.device import fused

    rng = np.random.default_rng(0)
    C = CFG.n_embd
    x = rng.standard_normal((1, TOKENS, C), dtype=np.float32)                 # (1, N, C)
    h = rng.standard_normal((1, TOKENS, 4 * C), dtype=np.float32)             # (1, N, 4C)
    qkv = rng.standard_normal((1, TOKENS, 3 * C), dtype=np.float32)           # (1, N, 3C)
    gamma, beta = np.ones(C, dtype=np.float32), np.zeros(C, dtype=np.float32)  # (C,)
    biases = [np.zeros(w, dtype=np.float32) for w in (3 * C, C, 4 * C, C)]     # (out,) of each linear

    def run():
        with fused.forced_build("one_thread"):
            for _ in range(2):
                ops.layernorm_forward(x, gamma, beta, C)
                x + x
            for y, b in zip((qkv, x, h, x), biases):
                y += b
            ops.gelu_forward(h)
    elems = TOKENS * (2 * NORM[False][0] * C + 2 * 3 * C + 2 * (3 * C + C + 4 * C + C) + ACTIVATION[False][0] * 4 * C)
    return run, elems * 4


def action_time(runs: Path) -> float:
    """Seconds an action of the executor takes beside its phases, from a
    profiled calibration run (``CALIBRATION``): on each rank and step, the
    time inside its first-to-last phase that is neither a phase nor a
    receive's wait, over the actions the executor ran there (every action
    after the first phase up to the last)."""
    out = runs / "bubble-calibration"
    _launch(CALIBRATION, out)
    doc = load(out)
    gap, _, steps = _between(doc)
    p = _chosen("serial", CALIBRATION_CFG, 16, 2, 1, 1, 2, "zbv", 2, "float32", "none", 8, 0)
    actions = 0
    for acts in schedule_of(p):
        work = [i for i, a in enumerate(acts) if a.op in COMPUTE]
        actions += work[-1] - work[0]
    return gap / 1e6 / (steps * actions)


def measure_rates(runs: Path) -> Rates:
    """The machine's rates, measured now (the stated transfer rates kept:
    at these sizes they move the bubble by under 0.1 point)."""
    from threadpoolctl import threadpool_limits

    from mpicube.device import threads

    threads.set_pool_threads(1)
    with threadpool_limits(1):                                     # the BLAS too, as each rank runs it
        forward, dgrad, wgrad, memory_rate = compute_rates()
    return Rates(flop_rate=forward, dgrad_rate=dgrad, wgrad_rate=wgrad, memory_rate=memory_rate,
                 action_time=action_time(runs))


def rates_line(rates: Rates) -> str:
    return (f"Rates measured before the runs: {rates.flop_rate / 1e9:.1f}, "
            f"{rates.phase_rate('backward_input') / 1e9:.1f} and {rates.phase_rate('backward_weight') / 1e9:.1f} "
            f"GFLOP/s (F's X W, B's dY W^T, W's X^T dY), "
            f"{rates.memory_rate / 1e9:.1f} GB/s, {rates.action_time * 1e6:.0f} us an action "
            f"(messages at the stated {rates.bandwidth / 1e9:g} GB/s + {rates.latency * 1e6:g} us)")


def page_rates(text: str):
    """The measured rates a page states (``rates_line``), or None."""
    m = RATES_LINE.search(text)
    if m is None:
        return None
    return Rates(flop_rate=float(m[1]) * 1e9, dgrad_rate=float(m[2]) * 1e9, wgrad_rate=float(m[3]) * 1e9,
                 memory_rate=float(m[4]) * 1e9, action_time=float(m[5]) * 1e-6)


def replay(doc: dict, p) -> float:
    """The idle share of the profiled steps re-simulated with every compute
    action's measured duration (its top-level phase span, in the stage's
    order), the model's transfers, and nothing else."""
    spans = [e for e in doc["traceEvents"] if e.get("ph") == "X"]
    steps = {(e["pid"], e["args"]["step"]): e for e in spans if e.get("cat") == "step"}   # each rank's own
    phases = [e for e in spans if e.get("cat") == "compute" and e["name"] in PIPELINE_PHASES]
    delay = transfer_seconds(p) * 1e6                                    # microseconds, as the trace
    idle = total = 0.0
    for step in sorted({n for _, n in steps}):
        durations = {}
        for stage, acts in enumerate(schedule_of(p)):                    # serial stages: rank = stage
            s = steps[stage, step]
            mine = _top_level([e for e in phases if e["pid"] == stage and s["ts"] <= e["ts"] <= s["ts"] + s["dur"]])
            work = [a for a in acts if a.op in COMPUTE]
            if [e["name"] for e in mine] != [PHASE_OF[a.op] for a in work]:
                raise SystemExit(f"stage {stage}: the profile's phases do not follow the schedule {p.pp_schedule}")
            durations.update({(stage, id(a)): e["dur"] for a, e in zip(work, mine)})
        r = simulate([list(acts) for acts in schedule_of(p)], name=p.pp_schedule,
                     times=lambda stage, a: durations[stage, id(a)], transfer=lambda stage, a: delay)
        idle += r["bubble"] * r["time"] * p.pp
        total += r["time"] * p.pp
    return idle / total


def between_actions(doc: dict) -> float:
    """The share of ``pipeline_bubble``'s ranks x window that a rank spends
    inside its own first-to-last phase but neither in a phase nor waiting
    for a receive (``wait irecv``): the executor's and the profiler's time
    between actions."""
    gap, total, _ = _between(doc)
    return gap / total


def _between(doc: dict) -> tuple:
    """(time between actions, ranks x windows, steps) of a profile, in its
    microseconds (``between_actions``)."""
    spans = [e for e in doc["traceEvents"] if e.get("ph") == "X"]
    steps = {(e["pid"], e["args"]["step"]): e for e in spans if e.get("cat") == "step"}
    ranks = sorted({pid for pid, _ in steps})
    other = total = 0.0
    numbers = sorted({n for _, n in steps})
    for step in numbers:
        mine = {}
        for rank in ranks:
            s = steps[rank, step]
            mine[rank] = _top_level([e for e in spans if e["pid"] == rank and e.get("cat") == "compute"
                                     and e["name"] in PIPELINE_PHASES and s["ts"] <= e["ts"] <= s["ts"] + s["dur"]])
        t0 = min(m[0]["ts"] for m in mine.values())
        t1 = max(m[-1]["ts"] + m[-1]["dur"] for m in mine.values())
        for rank, m in mine.items():
            a, b = m[0]["ts"], m[-1]["ts"] + m[-1]["dur"]
            waits = _union([(max(e["ts"], a), min(e["ts"] + e["dur"], b)) for e in spans
                            if e["pid"] == rank and e["name"] == "wait irecv" and a <= e["ts"] <= b])
            other += (b - a) - sum(e["dur"] for e in m) - waits
            total += t1 - t0
    return other, total, len(numbers)


def table(runs: Path = None, rates: Rates = None) -> str:
    """The page's table; ``rates``: the measured rates of its model column
    (``-`` there without them)."""
    lines = ["| schedule | formula (`info`) | model (`info`, stated rates) | model (measured rates) | "
             "measured (`timeline`) | measured, less the time between actions | replay of the measured phases |",
             "|---|---|---|---|---|---|---|"]
    for label, schedule, virtual in SCHEDULES:
        formula, model, p = info_figures(schedule, virtual)
        cells = [f"{formula:.1%}", f"{model:.1%}", f"{modelled_bubble(p, rates):.1%}" if rates else "-"]
        run = runs / f"bubble-{schedule}" if runs is not None else None
        if run is not None and (run / "profile.json").exists():
            doc = load(run)
            measured = pipeline_bubble(doc)
            cells += [f"{measured:.1%}", f"{measured - between_actions(doc):.1%}", f"{replay(doc, p):.1%}"]
        else:
            cells += ["-", "-", "-"]
        lines.append(f"| {label} | " + " | ".join(c.replace("%", " %") for c in cells) + " |")
    return "\n".join(lines)


def check(page: Path) -> int:
    """0 if every row of the page's table starts with the formula and model
    (stated rates) the code gives now, and, where the page states measured
    rates (``rates_line``), the model at those."""
    content = page.read_text()
    text = content.splitlines()
    rates = page_rates(content)
    if rates is None and "Rates measured" in content:
        print(f"{page}: its 'Rates measured' line is not in the form rates_line prints; paste the tool's line")
        return 1
    cells = 4 if rates is not None else 3
    bad = []
    for row in table(rates=rates).splitlines()[2:]:
        head = " | ".join(row.split(" | ")[:cells]) + " | "                 # label, formula, model(s)
        if not any(line.startswith(head) for line in text):
            bad.append(head)
    for head in bad:
        print(f"{page}: no table row starts with {head!r}; rerun tools/bubble_table.py and paste its table")
    return 1 if bad else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=Path, default=None, help="where the profiled runs are (or go, with --train)")
    parser.add_argument("--train", action="store_true", help="train the four profiled runs first (mpiexec -n 2)")
    parser.add_argument("--check", type=Path, default=None,
                        help="exit 1 unless PAGE holds the formula and model columns")
    args = parser.parse_args(argv)
    if args.check is not None:
        return check(args.check)
    rates = None
    if args.train:
        if args.runs is None:
            parser.error("--train needs --runs DIR")
        there = [d for d in ["bubble-calibration"] + [f"bubble-{s}" for _, s, _ in SCHEDULES]
                 if (args.runs / d).exists()]
        if there:
            parser.error(f"--runs {args.runs} already holds {', '.join(there)}: give a new directory")
        args.runs.mkdir(parents=True, exist_ok=True)
        rates = measure_rates(args.runs)
        (args.runs / "bubble-rates.json").write_text(json.dumps(rates.__dict__) + "\n")
        for _, schedule, virtual in SCHEDULES:
            train(args.runs, schedule, virtual)
    elif args.runs is not None and (args.runs / "bubble-rates.json").exists():
        rates = Rates(**json.loads((args.runs / "bubble-rates.json").read_text()))
    if rates is not None:
        rates = page_rates(rates_line(rates))       # as printed, so that --check recomputes the same column
        print(rates_line(rates) + "\n")
    print(table(args.runs, rates))
    return 0


if __name__ == "__main__":
    sys.exit(main())
