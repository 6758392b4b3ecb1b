"""Pictures for docs/pipeline.md: one per pipeline schedule, drawn from the
action lists the executor runs.

    PYTHONPATH=. python tools/pipeline_pictures.py --out docs/pipeline   # needs matplotlib ('.[bench]')

Nothing is drawn from a description: each picture takes
``mpicube.parallel.schedules.build_schedule`` and times it with
``simulate`` (the executor's semantics: a receive waits for its send,
sends never block, communication free), with a forward of one chunk taking
one unit and its backward two (a backward does about twice a forward's
GEMMs). Stages run down, time across; each compute is a cell coloured by
its micro-batch, forwards light and backwards dark, labelled with the
micro-batch (and the model chunk under interleaved). The title gives the
bubble the simulation measured next to the cost model's formula: they are
equal, as tests/test_schedules.py asserts for every size.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mpicube.parallel.schedules import bubble_fraction, build_schedule, simulate  # noqa: E402

# (file stem, schedule, P, N, V): four stages, eight micro-batches, the sizes of Megatron's figures
PICTURES = [("gpipe", "gpipe", 4, 8, 1), ("1f1b", "1f1b", 4, 8, 1), ("interleaved", "interleaved", 4, 8, 2)]
FORWARD, BACKWARD = 1.0, 2.0


def draw(path: Path, name: str, P: int, N: int, V: int) -> dict:
    """One schedule's picture at ``path``; returns the simulation's figures."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # the time of one stage's whole forward / backward stays FORWARD / BACKWARD: a chunk takes 1/V of it
    result = simulate(build_schedule(name, P, N, V), FORWARD / V, BACKWARD / V)
    colours = plt.get_cmap("tab10")
    fig, ax = plt.subplots(figsize=(max(8.0, result["time"] * 0.45), 0.6 * P + 1.4))
    for stage, cells in enumerate(result["timeline"]):
        for start, end, a in cells:
            base = matplotlib.colors.to_rgb(colours(a.micro % 10))
            light = tuple(0.55 + 0.45 * c for c in base)
            face = light if a.op == "forward" else tuple(0.75 * c for c in base)
            ax.add_patch(plt.Rectangle((start, stage), end - start, 0.9, facecolor=face, edgecolor="black",
                                       linewidth=0.4))
            label = f"{a.micro}" if V == 1 else f"{a.micro}.{a.chunk * P + stage}"
            ax.text((start + end) / 2, stage + 0.45, label, ha="center", va="center", fontsize=6 if V > 1 else 7,
                    color="black" if a.op == "forward" else "white")
    model = bubble_fraction(name, P, N, V)
    title = {"gpipe": "GPipe: all forwards, then all backwards",
             "1f1b": "1F1B: warm-up of P-1-p forwards, then one forward, one backward",
             "interleaved": f"interleaved 1F1B, V = {V} chunks per stage (labels: micro.chunk)"}[name]
    ax.set_title(f"{title}\nP = {P} stages, N = {N} micro-batches; bubble {result['bubble']:.1%} simulated, "
                 f"{model:.1%} by the model", fontsize=9)
    ax.set_xlim(0, result["time"])
    ax.set_ylim(P, 0)
    ax.set_yticks([s + 0.45 for s in range(P)])
    ax.set_yticklabels([f"stage {s}" for s in range(P)], fontsize=8)
    ax.set_xlabel("time (a stage's forward of one micro-batch = 1, its backward = 2; light: forward, dark: "
                  "backward)", fontsize=8)
    ax.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return {"bubble": result["bubble"], "model": model, "time": result["time"]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "pipeline")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for stem, name, P, N, V in PICTURES:
        figures = draw(args.out / f"{stem}.png", name, P, N, V)
        print(f"{stem}.png: bubble {figures['bubble']:.4f} simulated, {figures['model']:.4f} model, "
              f"step {figures['time']:g} units")
    return 0


if __name__ == "__main__":
    sys.exit(main())
