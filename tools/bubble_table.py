"""The bubble table of docs/pipeline.md: for 1F1B and the zero-bubble
schedules on one model and batch (2 ranks, ``--pp 2``), the formula's
bubble and the cost model's (both as ``mpicube info`` prints them), the
measured one of a profiled run (``mpicube timeline``), and a replay: the
same simulator as the cost model's, fed each action's measured duration
from the run's profile instead of the model's FLOPs (and the model's
transfers). The replay splits the gap between model and measurement in
two: model -> replay is what the FLOP count gets wrong about the phases'
lengths (memory-bound work, the real B/W split); replay -> measured is
time outside the phases (the interpreter between actions, receives that
wait on a late sender, a loaded machine's time slices).

    PYTHONPATH=. python tools/bubble_table.py --train --runs runs   # trains 4 runs (mpiexec -n 2), prints the table
    PYTHONPATH=. python tools/bubble_table.py --runs runs           # the table from runs already there
    PYTHONPATH=. python tools/bubble_table.py --check docs/pipeline.md

It wants one free core per rank: on a busy machine the measured column
says more about the machine than about the schedule. ``--check`` holds the
page's formula and model columns to what the code gives now (no runs:
tests/test_costpipe.py runs it).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mpicube.analysis.costbubble import transfer_seconds  # noqa: E402
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
PHASE_OF = {"forward": "forward", "backward": "backward", "backward_input": "backward",
            "backward_weight": "backward weight"}


def info_figures(schedule: str, virtual: int) -> tuple:
    """(formula, model) bubbles as ``mpicube info`` computes them for the run."""
    args = ("serial", CFG, 16, 2, 1, 1, 2, schedule, virtual)
    s = pipeline_summary(*args, grad_accum=8)
    return s["bubble"], s["modelled_bubble"], _chosen(*args, "float32", "none", 8, 0)


def train(runs: Path, schedule: str, virtual: int) -> Path:
    out = runs / f"bubble-{schedule}"
    cmd = ["mpiexec", "-n", "2", sys.executable, "-m", "mpicube", "train", *RUN, "--pp-schedule", schedule,
           *(["--virtual-stages", str(virtual)] if virtual > 1 else []), *MODEL, "--steps", "4",
           "--profile", "3:4", "--out", str(out)]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    subprocess.run(cmd, check=True, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
    return out


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
    between actions, which no schedule model prices."""
    spans = [e for e in doc["traceEvents"] if e.get("ph") == "X"]
    steps = {(e["pid"], e["args"]["step"]): e for e in spans if e.get("cat") == "step"}
    ranks = sorted({pid for pid, _ in steps})
    other = total = 0.0
    for step in sorted({n for _, n in steps}):
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
    return other / total


def table(runs: Path = None) -> str:
    lines = ["| schedule | formula (`info`) | model (`info`) | measured (`timeline`) | measured, less the time "
             "between actions | replay of the measured phases |",
             "|---|---|---|---|---|---|"]
    for label, schedule, virtual in SCHEDULES:
        formula, model, p = info_figures(schedule, virtual)
        cells = [f"{formula:.1%}", f"{model:.1%}"]
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
    """0 if every row of the page's table starts with the formula and model the code gives now."""
    text = page.read_text().splitlines()
    bad = []
    for row in table().splitlines()[2:]:
        head = " | ".join(row.split(" | ")[:3]) + " | "                   # label, formula, model
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
    if args.train:
        if args.runs is None:
            parser.error("--train needs --runs DIR")
        for _, schedule, virtual in SCHEDULES:
            train(args.runs, schedule, virtual)
    print(table(args.runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
