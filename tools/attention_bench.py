"""Blockwise attention against the attention that holds T x T, paired in
one process: whole training steps (forward, backward, AdamW) of the same
serial model, the two attentions taken in turn step by step, so a loaded
machine slows both alike.

    python tools/attention_bench.py --seq-len 256 --batch-size 8 [--steps 6]

Prints per attention the median step time and tokens/s, the median of the
paired ratios (blocks / full: below 1 is faster), and the peak saved
activations of each. A figure, not a test.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from mpicube.core.config import ModelConfig  # noqa: E402
from mpicube.parallel.gridspec import Plan  # noqa: E402
from mpicube.parallel.planning import resolve  # noqa: E402
from mpicube.training.parts import Numerics, build_parts  # noqa: E402
from mpicube.training.step import make_step  # noqa: E402


def build(kind: str, cfg, batch: int, dtype: str):
    run = resolve(Plan("serial", attention=kind), cfg, batch, 1)       # the kind is a plan field
    parts = build_parts(run, MPI.COMM_SELF, Numerics(dtype), seed=1)
    return parts, make_step(parts.store, parts.layout.axes)


def step(parts, opt, x, y, i) -> tuple:
    """One timed training step -> (seconds, saved bytes after forward)."""
    t0 = time.perf_counter()
    parts.store.zero_grad()
    parts.model.forward(x, y, step=i)
    saved = parts.model.saved_bytes()
    parts.model.backward()
    opt.sync()
    opt.step(1e-4, min(1.0, 1.0 / (opt.grad_norm() + 1e-6)))
    return time.perf_counter() - t0, saved


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=144)
    ap.add_argument("--n-head", type=int, default=12)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--dtype", default="float32")
    a = ap.parse_args()
    cfg = ModelConfig(vocab_size=256, n_ctx=a.seq_len, n_layer=a.n_layer, n_head=a.n_head, n_embd=a.n_embd)
    runs = {kind: build(kind, cfg, a.batch_size, a.dtype) for kind in ("full", "blocks")}
    tokens = np.random.default_rng(0).integers(0, 256, (a.batch_size, a.seq_len + 1))
    x, y = tokens[:, :-1], tokens[:, 1:]
    times, saved = {k: [] for k in runs}, {}
    for i in range(a.steps + 1):                      # step 0 warms up both
        for kind, (parts, opt) in runs.items():
            seconds, saved[kind] = step(parts, opt, x, y, i + 1)
            if i:
                times[kind].append(seconds)
    ratios = [b / f for b, f in zip(times["blocks"], times["full"])]
    tokens_per_step = a.batch_size * a.seq_len
    for kind in runs:
        med = statistics.median(times[kind])
        print(f"{kind:6s} T={a.seq_len} B={a.batch_size}: step {med * 1e3:9.1f} ms (median of {a.steps}), "
              f"{tokens_per_step / med:9.0f} tok/s, saved activations {saved[kind] / 2**20:8.1f} MiB")
    print(f"blocks/full step time, median of paired ratios: {statistics.median(ratios):.3f} "
          f"(min {min(ratios):.3f}, max {max(ratios):.3f})")


if __name__ == "__main__":
    main()
