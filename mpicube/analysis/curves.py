"""``mpicube plot``: the loss curves of one or more runs in one picture.

metrics.jsonl holds what a run did step by step, but a person sees whether
a run learns, and which of two runs learns faster, from a curve rather
than from a column of numbers. So this draws, from each run directory's
metrics.jsonl, the training loss (the raw per-step values faint, a moving
average over them solid) and the validation loss (points joined), every
run in its own colour on the same axes; and, when a run is a mixture of
experts, a second panel with its expert load: the busiest expert's tokens
over the mean expert's, the largest over the layers, per step (1 is a
perfectly balanced router; E means every token went to one expert).
matplotlib, as ``mpicube timeline``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..core.errors import UserError

COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf")
METRICS = "metrics.jsonl"


def read_run(run_dir) -> dict:
    """{"steps", "loss", "val_steps", "val_loss", "load_steps", "load"} of a
    run directory (lists, in step order), or a UserError naming it."""
    path = Path(run_dir) / METRICS
    if not path.is_file():
        raise UserError(f"{run_dir}: no {METRICS} (give the run directory that train --out wrote)")
    run = {k: [] for k in ("steps", "loss", "val_steps", "val_loss", "load_steps", "load")}
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                raise UserError(f"{path}:{n}: not a JSON line") from None
            if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                continue
            if isinstance(record.get("loss"), (int, float)):
                run["steps"].append(record["step"])
                run["loss"].append(float(record["loss"]))
            if isinstance(record.get("val_loss"), (int, float)):
                run["val_steps"].append(record["step"])
                run["val_loss"].append(float(record["val_loss"]))
            tokens = record.get("expert_tokens")
            if tokens:
                per_layer = np.asarray(tokens, dtype=np.float64)                 # (layers, E)
                mean = per_layer.mean(axis=1)                                    # (layers,)
                run["load_steps"].append(record["step"])
                run["load"].append(float(np.max(per_layer.max(axis=1) / np.maximum(mean, 1e-300))))
    if not run["steps"] and not run["val_steps"]:
        raise UserError(f"{path}: holds no step with a loss")
    return run


def moving_average(values: list, window: int) -> np.ndarray:
    """The mean of each value and the up to ``window - 1`` before it."""
    v = np.asarray(values, dtype=np.float64)                                      # (n,)
    c = np.concatenate([[0.0], np.cumsum(v)])                                     # (n + 1,)
    k = np.arange(1, v.size + 1)
    start = np.maximum(k - window, 0)
    return (c[k] - c[start]) / (k - start)


def draw(run_dirs: list, out, width: float = 9.0) -> str:
    """Write the picture of ``run_dirs``' curves to ``out``; a line saying what was drawn."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("mpicube plot needs matplotlib: pip install matplotlib") from None
    runs = [(str(d), read_run(d)) for d in run_dirs]
    mixture = any(r["load"] for _, r in runs)
    rows = 2 if mixture else 1
    fig, axes = plt.subplots(rows, 1, figsize=(width, 3.6 * rows), squeeze=False, sharex=True)
    ax = axes[0][0]
    for i, (name, r) in enumerate(runs):
        colour = COLOURS[i % len(COLOURS)]
        if r["steps"]:
            window = max(1, len(r["steps"]) // 25)
            ax.plot(r["steps"], r["loss"], color=colour, alpha=0.25, linewidth=0.8)
            ax.plot(r["steps"], moving_average(r["loss"], window), color=colour, linewidth=1.6,
                    label=f"{name} train" + (f" (mean of {window})" if window > 1 else ""))
        if r["val_steps"]:
            ax.plot(r["val_steps"], r["val_loss"], color=colour, linestyle="--", marker="o", markersize=4,
                    label=f"{name} validation")
    ax.set_ylabel("loss (nats per token)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("loss" if len(runs) == 1 else f"loss, {len(runs)} runs")
    if mixture:
        ax2 = axes[1][0]
        for i, (name, r) in enumerate(runs):
            if r["load"]:
                ax2.plot(r["load_steps"], r["load"], color=COLOURS[i % len(COLOURS)], label=name)
        ax2.axhline(1.0, color="grey", linewidth=0.8, linestyle=":")
        ax2.set_ylabel("busiest expert / mean")
        ax2.set_title("expert load (largest over layers; 1 = balanced)")
        ax2.grid(alpha=0.3)
        ax2.legend(fontsize=8)
    axes[-1][0].set_xlabel("step")
    fig.tight_layout()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    steps = sum(len(r["steps"]) for _, r in runs)
    vals = sum(len(r["val_steps"]) for _, r in runs)
    return (f"wrote {out}: {len(runs)} run(s), {steps} training and {vals} validation losses"
            + (", expert load" if mixture else ""))
