"""What ``compare`` prints, and the command without MPI.

``mpicube compare`` prints ``format_report`` of ``compare.compare_traces``;
``python -m mpicube.check A.h5 B.h5`` does the same with numpy and h5py
alone, for a framework's CI where mpicube's MPI stack is not installed.
Exit status 0 when everything agrees, 1 at a divergence, 2 for bad input.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from ..core.errors import UserError
from .compare import Result, compare_traces
from .tolerance import DEPTH_FACTOR


def _num(x: float) -> str:
    if math.isnan(x):
        return "-"
    return "0" if x == 0 else ("inf" if math.isinf(x) else f"{x:.2e}")


def _margin(x: float) -> str:
    if math.isnan(x):
        return "-"
    return "exact" if math.isinf(x) else f"{x:.1e}x"


def format_report(result: Result) -> str:
    width = max([len(r.name) for r in result.rows] + [6])
    verdict = {"budget": "the budget decides", "depth": "the depth bound decides",
               "envelope": f"the measured envelope decides (bound = k x the envelope's rel fro, "
                           f"and the scale error within k x its own; docs/trace-format.md)"}[result.verdict]
    lines = [f"A: {result.path_a} ({result.labels[0]})", f"B: {result.path_b} ({result.labels[1]})",
             f"budget: |a - b| <= {result.atol:g} + {result.rtol:g} * max(|a|, |b|); "
             f"depth bound: ||a - b||_F / max(||a||_F, ||b||_F) <= {DEPTH_FACTOR:g} u depth; {verdict}",
             f"margin = depth bound / relative Frobenius error (above 1: within rounding)", "",
             f"{'tensor':<{width}}  {'shape':<14} {'max abs':>9} {'max rel':>9} {'rel fro':>9} {'bound':>9} "
             f"{'margin':>9}  ok"]
    for r in result.rows:
        if not r.compared:
            ok = ("allowed" if r.ok else "NO") + f" ({r.note})"
            lines.append(f"{r.name:<{width}}  {'-':<14} {'-':>9} {'-':>9} {'-':>9} {'-':>9} {'-':>9}  {ok}")
            continue
        shape = "x".join(map(str, r.shape)) or "scalar"
        ok = ("yes" if r.ok else "NO") + (f" ({r.note})" if r.note else "")
        lines.append(f"{r.name:<{width}}  {shape:<14} {_num(r.max_abs):>9} {_num(r.max_rel):>9} "
                     f"{_num(r.rel_fro):>9} {_num(r.bound):>9} {_margin(r.margin):>9}  {ok}")
    lines.append("")
    compared = [r for r in result.rows if r.compared]
    bad = [r for r in result.rows if not r.ok]
    missing = [r for r in result.rows if not r.compared and not r.ok]
    lines.append(f"{len(compared)} tensors compared, {len(bad) - len(missing)} outside tolerance, "
                 f"{len(missing)} missing, {len(result.allowed)} missing but allowed; "
                 f"largest relative difference {_num(result.max_rel)}")
    if not bad:
        lines.append("all tensors agree")
    else:
        row = bad[0]
        why = row.note or f"max abs {_num(row.max_abs)}, max rel {_num(row.max_rel)}"
        lines.append(f"first divergence: {row.name} ({why})")
    return "\n".join(lines)


def run(path_a, path_b, rtol=None, atol=None, allow_missing=(), verdict="budget", as_json=False, echo=print) -> int:
    """Compare, print the report (and the --json line), return the exit status."""
    result = compare_traces(path_a, path_b, rtol, atol, allow_missing, verdict)
    echo(format_report(result))
    if as_json:
        echo(json.dumps(result.summary()))
    return 0 if result.first_divergence is None else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mpicube.check",
                                 description="Compare two mpicube traces tensor by tensor (numpy and h5py only).")
    ap.add_argument("trace_a", metavar="A.h5")
    ap.add_argument("trace_b", metavar="B.h5")
    ap.add_argument("--rtol", type=float, default=None)
    ap.add_argument("--atol", type=float, default=None)
    ap.add_argument("--allow-missing", action="append", default=[], metavar="GLOB",
                    help="dataset paths (step_*/act/h.*.attn) or @attribute that may be absent from one trace")
    ap.add_argument("--tolerance", choices=("budget", "depth", "envelope"), default="budget")
    ap.add_argument("--json", dest="as_json", action="store_true")
    args = ap.parse_args(argv)
    try:
        return run(args.trace_a, args.trace_b, args.rtol, args.atol, args.allow_missing, args.tolerance,
                   args.as_json)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
