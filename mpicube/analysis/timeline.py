"""``mpicube timeline``: a profile's trace (``analysis.profile``) drawn
with matplotlib, for a page or a slide where Perfetto cannot go.

Ranks down, time across (milliseconds from the first profiled step's
start). Each rank has one lane for compute and one per communication axis
(the trace's threads, in its order, so every rank's lanes line up). On the
compute lane the step's phases (forward, backward, gradient sync, norm,
optimizer) are drawn in shades of one colour; on an axis lane, calls and
waits (the rank blocked in MPI: exposed) are solid in the axis's colour and
nonblocking calls in flight pale in the same colour, so overlap is
visible as pale bars under compute. Thin grey lines mark step boundaries.
matplotlib is an optional dependency (``pip install mpicube[bench]``).
"""

from __future__ import annotations

import json
from pathlib import Path

from ..core.errors import UserError
from .profile_summary import _top_level

PHASE_SHADES = {"forward": "#1f5fa8", "backward": "#4a90d9", "backward weight": "#2f9e8f",
                "gradient sync": "#7fb2e5", "gradient norm": "#a9cbee", "optimizer step": "#0b3b73"}
PIPELINE_PHASES = ("forward", "backward", "backward weight")
AXIS_COLOURS = ["#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22"]


def load(run_dir) -> dict:
    """The trace of RUN_DIR (its profile.json) or of a trace file given directly."""
    path = Path(run_dir)
    if path.is_dir():
        path = path / "profile.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{path}: no such trace (write one with `mpicube train --profile START:STOP` "
                        f"or `mpicube bench --profile START:STOP`)") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise UserError(f"{path} is not a JSON trace: {exc}") from None


def pipeline_bubble(doc: dict) -> float:
    """The measured bubble of a profiled pipeline run: per profiled step,
    the window from the first forward to the last backward (or weight
    phase) of any rank, and on each rank the time its forward, backward
    and weight-phase spans cover in that window; the idle share is 1 -
    covered / (ranks x window), summed over the steps. What the schedule's
    formula (``schedules.bubble_fraction``) predicts for equal work per
    layer and free communication, measured instead: stage-boundary waits,
    uneven stages (the embeddings, the head) and the layout's collectives
    all count as idle. None when the trace holds no pipeline phases."""
    spans = [e for e in doc.get("traceEvents", []) if e.get("ph") == "X"]
    # each rank's own span of each step: the ranks enter a step at different times, and a
    # stage's first forward can start before another rank's span of the same step does
    steps = {(e["pid"], e["args"]["step"]): e for e in spans if e.get("cat") == "step"}
    work = [e for e in spans if e.get("cat") == "compute" and e["name"] in PIPELINE_PHASES]
    ranks = sorted({e["pid"] for e in spans})
    idle = total = 0.0
    for step in sorted({n for _, n in steps}):
        mine = {rank: [e for e in work if e["pid"] == rank and (rank, step) in steps
                       and steps[rank, step]["ts"] <= e["ts"] <= steps[rank, step]["ts"] + steps[rank, step]["dur"]]
                for rank in ranks}
        every = [e for spans_of in mine.values() for e in spans_of]
        if not every:
            continue
        t0, t1 = min(e["ts"] for e in every), max(e["ts"] + e["dur"] for e in every)
        for rank in ranks:
            busy = sum(e["dur"] for e in _top_level(mine[rank]))
            idle += (t1 - t0) - busy
            total += t1 - t0
    return idle / total if total else None


def default_out(run_dir) -> Path:
    """Where the picture goes without ``--out``: beside the trace, so the
    hint ``--profile`` prints (`mpicube timeline RUN_DIR`) works as it
    stands. RUN_DIR/timeline.png for a run directory, TRACE.png for a trace
    file given directly."""
    path = Path(run_dir)
    return path / "timeline.png" if path.is_dir() else path.with_suffix(".png")


def draw(run_dir, out, width: float = 12.0) -> str:
    """Write the picture of RUN_DIR's trace to ``out``; a line saying what was drawn."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        raise UserError("mpicube timeline needs matplotlib: pip install matplotlib") from None
    doc = load(run_dir)
    other = doc.get("otherData", {})
    threads = other.get("threads") or ["compute"]
    events = [e for e in doc.get("traceEvents", []) if e.get("ph") in ("X", "b", "e")]
    if not events:
        raise UserError(f"{run_dir}: the trace holds no spans")
    ranks = sorted({e["pid"] for e in events})
    t_min = min(e["ts"] for e in events)
    lanes = len(threads)
    axis_colour = {th: AXIS_COLOURS[i % len(AXIS_COLOURS)] for i, th in enumerate(threads[1:])}
    height = max(2.5, 0.18 * lanes * len(ranks) + 1.2)
    fig, ax = plt.subplots(figsize=(width, height))

    def lane_y(rank_index, tid):
        return (rank_index * (lanes + 1) + tid)        # a blank lane between ranks

    flights = {}
    for e in events:
        if e["ph"] in ("b", "e"):
            flights.setdefault((e["pid"], e["id"]), {"tid": e["tid"]})[e["ph"]] = e["ts"]
    for ri, rank in enumerate(ranks):
        mine = [e for e in events if e["pid"] == rank and e["ph"] == "X"]
        steps = [e for e in mine if e.get("cat") == "step"]
        phases = _top_level([e for e in mine if e.get("cat") == "compute"])
        y = lane_y(ri, 0)
        for shade in set(PHASE_SHADES.get(e["name"], "#6baed6") for e in phases):
            bars = [((e["ts"] - t_min) / 1e3, e["dur"] / 1e3) for e in phases
                    if PHASE_SHADES.get(e["name"], "#6baed6") == shade]
            ax.broken_barh(bars, (y, 0.8), facecolors=shade, linewidth=0)
        for tid, th in enumerate(threads[1:], start=1):
            colour = axis_colour[th]
            y = lane_y(ri, tid)
            pale = [((f["b"] - t_min) / 1e3, (f["e"] - f["b"]) / 1e3) for (pid, _), f in flights.items()
                    if pid == rank and f["tid"] == tid and "b" in f and "e" in f]
            ax.broken_barh(pale, (y + 0.2, 0.4), facecolors=colour, alpha=0.3, linewidth=0)
            solid = [((e["ts"] - t_min) / 1e3, e["dur"] / 1e3) for e in mine if e["tid"] == tid]
            ax.broken_barh(solid, (y, 0.8), facecolors=colour, linewidth=0)
        for s in steps:
            for edge in (s["ts"], s["ts"] + s["dur"]):
                ax.plot([(edge - t_min) / 1e3] * 2, [lane_y(ri, 0) - 0.1, lane_y(ri, lanes - 1) + 0.9],
                        color="#999999", linewidth=0.6)
    ax.set_yticks([lane_y(ri, 0) + lanes / 2 for ri in range(len(ranks))])
    ax.set_yticklabels([f"rank {r}" for r in ranks])
    ax.set_ylim(lane_y(len(ranks) - 1, lanes), -0.5)
    ax.set_xlabel("ms")
    what = other.get("layout", "")
    steps = other.get("steps")
    ax.set_title(f"{other.get('command', 'mpicube')} {what}, {len(ranks)} rank(s)"
                 + (f", steps {steps[0]}-{steps[1]}" if steps else ""))
    handles = [Patch(color=c, label=f"compute: {n}") for n, c in PHASE_SHADES.items()]
    handles += [Patch(color=axis_colour[th], label=th) for th in threads[1:]]
    handles += [Patch(color="#888888", alpha=0.3, label="in flight (nonblocking)")]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    bubble = pipeline_bubble(doc) if other.get("pp", 1) > 1 else None
    return (f"wrote {out}: {len(ranks)} rank(s), {len(threads) - 1} communication axis(es)"
            + (f"; pipeline bubble {bubble:.1%} of the stages' time (forward to last backward, "
               f"measured)" if bubble is not None else ""))
