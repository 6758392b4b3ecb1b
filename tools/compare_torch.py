"""Serial training step: mpicube (NumPy) vs PyTorch eager on the CPU, each
library in its own process, as users run them.

Why whole runs in separate processes: a user runs one library at a time,
its thread pools started, warmed and spinning on their own. An earlier
version of this tool ran both in one process, step by step with pauses,
and that flattered mpicube (its step measured 48-60 ms there against 64-77
ms in its own process, issue 36). Here:

1. one process writes the initial weights and the batch to a .npz file
   (``--write-weights``: mpicube's initialisation, seed 0);
2. both libraries read that file, each in a process of its own: this
   file's ``--worker`` for mpicube, ``tools/torch_step.py`` for PyTorch (in
   a Python that has torch: ``--torch-python``; mpicube never imports it);
3. whole runs alternate, mpicube first in even pairs and PyTorch first in
   odd ones, for ``--pairs`` pairs; each run times ``--steps`` steps after
   ``--warmup`` and then its library's float32 matmul rate, in the same
   process.

It prints per-pair medians and ratios, the median ratio and its spread, both
first-step losses (which must agree: the comparison is of the same
computation), each library's matmul rate and the thread settings each run
had. Thread settings come from the environment as a user's would
(``OMP_NUM_THREADS`` etc. pass through to both).

    python tools/compare_torch.py --torch-python /tmp/tv/bin/python                 # 4 x 768, T 256, B 4
    python tools/compare_torch.py --torch-python /tmp/tv/bin/python --n-embd 144 --seq-len 64 --batch-size 8
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def write_weights(args) -> None:
    """The initial weights of mpicube's serial model (seed 0) and one batch
    of tokens, as ``w.<name>`` and ``meta.*`` arrays of an .npz file."""
    import numpy as np
    from mpi4py import MPI

    from mpicube.parallel.planning import resolve
    from mpicube.training.parts import build_parts

    cfg = _config(args)
    parts = build_parts(resolve("serial", cfg, args.batch_size, 1, seq_len=args.seq_len), MPI.COMM_SELF, seed=0)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (args.batch_size, args.seq_len + 1))
    arrays = {f"w.{name}": np.ascontiguousarray(parts.store.data[name]) for name in parts.store.data}
    np.savez(args.write_weights, **arrays, **{"meta.tokens": tokens, "meta.n_layer": cfg.n_layer,
                                             "meta.n_head": cfg.n_head})


def _config(args):
    from mpicube.core.config import ModelConfig

    return ModelConfig(vocab_size=256, n_ctx=args.seq_len, n_layer=args.n_layer, n_head=args.n_head,
                       n_embd=args.n_embd)


def mpicube_worker(args) -> None:
    """One timed run of mpicube's serial float32 step in this process, set
    up as ``mpicube bench --layout serial`` sets it up (COMM_WORLD, the
    rank's thread share decided by ``build_parts``), from the weights file.
    The step is the same as PyTorch's: zero the gradients, forward,
    backward, AdamW (no clipping). Prints one JSON line."""
    t_start = time.perf_counter()
    import mpicube  # noqa: F401  (first, as the command line is: it sets OpenBLAS's spin before NumPy loads)
    import numpy as np
    from mpi4py import MPI

    from mpicube.device import blas_kernel, fused, threads
    from mpicube.training.optim import AdamW
    from mpicube.parallel.planning import resolve
    from mpicube.training.parts import build_parts

    data = np.load(args.weights)
    cfg = _config(args)
    parts = build_parts(resolve("serial", cfg, args.batch_size, 1, seq_len=args.seq_len), MPI.COMM_WORLD, seed=0)
    for name in parts.store.data:
        parts.store.data[name][...] = data[f"w.{name}"]
    opt = AdamW(parts.store, weight_decay=0.1)
    tokens = data["meta.tokens"]
    x, y = tokens[:, :-1], tokens[:, 1:]                                   # (B, T)

    def step():
        parts.store.zero_grad()
        loss = parts.model.forward(x, y, step=1)
        parts.model.backward()
        opt.step(1e-4)
        return float(loss)

    if args.profile:
        _profile(step, args)
        return
    times, first = [], None
    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        time.sleep(args.pause)
        t0 = time.perf_counter()
        loss = step()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
        first = loss if first is None else first
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / args.steps
    print(json.dumps({
        "library": f"mpicube {mpicube.__version__}", "first_loss": first, "step_s": times,
        "page_faults_per_step": faults,
        "matmul_flops": _numpy_matmul_rate(args.batch_size * args.seq_len, args.n_embd),
        "blas": blas_kernel.describe(),
        "threads": f"{threads.current().describe()}; kernels: {fused.describe()}; "
                   f"OPENBLAS_THREAD_TIMEOUT={os.environ.get('OPENBLAS_THREAD_TIMEOUT', '(unset)')}",
        "process_s": time.perf_counter() - t_start}))


def _numpy_matmul_rate(n: int, h: int, seconds: float = 0.3) -> float:
    """FLOP/s of a float32 (n, h) @ (h, 4h) np.matmul (as torch_step.matmul_rate)."""
    import numpy as np

    a, b = np.ones((n, h), np.float32), np.ones((h, 4 * h), np.float32)
    for _ in range(2):
        a @ b
    times, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end or len(times) < 5:
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
    return 2.0 * n * h * 4 * h / float(np.median(times))


def _profile(step, args) -> None:
    """cProfile over ``--steps`` steps after the warm-up; the top of the
    cumulative and the self-time lists, in ms per step."""
    import cProfile
    import pstats

    for _ in range(args.warmup):
        step()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for _ in range(args.steps):
        step()
    prof.disable()
    print(f"{(time.perf_counter() - t0) / args.steps * 1e3:.1f} ms per step under cProfile")
    stats = pstats.Stats(prof)
    stats.sort_stats("tottime").print_stats(25)


def run_worker(cmd: list, env: dict | None = None) -> dict:
    """Run one worker to its end; its last stdout line is its JSON report."""
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def compare(args) -> None:
    """Write the weights once, then alternate whole runs of the two workers."""
    from mpicube.device.blas_kernel import pin_warning

    pinned = pin_warning()                 # the workers inherit the pin: say so before any figure
    if pinned:
        print(pinned, flush=True)
    shape = ["--n-layer", str(args.n_layer), "--n-head", str(args.n_head), "--n-embd", str(args.n_embd),
             "--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size)]
    timing = ["--steps", str(args.steps), "--warmup", str(args.warmup)]
    with tempfile.TemporaryDirectory(prefix="compare_torch-") as tmp:
        weights = str(Path(tmp) / "weights.npz")
        subprocess.run([sys.executable, __file__, "--write-weights", weights, *shape], check=True)
        ours = [sys.executable, __file__, "--worker", "--weights", weights, *shape, *timing]
        theirs = [args.torch_python, str(HERE / "torch_step.py"), "--weights", weights, *timing]
        pairs = []
        for i in range(args.pairs):
            order = (ours, theirs) if i % 2 == 0 else (theirs, ours)
            a, b = (run_worker(cmd) for cmd in order)
            pairs.append((a, b) if i % 2 == 0 else (b, a))
            m, t = (statistics.median(r["step_s"]) for r in pairs[-1])
            print(f"pair {i + 1} ({'mpicube' if i % 2 == 0 else 'torch'} first): mpicube {m * 1e3:.1f} ms, "
                  f"torch {t * 1e3:.1f} ms, ratio {m / t:.3f}", flush=True)
    report(args, pairs)


def report(args, pairs) -> None:
    ratios = [statistics.median(m["step_s"]) / statistics.median(t["step_s"]) for m, t in pairs]
    m0, t0 = pairs[0]
    print(f"model: {args.n_layer} layers, n_embd {args.n_embd}, {args.n_head} heads, seq {args.seq_len}, "
          f"batch {args.batch_size}, vocab 256, float32; {args.pairs} pairs of whole runs, "
          f"{args.steps} timed steps after {args.warmup} each")
    print(f"first-step loss: mpicube {m0['first_loss']:.6f}, torch {t0['first_loss']:.6f}")
    for name, runs in (("mpicube", [m for m, _ in pairs]), ("torch", [t for _, t in pairs])):
        meds = [statistics.median(r["step_s"]) * 1e3 for r in runs]
        rates = [r["matmul_flops"] / 1e9 for r in runs]
        print(f"{name:<8} step medians {', '.join(f'{v:.1f}' for v in meds)} ms; matmul "
              f"{min(rates):.0f}-{max(rates):.0f} GFLOP/s in its own process; {runs[0]['library']}")
        print(f"{'':<8} threads: {runs[0]['threads']}")
        print(f"{'':<8} BLAS: {runs[0].get('blas', 'not reported')}")
    print(f"ratios mpicube / torch: {', '.join(f'{r:.3f}' for r in ratios)}")
    print(f"median ratio {statistics.median(ratios):.3f}x, spread {min(ratios):.3f}-{max(ratios):.3f} "
          f"(below 1 = mpicube faster)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-head", type=int, default=12)
    ap.add_argument("--n-embd", type=int, default=768)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--steps", type=int, default=None, help="timed steps per run [20; 768 wide: 8]")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first in each run [3]")
    ap.add_argument("--pairs", type=int, default=5, help="alternating pairs of whole runs [5]")
    ap.add_argument("--torch-python", default=os.environ.get("TORCH_PYTHON", sys.executable),
                    help="a Python with torch and NumPy, for tools/torch_step.py [$TORCH_PYTHON, else this one]")
    ap.add_argument("--write-weights", metavar="NPZ", help=argparse.SUPPRESS)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--weights", help=argparse.SUPPRESS)
    ap.add_argument("--pause", type=float, default=0.0,
                    help="seconds of sleep before each of mpicube's steps (for finding where time goes) [0]")
    ap.add_argument("--profile", action="store_true",
                    help="profile mpicube's step in its own process with cProfile instead of comparing")
    args = ap.parse_args()
    if args.steps is None:
        args.steps = 8 if args.n_embd >= 512 else 20
    if args.write_weights:
        write_weights(args)
    elif args.worker:
        mpicube_worker(args)
    elif args.profile:
        with tempfile.TemporaryDirectory(prefix="compare_torch-") as tmp:
            args.weights = str(Path(tmp) / "weights.npz")
            args.write_weights = args.weights
            subprocess.run([sys.executable, __file__, "--write-weights", args.weights,
                            *sys.argv[1:]], check=True)
            mpicube_worker(args)
    else:
        compare(args)


if __name__ == "__main__":
    main()
