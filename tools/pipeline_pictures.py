"""Pictures for docs/pipeline.md: one per pipeline schedule, drawn from the
action lists the executor runs.

    PYTHONPATH=. python tools/pipeline_pictures.py --out docs/pipeline   # needs matplotlib ('.[bench]')

Nothing is drawn from a description: each picture takes
``mpicube.parallel.schedules.build_schedule`` and times it with
``simulate`` (the executor's semantics: a receive waits for its send,
sends never block, communication free), with a forward of one chunk taking
one unit and its backward two (a backward does about twice a forward's
GEMMs; the zero-bubble schedules split it into an input part B and a
weight part W of one unit each). Stages run down, time across; each
compute is a cell coloured by its micro-batch, forwards light, backwards
(or B) dark, W hatched, labelled with the micro-batch (and the model chunk
where a stage holds several). The title gives the bubble the simulation
measured next to the cost model's formula: they are equal, as
tests/test_schedules.py asserts for every size; ``--check`` reprints the
bubble table of docs/pipeline.md from the same simulations
(tests/test_doc_figures.py runs it).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mpicube.parallel.schedules import bubble_fraction, build_schedule, model_chunk, simulate  # noqa: E402

# (file stem, schedule, P, N, V): four stages, eight micro-batches, the sizes of Megatron's figures
PICTURES = [("gpipe", "gpipe", 4, 8, 1), ("1f1b", "1f1b", 4, 8, 1), ("interleaved", "interleaved", 4, 8, 2),
            ("zb-h1", "zb-h1", 4, 8, 1), ("zbv", "zbv", 4, 8, 2), ("dualpipev", "dualpipev", 4, 8, 2)]
TITLES = {"gpipe": "GPipe: all forwards, then all backwards",
          "1f1b": "1F1B: warm-up of P-1-p forwards, then one forward, one backward",
          "interleaved": "interleaved 1F1B, V = {V} chunks per stage (labels: micro.chunk)",
          "zb-h1": "ZB-H1: 1F1B with each backward split, W (hatched) deferred into the drain",
          "zbv": "ZBV: two chunks a stage in a V (chunks p and 2P-1-p; labels: micro.chunk), W deferred",
          "dualpipev": "DualPipeV: DeepSeek's eight steps over the same V (labels: micro.chunk)"}
FORWARD, BACKWARD = 1.0, 2.0


def draw(path: Path, name: str, P: int, N: int, V: int) -> dict:
    """One schedule's picture at ``path``; returns the simulation's figures."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # the time of one stage's whole forward / backward stays FORWARD / BACKWARD: a chunk takes 1/V of it
    result = simulate(build_schedule(name, P, N, V), FORWARD / V, BACKWARD / V, name)
    colours = plt.get_cmap("tab10")
    fig, ax = plt.subplots(figsize=(max(8.0, result["time"] * 0.45), 0.6 * P + 1.4))
    for stage, cells in enumerate(result["timeline"]):
        for start, end, a in cells:
            base = matplotlib.colors.to_rgb(colours(a.micro % 10))
            light = tuple(0.55 + 0.45 * c for c in base)
            face = light if a.op in ("forward", "backward_weight") else tuple(0.75 * c for c in base)
            ax.add_patch(plt.Rectangle((start, stage), end - start, 0.9, facecolor=face, edgecolor="black",
                                       linewidth=0.4, hatch="////" if a.op == "backward_weight" else None))
            label = f"{a.micro}" if V == 1 else f"{a.micro}.{model_chunk(name, stage, a.chunk, P)}"
            ax.text((start + end) / 2, stage + 0.45, label, ha="center", va="center", fontsize=6 if V > 1 else 7,
                    color="white" if a.op in ("backward", "backward_input") else "black")
    model = bubble_fraction(name, P, N, V)
    title = TITLES[name].format(V=V)
    ax.set_title(f"{title}\nP = {P} stages, N = {N} micro-batches; bubble {result['bubble']:.1%} simulated, "
                 f"{model:.1%} by the model", fontsize=9)
    ax.set_xlim(0, result["time"])
    ax.set_ylim(P, 0)
    ax.set_yticks([s + 0.45 for s in range(P)])
    ax.set_yticklabels([f"stage {s}" for s in range(P)], fontsize=8)
    ax.set_xlabel("time (a stage's forward of one micro-batch = 1, its backward = 2 or B = W = 1; light: forward, "
                  "dark: backward or B, hatched: W)", fontsize=8)
    ax.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return {"bubble": result["bubble"], "model": model, "time": result["time"]}


def bubble_table() -> str:
    """docs/pipeline.md's table of every schedule's bubble at the pictures'
    sizes: the formula (``bubble_fraction``) and the simulated idle share
    of the action lists, for P 4 and N 8 (and the chunks of each)."""
    rows = ["| schedule (P 4, N 8) | formula | simulated | tapes on stage 0 | weight phases, most on a stage |",
            "|---|---|---|---|---|"]
    from mpicube.parallel.schedules import in_weight_phase, peak_in_flight

    for _, name, P, N, V in PICTURES:
        sched = build_schedule(name, P, N, V)
        measured = simulate(sched, FORWARD / V, BACKWARD / V, name)["bubble"]
        weights = max(max(len(x) for x in in_weight_phase(acts)) for acts in sched)
        rows.append(f"| {name}{f' (V {V})' if V > 1 else ''} | {bubble_fraction(name, P, N, V):.1%} | "
                    f"{measured:.1%} | {peak_in_flight(sched[0])} | {weights} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "pipeline")
    parser.add_argument("--check", type=Path, default=None,
                        help="exit 1 unless PAGE holds the bubble table the code gives now (no drawing)")
    args = parser.parse_args(argv)
    if args.check is not None:
        if bubble_table() not in args.check.read_text():
            print(f"{args.check}: the bubble table differs from what the schedules give now; "
                  f"rerun tools/pipeline_pictures.py and paste its table")
            return 1
        return 0
    print(bubble_table())
    args.out.mkdir(parents=True, exist_ok=True)
    for stem, name, P, N, V in PICTURES:
        figures = draw(args.out / f"{stem}.png", name, P, N, V)
        print(f"{stem}.png: bubble {figures['bubble']:.4f} simulated, {figures['model']:.4f} model, "
              f"step {figures['time']:g} units")
    return 0


if __name__ == "__main__":
    sys.exit(main())
