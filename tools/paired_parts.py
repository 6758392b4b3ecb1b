"""Paired A/B of parts of the serial float32 step between this checkout and another.

Why: on a shared 2-core machine a whole step's time moves by more than a
few per cent between runs, so a change to one part of the step is timed
here on its own, at the step's shapes (tools/compare_torch.py's: B 8, T 64,
n_embd 144, 12 heads, 4 layers, vocab 256), the two versions alternating
call by call in one process, medians over hundreds of calls. The other
version's module is loaded from ``--base`` (a checkout, e.g. ``git worktree
add /tmp/base 62eea79``) under another name; its relative imports resolve
to this checkout's modules, so only that one file differs. It also says
whether the two give the same numbers.

    python tools/paired_parts.py --base /tmp/base attention          # wall time, default threads
    OMP_NUM_THREADS=1 python tools/paired_parts.py --base /tmp/base attention --cpu
    OMP_NUM_THREADS=1 python tools/paired_parts.py --base /tmp/base adamw --cpu [--params 28700000]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import numpy as np


def load_base(base: str, module: str):
    """``module`` (dotted, under mpicube) from checkout ``base``, as mpicube.<module>_base."""
    path = Path(base) / (module.replace(".", "/") + ".py")
    spec = importlib.util.spec_from_file_location(module + "_base", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod          # importable by that name: numba's on-disk cache records it
    spec.loader.exec_module(mod)
    return mod


def paired(old, new, reps: int, clock) -> tuple:
    """Median seconds of old() and new(), alternating, the first tenth dropped."""
    times = {"old": [], "new": []}
    for r in range(reps):
        for name in (("old", "new") if r % 2 else ("new", "old")):
            f = old if name == "old" else new
            t0 = clock()
            f()
            times[name].append(clock() - t0)
    return tuple(statistics.median(times[k][reps // 10:]) for k in ("old", "new"))


def attention_case(base: str, args):
    """Blockwise attention forward + backward, float32 (B, T, 3C) -> (B, T, 3C)."""
    from mpicube.ops import attention_blocks as new
    old = load_base(base, "mpicube.ops.attention_blocks")
    rng = np.random.default_rng(0)
    B, T, C, nh = args.batch_size, args.seq_len, args.n_embd, args.n_head
    for dt in (np.float64, np.float32):
        qkv, dy = rng.standard_normal((B, T, 3 * C)).astype(dt), rng.standard_normal((B, T, C)).astype(dt)
        outs = [m.attention_backward(dy, m.attention_forward(qkv, nh)[1]) for m in (old, new)]
        print(f"{np.dtype(dt).name}: dqkv {'identical' if np.array_equal(*outs) else 'differs'}")
    qkv = rng.standard_normal((B, T, 3 * C)).astype(np.float32)
    dy = rng.standard_normal((B, T, C)).astype(np.float32)
    label = f"attention forward + backward, B {B}, T {T}, n_embd {C}, {nh} heads, float32"
    return label, (lambda: old.attention_backward(dy, old.attention_forward(qkv, nh)[1]),
                   lambda: new.attention_backward(dy, new.attention_forward(qkv, nh)[1]))


def adamw_case(base: str, args):
    """The fused AdamW kernel over a float32 buffer of ``--params``."""
    from mpicube.device import fused as new
    old = load_base(base, "mpicube.device.fused")
    rng = np.random.default_rng(0)
    n = args.params
    for dt in (np.float64, np.float32):
        start = [rng.standard_normal(n).astype(dt) for _ in range(4)]
        start[3] = np.abs(start[3])                                     # v >= 0
        bufs = [[a.copy() for a in start] for _ in (old, new)]
        for mod, b in zip((old, new), bufs):
            for _ in range(3):
                mod.adamw(*b, 0.9, 0.95, 1e-3, 1e-8, 0.999, 0.7)
        same = all(np.array_equal(a, b) for a, b in zip(*bufs))
        rel = float(np.max(np.abs(bufs[0][0] - bufs[1][0]) / np.maximum(np.abs(bufs[0][0]), 1e-30)))
        print(f"{np.dtype(dt).name}: after 3 updates {'identical' if same else f'max relative difference {rel:.1e}'}")
    p, g, m, v = (rng.standard_normal(n).astype(np.float32) for _ in range(4))
    v = np.abs(v)
    step = (0.9, 0.95, 1e-4, 1e-8, 0.99999, 1.0)
    return (f"AdamW over {n} float32 parameters",
            (lambda: old.adamw(p, g, m, v, *step), lambda: new.adamw(p, g, m, v, *step)))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("part", choices=["attention", "adamw"])
    ap.add_argument("--base", required=True, help="a checkout of mpicube to compare with (its repository root)")
    ap.add_argument("--cpu", action="store_true", help="CPU time of the process (all threads) instead of wall time")
    ap.add_argument("--reps", type=int, default=None, help="calls of each [attention 600, adamw 300 or 40 over 5M]")
    ap.add_argument("--params", type=int, default=1_070_000, help="AdamW's buffer [1.07M: the 144-wide model]")
    ap.add_argument("--n-embd", type=int, default=144)
    ap.add_argument("--n-head", type=int, default=12)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=8)
    args = ap.parse_args()
    from mpicube.device import fused, threads
    threads.configure(None)
    label, (old, new) = (attention_case if args.part == "attention" else adamw_case)(args.base, args)
    reps = args.reps or (600 if args.part == "attention" else 300 if args.params < 5_000_000 else 40)
    clock = time.process_time if args.cpu else time.perf_counter
    o, n = paired(old, new, reps, clock)
    print(f"{label}; {fused.describe()}; {'CPU' if args.cpu else 'wall'} time, median of {reps} alternating calls:")
    print(f"  base {o * 1e3:.3f} ms, this checkout {n * 1e3:.3f} ms, ratio {n / o:.3f}")


if __name__ == "__main__":
    main()
