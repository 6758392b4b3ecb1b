"""How many FP8 codes flip between two float32 FP8 traces, and how the
default verdict's FP8 unit holds them (docs/fp8.md, "FP8 in the
depth-aware tolerance"; mpicube/check/fp8_tolerance.py).

    PYTHONPATH=. python tools/fp8_flips.py A.h5 B.h5 [--per-tensor]

Prints the verdict, the first flip with its allowance, the codes flipped
per step (one step apart, and further) and, after the first flip, the
largest relative Frobenius difference of codes and of floating tensors
against the format's step, and the largest projection along a tensor
(in units of rel_fro / sqrt(n)) against Z before the update.
"""

from __future__ import annotations

import argparse
import math

from mpicube.check import fp8_tolerance
from mpicube.check.compare import compare_traces
from mpicube.check.names import step_of


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--per-tensor", action="store_true", help="a line per quantized operand")
    args = ap.parse_args()
    result = compare_traces(args.a, args.b)
    rows = [r for r in result.rows if r.fp8]
    print("verdict:", "agree" if result.first_divergence is None else f"first divergence {result.first_divergence}")
    if not rows:
        print("no FP8 unit: the traces lack the fp8 attribute, or both accumulate in float64")
        return
    codes = [r for r in rows if r.fp8["kind"] == "codes"]
    for s in sorted({step_of(r.name) for r in codes}):
        mine = [r for r in codes if step_of(r.name) == s]
        total = sum(r.fp8["total"] for r in mine)
        one, far = sum(r.fp8["one"] for r in mine), sum(r.fp8["far"] for r in mine)
        print(f"step {s}: {one} codes one step apart, {far} further, of {total} ({(one + far) / total:.2%})")
        for r in mine if args.per_tensor else ():
            print(f"    {r.name:50s} {r.fp8['one']:7d} {r.fp8['far']:7d} of {r.fp8['total']:7d}")
    first = next((r for r in codes if r.fp8["one"] or r.fp8["far"]), None)
    if first is None:
        print("no code flipped")
        return
    print(f"first flip: {first.name}: {first.note}")
    after = [r for r in rows if "FP8 cascade" in r.note]
    for kind, bound in (("codes", None), ("float", fp8_tolerance.cascade_unit(fp8_tolerance_unit(result)))):
        mine = [r for r in after if r.fp8["kind"] == kind and "rel" in r.fp8]
        if mine:
            worst = max(mine, key=lambda r: r.fp8["rel"])
            print(f"after it, {kind}: {len(mine)} tensors outside float32's budget, largest rel fro "
                  f"{worst.fp8['rel']:.3g} ({worst.name})" + (f", bound {bound:g}" if bound else ""))
    along = [r for r in after if "along itself" in r.note]
    if along:
        worst = max(along, key=lambda r: r.fp8["along"] * math.sqrt(math.prod(r.shape)) / r.fp8["rel"])
        z = worst.fp8["along"] * math.sqrt(math.prod(worst.shape)) / worst.fp8["rel"]
        print(f"before the update: largest projection along a tensor {z:.3g} rel fro / sqrt(n) ({worst.name}), "
              f"Z {fp8_tolerance.Z:g}")


def fp8_tolerance_unit(result) -> dict:
    """The unit compare used, read back from the traces."""
    import h5py
    with h5py.File(result.path_a) as fa, h5py.File(result.path_b) as fb:
        return fp8_tolerance.unit_of({"A": fa, "B": fb}, {"A": result.path_a, "B": result.path_b})


if __name__ == "__main__":
    main()
