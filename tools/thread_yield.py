"""Does the default threading yield to other processes? The serial float32
step with mpicube's default threads against ``OMP_NUM_THREADS=1``, on the
machine as it is ("idle") and with one other process spinning on one of
this process's cores ("loaded", started and stopped here).

Why: a laptop with a browser busy, a login node or a CI runner is a machine
whose cores are partly taken. With two threads per rank and one core taken,
each GEMM split over both waited for the half on the taken core, and the
step ran 2 to 35 times slower than on one thread (issue 36). The rank's
pools now follow the free cores (``mpicube/device/core_load.py``); the
target is at most 1.1x one thread's step when loaded, and no slower than
before on the idle machine. ``MPICUBE_ADAPT_THREADS=0`` (the "fixed" runs)
is the policy before, for comparison.

Each run is a whole process (``tools/compare_torch.py --worker``, the same
weights); the settings alternate within each of ``--pairs`` rounds, in a
rotating order. Prints per-run medians and the median of each round's
ratios to one thread.

    python tools/thread_yield.py --n-embd 144 --seq-len 64 --batch-size 8

``--ranks 8`` times ``mpiexec -n 8 mpicube bench --layout 3d`` instead (the
96-wide model of issue 36 unless the shape is given): ranks sharing a node
must not each start threads that spin, so the default must be no slower
than ``OMP_NUM_THREADS=1`` there either.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SETTINGS = {"default": {}, "one thread": {"OMP_NUM_THREADS": "1"}, "fixed": {"MPICUBE_ADAPT_THREADS": "0"}}
SPIN = "import os, sys\nos.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True:\n    pass\n"


def run(shape: list, weights: str, steps: int, env_extra: dict, ranks: int = 0) -> dict:
    """One whole run in its own process(es): {"step_s": [...], "first_loss": ...}."""
    sys.path.insert(0, str(HERE))
    from compare_torch import run_worker

    env = dict(os.environ, **env_extra)
    for key in ("OMP_NUM_THREADS", "MPICUBE_ADAPT_THREADS"):
        if key not in env_extra:
            env.pop(key, None)
    if ranks:
        mpiexec = Path(sys.executable).with_name("mpiexec")
        cmd = [str(mpiexec) if mpiexec.exists() else "mpiexec", "-n", str(ranks), sys.executable, "-m", "mpicube",
               "bench", "--layout", "3d", *shape, "--steps", str(steps), "--warmup-steps", "3", "--json"]
        out = run_worker(cmd, env)
        return {"step_s": [out["step_time_s"]], "first_loss": float("nan")}
    cmd = [sys.executable, str(HERE / "compare_torch.py"), "--worker", "--weights", weights, *shape,
           "--steps", str(steps), "--warmup", "3"]
    return run_worker(cmd, env)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=0, help="time mpiexec -n RANKS mpicube bench --layout 3d [0: serial]")
    ap.add_argument("--n-layer", type=int, default=None, help="[4; --ranks: 2]")
    ap.add_argument("--n-head", type=int, default=12)
    ap.add_argument("--n-embd", type=int, default=None, help="[144; --ranks: 96]")
    ap.add_argument("--seq-len", type=int, default=None, help="[64; --ranks: 16]")
    ap.add_argument("--batch-size", type=int, default=None, help="[8; --ranks: 16]")
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--pairs", type=int, default=3, help="rounds of every setting in each case [3]")
    ap.add_argument("--cases", default="idle,loaded")
    ap.add_argument("--settings", default=",".join(SETTINGS), help=f"among {', '.join(SETTINGS)}")
    args = ap.parse_args()
    for name, serial, ranks in (("n_layer", 4, 2), ("n_embd", 144, 96), ("seq_len", 64, 16), ("batch_size", 8, 16)):
        if getattr(args, name) is None:
            setattr(args, name, ranks if args.ranks else serial)
    shape = ["--n-layer", str(args.n_layer), "--n-head", str(args.n_head), "--n-embd", str(args.n_embd),
             "--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size)]
    settings = args.settings.split(",")
    cpus = sorted(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory(prefix="thread_yield-") as tmp:
        weights = str(Path(tmp) / "weights.npz")
        if not args.ranks:
            subprocess.run([sys.executable, str(HERE / "compare_torch.py"), "--write-weights", weights, *shape],
                           check=True)
        for case in args.cases.split(","):
            spinner = (subprocess.Popen([sys.executable, "-c", SPIN, str(cpus[-1])]) if case == "loaded" else None)
            try:
                medians = {s: [] for s in settings}
                for i in range(args.pairs):
                    for s in settings[i % len(settings):] + settings[:i % len(settings)]:
                        r = run(shape, weights, args.steps, SETTINGS[s], args.ranks)
                        medians[s].append(statistics.median(r["step_s"]))
                        print(f"{case} round {i + 1} {s:<10} {medians[s][-1] * 1e3:8.1f} ms  "
                              f"(loss {r['first_loss']:.6f})", flush=True)
            finally:
                if spinner is not None:
                    spinner.kill()
                    spinner.wait()
            base = medians.get("one thread")
            for s in settings:
                line = f"{case:<7} {s:<10} medians {', '.join(f'{m * 1e3:.1f}' for m in medians[s])} ms"
                if base and s != "one thread":
                    ratios = [m / b for m, b in zip(medians[s], base)]
                    line += (f"; / one thread: {', '.join(f'{r:.2f}' for r in ratios)}, "
                             f"median {statistics.median(ratios):.2f}x")
                print(line, flush=True)


if __name__ == "__main__":
    main()
