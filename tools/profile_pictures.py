"""The timelines of docs/profiling.md: one profiled bench per layout,
drawn with ``mpicube timeline``, and the table of their per-rank
fractions.

    .venv/bin/python tools/profile_pictures.py --out docs/profiling     # needs matplotlib

Serial runs on 1 rank, every other layout on 8: 1-D on 8, 2-D on 2 x 2
with 2 data-parallel replicas, 2.5-D on 2 x 2 x 2 (depth 2), 3-D on
2 x 2 x 2. Each run is ``mpicube bench --profile 3:4`` after two warm-up
steps (steps 3 and 4 are drawn) of one small model that every layout
accepts on 8 ranks. The pictures show this machine: on one with fewer
cores than ranks, ranks wait for each other's turn on a core, and that
shows as exposed communication.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = ["--n-layer", "2", "--n-head", "8", "--n-embd", "128", "--seq-len", "64"]
RUNS = [("serial", 1, []), ("1d", 8, []), ("2d", 8, ["--dp", "2"]), ("2.5d", 8, ["--depth", "2"]),
        ("3d", 8, [])]


def run(layout: str, ranks: int, extra: list, run_dir: Path) -> dict:
    """One profiled bench; its results (rank 0's) as bench --json gives them."""
    mpiexec = Path(sys.executable).parent / "mpiexec"
    cmd = [str(mpiexec), "-n", str(ranks), sys.executable, "-m", "mpicube", "bench", "--layout", layout, *extra,
           *MODEL, "--warmup-steps", "2", "--steps", "2", "--profile", "3:4", "--out", str(run_dir), "--json"]
    env = dict(os.environ, MPIEXEC_TIMEOUT="600", PYTHONPATH=str(ROOT))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])["results"][0]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "docs" / "profiling"), help="folder of the pictures")
    parser.add_argument("--layout", action="append", help="only these layouts (default: all five)")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from mpicube.analysis.profile_summary import summarize
    from mpicube.analysis.timeline import draw

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for layout, ranks, extra in RUNS:
            if args.layout and layout not in args.layout:
                continue
            run_dir = Path(tmp) / layout
            result = run(layout, ranks, extra, run_dir)
            print(draw(run_dir, out / f"{layout}.png"))
            summary = summarize(json.loads((run_dir / "profile.json").read_text()))
            totals = [r["total"] for r in summary["ranks"].values()]
            mean = {k: sum(t[k + "_fraction"] for t in totals) / len(totals)
                    for k in ("compute", "exposed", "idle", "overlapped")}
            worst = max(t["max_accounting_error"] for t in totals)
            rows.append(f"| {layout} | {ranks} | {result['step_time_s'] * 1e3:.0f} | "
                        f"{100 * mean['compute']:.0f}% | {100 * mean['exposed']:.0f}% | "
                        f"{100 * mean['overlapped']:.1f}% | {100 * mean['idle']:.1f}% | "
                        f"{result['comm']['predicted_bytes'] / 1e6:.2f} | {100 * worst:.2f}% |")
    print("| layout | ranks | step ms | compute | exposed | overlapped | idle | predicted MB | "
          "worst accounting error |")
    print("|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
