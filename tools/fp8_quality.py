"""The 500-step Llama of docs/llama.md in float32, bfloat16 and each FP8
recipe, its losses side by side (docs/fp8.md, "Measured quality").

    PYTHONPATH=. python tools/fp8_quality.py [--out runs/fp8-quality] [--steps 500]

Each run is `mpicube train` on one rank with docs/llama.md's settings; a
run whose folder already holds a finished metrics.jsonl is read, not run
again (delete the folder to rerun it). The FP8 runs keep their master
weights, optimizer and everything outside the linears' GEMMs in float32
(`--dtype float32`). The model is too narrow for DeepSeek's 128-wide
tiles and MX's 32-wide blocks (widths 144 and 436 share no factor above
4), so blockwise and mxfp8 run with `--fp8-block 4`: finer scales than
the recipes' own, which flatters them; say so beside the figures.
Prints a Markdown table: validation loss every 100 steps and the
training loss at the last step.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

COMMON = ["--arch", "llama", "--n-layer", "4", "--n-head", "12", "--n-kv-head", "4", "--n-embd", "144",
          "--ffn-hidden", "436", "--seq-len", "64", "--batch-size", "8", "--lr", "3e-3", "--warmup", "20",
          "--eval-every", "100"]

RUNS = [  # (label, extra options)
    ("float32", ["--dtype", "float32"]),
    ("bfloat16", ["--dtype", "bfloat16"]),
    ("fp8 tensorwise", ["--dtype", "float32", "--fp8", "tensorwise"]),
    ("fp8 delayed", ["--dtype", "float32", "--fp8", "delayed"]),
    ("fp8 rowwise", ["--dtype", "float32", "--fp8", "rowwise"]),
    ("fp8 blockwise, block 4", ["--dtype", "float32", "--fp8", "blockwise", "--fp8-block", "4"]),
    ("fp8 mxfp8, block 4", ["--dtype", "float32", "--fp8", "mxfp8", "--fp8-block", "4"]),
]


def folder(out: Path, label: str) -> Path:
    return out / label.replace(" ", "_").replace(",", "")


def records(run: Path):
    """(training records, validation records) of a run's metrics.jsonl."""
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in lines if "loss" in r], [r for r in lines if "val_loss" in r]


def finished(run: Path, steps: int) -> bool:
    try:
        train, _ = records(run)
    except (FileNotFoundError, ValueError):
        return False
    return bool(train) and train[-1]["step"] == steps


def run_one(run: Path, extra: list, steps: int) -> None:
    """Train one run (a fresh folder)."""
    cmd = [sys.executable, "-m", "mpicube", "train", *COMMON, *extra, "--steps", str(steps), "--out", str(run)]
    print("running:", " ".join(cmd[1:]), file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)


def table(out: Path, steps: int) -> str:
    evals = list(range(100, steps + 1, 100))
    head = ["run", *[f"val loss at step {s}" if i == 0 else str(s) for i, s in enumerate(evals)],
            f"training loss at step {steps}"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, _ in RUNS:
        run = folder(out, label)
        train, val = records(run)
        by_step = {r["step"]: r["val_loss"] for r in val}
        cells = [label, *[f"{by_step[s]:.4f}" for s in evals], f"{train[-1]['loss']:.4f}"]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("runs/fp8-quality"))
    ap.add_argument("--steps", type=int, default=500)
    args = ap.parse_args()
    for label, extra in RUNS:
        run = folder(args.out, label)
        if not finished(run, args.steps):
            run_one(run, extra, args.steps)
    print(table(args.out, args.steps))


if __name__ == "__main__":
    main()
