"""How a collective's wait costs time and CPU when ranks share cores.

    python tools/wait_bench.py [--pairs 3] [--ranks 8] [--steps 60] [MODEL OPTIONS]
    python tools/wait_bench.py --stopped [--ranks 8]

The first form runs, in turn and ``--pairs`` times over, the same
``mpicube train`` three ways: on ``--ranks`` ranks (a 2x2x2 cube by
default) with mpicube's wait (``MPICUBE_WAIT=yield``, test and yield the
core while young), on the same ranks with MPI's blocking wait
(``MPICUBE_WAIT=block``, the baseline), and serially on one rank. It prints
each run's median tokens per second (steps after the first five, from
``metrics.jsonl``), the median over the pairs, and the ratios pair by pair:
the runs of one pair are taken minutes apart at most, so the ratios hold
when the machine's speed drifts. The losses must be the same in all three
(they are printed).

``--stopped`` runs a long 8-rank job, stops one rank with SIGSTOP once the
job is stepping, and reports the CPU the other ranks use over 8 seconds,
once per wait mode: the cost of waiting for a rank that does not come.

A figure, not a test: every number depends on the machine and its load.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MPIEXEC = Path(sys.executable).parent / "mpiexec"
SMALL = ["--n-layer", "2", "--n-embd", "96", "--n-head", "4", "--batch-size", "16", "--seq-len", "16"]


def job_env(mode: str) -> dict:
    env = dict(os.environ, MPICUBE_WAIT=mode, MPIEXEC_TIMEOUT="600")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    return env


def train(ranks: int, mode: str, layout: str, model: list, steps: int) -> tuple:
    """(median tokens/s over steps 6.., last loss) of one ``mpicube train``."""
    with tempfile.TemporaryDirectory() as out:
        cmd = [str(MPIEXEC), "-n", str(ranks), sys.executable, "-m", "mpicube", "train", "--layout", layout,
               *model, "--steps", str(steps), "--log-every", str(steps), "--out", out]
        subprocess.run(cmd, env=job_env(mode), check=True, capture_output=True)
        rows = [json.loads(line) for line in open(Path(out) / "metrics.jsonl")]
    rows = [r for r in rows if "tokens_per_s" in r]
    return statistics.median(r["tokens_per_s"] for r in rows[5:]), rows[-1]["loss"]


def descendants(pid: int) -> list:
    """Every process below ``pid`` (children first)."""
    out, todo = [], [pid]
    while todo:
        parent = todo.pop()
        try:
            with open(f"/proc/{parent}/task/{parent}/children") as f:
                kids = [int(k) for k in f.read().split()]
        except OSError:
            kids = []
        out += kids
        todo += kids
    return out


def rank_pids(launcher: int, ranks: int) -> dict:
    """rank -> pid of each MPI rank under the launcher (PMI_RANK)."""
    found = {}
    for pid in descendants(launcher):
        try:
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        for rank in range(ranks):
            if f"PMI_RANK={rank}".encode() in env:
                found[rank] = pid
    return found


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def stopped_cores(ranks: int, mode: str, layout: str, model: list) -> float:
    """Cores used by the ranks that wait for a stopped one, over 8 s."""
    with tempfile.TemporaryDirectory() as out:
        cmd = [str(MPIEXEC), "-n", str(ranks), sys.executable, "-m", "mpicube", "train", "--layout", layout,
               *model, "--steps", "100000", "--log-every", "1", "--collective-timeout", "60", "--out", out]
        proc = subprocess.Popen(cmd, env=job_env(mode), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        pids = {}
        try:
            metrics = Path(out) / "metrics.jsonl"
            while not metrics.exists() or len(metrics.read_text().splitlines()) < 5:
                time.sleep(0.05)
            pids = rank_pids(proc.pid, ranks)
            os.kill(pids[ranks - 1], signal.SIGSTOP)
            others = [pids[r] for r in range(ranks - 1)]
            time.sleep(3)                                   # every other rank reaches its wait
            before = sum(map(cpu_seconds, others))
            time.sleep(8)
            return (sum(map(cpu_seconds, others)) - before) / 8
        finally:
            for pid in pids.values():                   # a stopped rank ignores everything but SIGKILL
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            proc.kill()
            proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--layout", default="3d")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--stopped", action="store_true", help="the cores used waiting on a stopped rank")
    ap.add_argument("--default-model", action="store_true", help="train's default model, not the 96-wide one")
    args = ap.parse_args()
    model = [] if args.default_model else SMALL
    print(f"{os.cpu_count()} cores; {args.ranks} ranks, layout {args.layout}; model {' '.join(model) or 'default'}")
    if args.stopped:
        for mode in ("yield", "block"):
            cores = stopped_cores(args.ranks, mode, args.layout, model)
            print(f"one rank stopped, wait {mode}: the other {args.ranks - 1} ranks used {cores:.3f} cores")
        return
    rows = []
    for pair in range(args.pairs):
        y, loss_y = train(args.ranks, "yield", args.layout, model, args.steps)
        b, loss_b = train(args.ranks, "block", args.layout, model, args.steps)
        s, loss_s = train(1, "yield", "serial", model, args.steps)
        rows.append((y, b, s))
        print(f"pair {pair + 1}: yield {y:8.0f} tok/s   block {b:8.0f}   serial {s:8.0f}   "
              f"yield/block {y / b:.2f}x   yield/serial {y / s:.2f}x   losses {loss_y:.6f} {loss_b:.6f} {loss_s:.6f}")
    med = [statistics.median(r[i] for r in rows) for i in range(3)]
    print(f"median: yield {med[0]:.0f} tok/s, block {med[1]:.0f}, serial {med[2]:.0f}; "
          f"yield/block {statistics.median(r[0] / r[1] for r in rows):.2f}x "
          f"(range {min(r[0] / r[1] for r in rows):.2f}-{max(r[0] / r[1] for r in rows):.2f}), "
          f"yield/serial {statistics.median(r[0] / r[2] for r in rows):.2f}x")


if __name__ == "__main__":
    main()
