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

Under ``--fp8`` the envelope says so (``"fp8": RECIPE``), and two things
change. A recipe whose scales follow the micro-batch (all but delayed)
leaves one rank only the attention's order to vary (analysis/envelope.py),
two reruns, too thin a sample of another layout's rounding (measured: a
2-rank 1-D float32 tensorwise candidate parts from 2 serial reruns'
envelope in step 2's loss by 85 times it), so both bounds are at least one
rounding per stage, the depth bound without its factor: u depth, still
far below a 1% error at float32. The scale's floor is not divided by
sqrt(n): a tensor scale rounded one ulp apart multiplies a whole GEMM's
output, so FP8's rounding has a direction (measured: the same candidate's
step-3 gradient of c_attn lies 2.6e-07 along itself, its dy scale one
float32 ulp, 2.65e-07, from the reference's).
And the quantized weights' FP8 codes (``fp8/.../bytes``, uint8, exact
elsewhere) may each lie one step from the reference's (``codes``).

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
from .tolerance import DEPTH_FACTOR

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
    if row.compared and kinds == ("u", "u") and "/fp8/" in name:
        codes(row, name, readers, shape)
        return
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
    root_n = math.sqrt(max(1, math.prod(shape)))
    floor = depth_bound / DEPTH_FACTOR if env.get("fp8") else 0.0     # FP8's thin sample (module docstring)
    row.bound = max(k * float(entry[0]), floor)
    if "/param/" in name:               # AdamW's caveat: no tighter than the depth bound (module docstring)
        row.bound = max(row.bound, depth_bound)
        scale = 0.0
    scale_bound = max(k * max(float(entry[1]), float(entry[0]) / root_n), floor)
    within = rel <= row.bound and scale <= scale_bound
    row.ok = within and math.isfinite(row.max_abs)          # a NaN against a number stays a divergence
    if not within:
        by = "its floor, u depth" if floor and scale_bound == floor else f"{k:g} x its envelope"
        why = (f"rel fro {rel:.2e} > {k:g} x envelope {float(entry[0]):.2e}" if rel > row.bound else
               f"scale {scale:.2e} > {scale_bound:.2e} = {by} (a systematic error along the tensor)")
        row.note = "; ".join(filter(None, (row.note, why)))


SUBNORMAL = 4          # magnitude codes 1..3: subnormal in e5m2 (exponent field 0) and in e4m3


def code_steps(a, b, exponents: bool, noisy: bool):
    """The FP8 steps between codes ``a`` and ``b`` (int16 arrays of one
    shape): E8M0 exponents' difference (``exponents``: one code = a factor
    2), else sign-and-magnitude codes' (across zero: both magnitudes'
    steps), at most one where both are subnormal and ``noisy`` (rounding
    noise around a zero)."""
    if exponents:
        return np.abs(a - b)
    sa, sb, ma, mb = a >> 7, b >> 7, a & 0x7F, b & 0x7F
    steps = np.where(sa == sb, np.abs(ma - mb), ma + mb)
    if noisy:
        steps = np.where((ma < SUBNORMAL) & (mb < SUBNORMAL), np.minimum(steps, 1), steps)
    return steps


def codes(row, name: str, readers: list, shape: tuple) -> None:
    """``--fp8``'s quantized weights (``fp8/.../bytes``: sign and magnitude
    codes) and MXFP8's E8M0 scales (``fp8/.../scale`` as uint8: exponent
    codes) under the envelope: each code within one step of the
    reference's. A correct candidate's weight differs from the float64
    reference's by rounding, and an element that lies at a rounding
    boundary of the FP8 grid then lands on the neighbouring code - rarely,
    so no number of reruns samples it, and exactness would fail a correct
    candidate. A wrong scale or a wrong weight moves codes further, and the
    tensor's scale row (a float, held to its envelope) moves too. An
    activation's or gradient's codes (x, dy) may also differ further where
    both are subnormal (magnitude code below ``SUBNORMAL``, below the
    smallest normal of e5m2 and of e4m3): float32 rounding noise around an
    exact zero computed as a difference, which another summation order
    changes (a query's score gradients where a sequence repeats a token,
    docs/fp8.md "Across layouts")."""
    apart = total = 0
    noisy = name.rsplit("/", 2)[-2].split(".")[0] in ("x", "dy")      # an activation's or a gradient's codes
    for block in blocks(shape):
        a = np.asarray(readers[0](block)).astype(np.int16)
        b = np.asarray(readers[1](block)).astype(np.int16)
        steps = code_steps(a, b, name.endswith("/scale"), noisy)
        far = steps > 1
        if far.any():
            at = tuple(int(i) + (s.start or 0) for i, s in zip(np.unravel_index(int(np.flatnonzero(far)[0]),
                                                                                 far.shape), block))
            row.ok = False
            row.note = f"codes more than one FP8 step apart, first at {at}: {int(a[far][0])} vs {int(b[far][0])}"
            return
        apart += int((steps == 1).sum())
        total += steps.size
    row.ok = True
    row.note = f"{apart} of {total} codes one FP8 step apart (a rounding boundary)" if apart else ""
