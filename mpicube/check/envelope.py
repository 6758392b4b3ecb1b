"""Measured tolerances: per tensor, the spread that a correct run at the
candidate's precision shows against the float64 reference, from reruns
with the reduction orders varied (``mpicube trace --envelope N``), and the
verdict ``compare --tolerance envelope`` draws from it.

Why measured: the depth bound (tolerance.py) is a worst case, so at
bfloat16 it is loose enough to pass a gradient 1% off; a per-dtype budget
is one number for every tensor. What a correct 16-bit implementation does
differ by is what reruns of the reference in 16 bits, summing in other
orders, differ by - tensor by tensor.

Two statistics per tensor, of the difference d = b - a against the
reference a:

- ``rel_fro`` = ||d||_F / max(||a||_F, ||b||_F), the size of the
  difference (as compare prints it);
- ``scale`` = |<d, a>| / <a, a>, the part of the difference along the
  tensor itself: a gradient scaled by 1.01 has scale 1e-2, while rounding
  noise, with no direction, averages out to about rel_fro / sqrt(n) over
  n elements. It is what finds a small systematic error that the noise's
  size hides.

The envelope of a tensor is the largest of each over the reruns; a
candidate fails the tensor when its rel_fro exceeds ``K`` times the
envelope's, or its scale exceeds ``K`` times the larger of the envelope's
scale and the envelope's rel_fro / sqrt(n) (what noise of that size
projects onto one direction: a few reruns sample the scale too thinly to
stand alone) (``K`` = 4: reruns sample the rounding of one implementation,
and another implementation rounds at other places; the report prints the
margin). The envelope is the reference trace's root attribute
``envelope``: JSON ``{"k": 4, "runs": N, "dtype": "bfloat16", "orders":
[...], "tensors": {name: [rel_fro, scale]}}`` (docs/trace-format.md).

The updated parameters (``param/``) are held to the larger of the
envelope and the depth bound, on rel_fro alone: where a gradient element
is rounding noise, AdamW turns it into a step of size lr whose sign is
the noise's (m / sqrt(v)), so a correct candidate's parameter can part by
a few such steps that no number of reruns samples (measured: a 2-rank
1-D bfloat16 candidate parts from 8 serial reruns' envelope in
``param/h.1.ln_1.weight`` by 110 times it). Bugs show first in the
gradients and the moments, which the envelope holds tightly."""

from __future__ import annotations

import json
import math

import numpy as np

from ..core.errors import UserError

K = 4.0
ATTR = "envelope"


def statistics(a: np.ndarray, b: np.ndarray) -> tuple:
    """(rel_fro, scale) of ``b`` against the reference ``a`` (float64)."""
    a, b = np.asarray(a, dtype=np.float64).ravel(), np.asarray(b, dtype=np.float64).ravel()
    d = b - a
    norm = max(float(np.linalg.norm(a)), float(np.linalg.norm(b)))
    aa = float(a @ a)
    rel = float(np.linalg.norm(d)) / norm if norm > 0 else (0.0 if not d.any() else math.inf)
    scale = abs(float(d @ a)) / aa if aa > 0 else rel
    return rel, scale


def measure(reference: dict, runs: list) -> dict:
    """{name: [rel_fro, scale]}, the largest over ``runs`` ({name: array}
    each) of every floating tensor of ``reference``."""
    out = {}
    for name, ref in reference.items():
        if np.asarray(ref).dtype.kind != "f":
            continue
        stats = [statistics(ref, run[name]) for run in runs if name in run]
        if stats:
            out[name] = [max(s[0] for s in stats), max(s[1] for s in stats)]
    return out


def read(files: dict, paths: dict) -> tuple:
    """(side, envelope dict) of the first of A, B that holds one; bad input
    naming the option when neither does."""
    for side in "AB":
        raw = files[side].attrs.get(ATTR)
        if raw is None:
            continue
        try:
            env = json.loads(raw.decode() if isinstance(raw, bytes) else str(raw))
            float(env["k"]), dict(env["tensors"])
        except (ValueError, KeyError, TypeError):
            raise UserError(f"{paths[side]}: the '{ATTR}' attribute is not an envelope (JSON with k and "
                            f"tensors)") from None
        return side, env
    raise UserError("--tolerance envelope: neither trace holds an envelope; write the reference with "
                    "mpicube trace --envelope N --dtype DTYPE")


def judge(row, name: str, a: np.ndarray, b: np.ndarray, env: dict, side: str) -> None:
    depth_bound = row.bound                                  # measure's depth-aware bound
    """Set ``row.ok``, ``row.bound`` (k x the envelope's rel_fro, so the
    report's margin is the envelope's) and, on a failure, the note, for a
    floating tensor compared in both traces."""
    if not row.compared or np.asarray(a).dtype.kind != "f" or np.asarray(b).dtype.kind != "f":
        return
    k = float(env["k"])
    entry = env["tensors"].get(name)
    if entry is None:
        row.ok, row.bound = False, math.nan
        row.note = "; ".join(filter(None, (row.note, "no envelope for this tensor")))
        return
    ref, other = (a, b) if side == "A" else (b, a)
    rel, scale = statistics(ref, other)
    row.bound = k * float(entry[0])
    if "/param/" in name:               # AdamW's caveat: no tighter than the depth bound (module docstring)
        row.bound = max(row.bound, depth_bound)
        scale = 0.0
    scale_bound = k * max(float(entry[1]), float(entry[0]) / math.sqrt(max(1, np.size(a))))
    within = rel <= row.bound and scale <= scale_bound
    row.ok = within and math.isfinite(row.max_abs)          # a NaN against a number stays a divergence
    if not within:
        why = (f"rel fro {rel:.2e} > {k:g} x envelope {float(entry[0]):.2e}" if rel > row.bound else
               f"scale {scale:.2e} > {scale_bound:.2e} = {k:g} x its envelope (a systematic error along the tensor)")
        row.note = "; ".join(filter(None, (row.note, why)))
