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
from .measure import blocks

K = 4.0
ATTR = "envelope"


def statistics(a: np.ndarray, b: np.ndarray) -> tuple:
    """(rel_fro, scale) of ``b`` against the reference ``a`` (float64)."""
    a, b = np.asarray(a), np.asarray(b)
    return read_statistics(lambda block: a[block], lambda block: b[block], a.shape)


def read_statistics(read_a, read_b, shape: tuple) -> tuple:
    """``statistics`` of two tensors of ``shape`` given by readers
    (measure.py's ``read(block)``), accumulated one block at a time: the
    memory a trace's declared sizes cannot drive."""
    aa = bb = dd = da = 0.0
    for block in blocks(shape):
        a = np.asarray(read_a(block), dtype=np.float64).ravel()
        b = np.asarray(read_b(block), dtype=np.float64).ravel()
        d = b - a
        aa, bb, dd, da = aa + float(a @ a), bb + float(b @ b), dd + float(d @ d), da + float(d @ a)
    norm = math.sqrt(max(aa, bb))
    rel = math.sqrt(dd) / norm if norm > 0 else (0.0 if dd == 0 else math.inf)
    scale = abs(da) / aa if aa > 0 else rel
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


def judge(row, name: str, readers: list, shape: tuple, kinds: tuple, env: dict, side: str) -> None:
    """Set ``row.ok``, ``row.bound`` (k x the envelope's rel_fro, so the
    report's margin is the envelope's) and, on a failure, the note, for a
    floating tensor compared in both traces (``readers``: A's and B's
    ``read(block)``, ``kinds`` their dtype kinds)."""
    depth_bound = row.bound                                  # measure's depth-aware bound
    if not row.compared or kinds[0] != "f" or kinds[1] != "f":
        return
    k = float(env["k"])
    entry = env["tensors"].get(name)
    if entry is None:
        row.ok, row.bound = False, math.nan
        row.note = "; ".join(filter(None, (row.note, "no envelope for this tensor")))
        return
    ref, other = readers if side == "A" else readers[::-1]
    rel, scale = read_statistics(ref, other, shape)
    row.bound = k * float(entry[0])
    if "/param/" in name:               # AdamW's caveat: no tighter than the depth bound (module docstring)
        row.bound = max(row.bound, depth_bound)
        scale = 0.0
    scale_bound = k * max(float(entry[1]), float(entry[0]) / math.sqrt(max(1, math.prod(shape))))
    within = rel <= row.bound and scale <= scale_bound
    row.ok = within and math.isfinite(row.max_abs)          # a NaN against a number stays a divergence
    if not within:
        why = (f"rel fro {rel:.2e} > {k:g} x envelope {float(entry[0]):.2e}" if rel > row.bound else
               f"scale {scale:.2e} > {scale_bound:.2e} = {k:g} x its envelope (a systematic error along the tensor)")
        row.note = "; ".join(filter(None, (row.note, why)))
