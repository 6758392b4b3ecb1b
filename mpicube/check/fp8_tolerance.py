"""The default verdict's FP8 unit: two traces made with ``--fp8`` (the
``fp8`` root attribute) of which either accumulates in float32
(docs/fp8.md, "FP8 in the depth-aware tolerance", holds the derivation
and the measurements).

Before the first flip. Layouts add a linear's products in other orders,
so a quantizer's input differs between them by float32 rounding, relative
``d`` (the depth bound at the operand's depth, ``tolerance.depth_bound``).
An element whose scaled value v lies within ``d |v|`` of a rounding
midpoint lands on the neighbouring code. Its place inside its grid cell
is spread evenly (the float32 noise is 2^20 times finer than the cell),
so that happens with probability ``d |v| / cell <= 2^(m+1) d`` (m the
significand bits: 3 for e4m3, 2 for e5m2; |v| / cell lies in [2^m,
2^(m+1))). Over n elements the flips are a sum of independent trials of
mean ``mu <= 2^(m+1) d n``, and a correct pair holds more than
``allowed(mu)`` with probability below ``CONFIDENCE`` (Chernoff:
``P(N >= a) <= exp(-mu) (e mu / a)^a``). Every other code must agree.

After it. A flipped code moves its element by one FP8 step, a relative
2^-m, so the GEMM output rows it feeds move by about 2^-m / sqrt(K),
far above float32's rounding, and the next quantizer's inputs in those
rows flip with probability about 2 / sqrt(K): the difference cascades
(through the residual rows, attention, the weight gradients' sums over
tokens, AdamW's update) until the two runs differ by FP8's own
quantization noise. There a tensor the budget fails holds to
``rel_fro <= 2^-m`` (its own format's for codes, decoded, and scales; the
coarsest format's for the rest), and, before the first flip's step
updates the parameters, a floating tensor also to a test that noise
passes and a systematic error does not: the part of the difference along
the tensor itself, ``|<b - a, a>| / <a, a>``, within ``Z`` times what
noise of that size would project onto one direction if it were spread
over the n elements (``rel_fro / sqrt(n)``). The cascade's noise starts
in a few tokens' rows, so it projects more than that: measured up to
17.6 of those units, hence Z = 32. After the update the runs are at
different parameters, and a 1% error is not resolvable by two traces:
``--fp8-accumulate float64`` is the exact check.
"""

from __future__ import annotations

import json
import math

import numpy as np

from .envelope import code_steps, read_statistics
from .measure import blocks

CONFIDENCE = 1e-6           # a correct pair's chance of more flips than allowed, per tensor
Z = 32.0                   # noise's projection onto one direction, in units of rel_fro / sqrt(n)
SIGNIFICAND = {"e4m3": 3, "e5m2": 2, "e8m0": 0}      # m: the relative step of the format is 2^-m


def unit_of(files: dict, paths: dict):
    """The recipe both traces were made with (their ``fp8`` attribute,
    trace.py, writer.py) when either accumulates in float32 (a float64
    reference against a framework's float32 run included), else None:
    float64 accumulation on both sides makes every layout quantize the same
    bits, and exactness stays the rule."""
    found = []
    for side in "AB":
        raw = files[side].attrs.get("fp8")
        if raw is None:
            return None
        try:
            found.append(json.loads(raw.decode() if isinstance(raw, bytes) else str(raw)))
        except ValueError:
            return None
    a, b = found              # a malformed attribute gives no unit: exactness, the stricter verdict
    if not all(isinstance(x, dict) and x.get("accumulate") in ("float32", "float64")
               and x.get("grad_format") in ("e4m3", "e5m2") for x in found):
        return None
    if "float32" not in (a["accumulate"], b["accumulate"]):      # both float64: the same bits, exactness
        return None
    if (a.get("recipe"), a.get("grad_format")) != (b.get("recipe"), b.get("grad_format")):
        return None
    return {"recipe": a.get("recipe"), "grad_format": a["grad_format"]}


def format_of(name: str, unit: dict, scale_codes: bool = False) -> str:
    """e4m3 for x and W, the recipe's gradient format for dy; an MX scale's E8M0."""
    if scale_codes:
        return "e8m0"
    role = name.rsplit("/", 2)[-2].split(".")[0]
    return unit["grad_format"] if role == "dy" else "e4m3"


def cascade_unit(unit: dict) -> float:
    """The relative step of the coarsest format the recipe uses."""
    return 2.0 ** -min(SIGNIFICAND["e4m3"], SIGNIFICAND[unit["grad_format"]])


def allowed(mu: float) -> int:
    """The least count a > mu with exp(-mu) (e mu / a)^a below CONFIDENCE."""
    a = max(1, math.ceil(mu))
    while a * math.log(a / max(mu, 1e-300)) - a + mu < -math.log(CONFIDENCE):
        a += 1
    return a


def code_stats(name: str, readers: list, shape: tuple, fmt: str, d: float) -> dict:
    """Flips between A's and B's codes (sign and magnitude, or E8M0
    exponents), the allowance before a cascade, and the decoded values'
    (rel_fro, along A) for after one; each block read once."""
    one = far = total = 0
    aa = bb = dd = da = 0.0
    decode = _decoder(fmt) if fmt != "e8m0" else None
    for block in blocks(shape):
        a = np.asarray(readers[0](block)).astype(np.int16)
        b = np.asarray(readers[1](block)).astype(np.int16)
        steps = code_steps(a, b, fmt == "e8m0", noisy=True)
        if decode is not None:
            va, vb = decode(a.ravel()), decode(b.ravel())
            diff = vb - va
            aa, bb, dd, da = aa + float(va @ va), bb + float(vb @ vb), dd + float(diff @ diff), da + float(diff @ va)
        one += int((steps == 1).sum())
        far += int((steps > 1).sum())
        total += steps.size
    mu = 2.0 ** (SIGNIFICAND[fmt] + 1) * d * total
    stats = {"kind": "codes", "one": one, "far": far, "total": total, "mu": mu, "allowed": allowed(mu)}
    if decode is not None:                          # envelope.read_statistics' two numbers
        norm = math.sqrt(max(aa, bb))
        stats["rel"] = math.sqrt(dd) / norm if norm > 0 else (0.0 if dd == 0 else math.inf)
        stats["along"] = abs(da) / aa if aa > 0 else stats["rel"]
    return stats


def _decoder(fmt: str):
    """uint8 codes -> float64 values of e4m3 (OCP's "fn": no infinity,
    0x7F NaN) or e5m2 (IEEE-like), by a table of the 256 codes, numpy only
    (the check package reads traces without ml_dtypes)."""
    m, bias = SIGNIFICAND[fmt], {"e4m3": 7, "e5m2": 15}[fmt]
    code = np.arange(256)
    e, mant = (code & 0x7F) >> m, code & ((1 << m) - 1)
    magnitude = np.where(e == 0, mant / 2.0 ** m * 2.0 ** (1 - bias), (1 + mant / 2.0 ** m) * 2.0 ** (e - bias))
    top = (code & 0x7F) == 0x7F if fmt == "e4m3" else e == (1 << (7 - m)) - 1
    if fmt == "e5m2":
        magnitude = np.where(top & (mant == 0), np.inf, magnitude)
    magnitude = np.where(top & ((mant != 0) | (fmt == "e4m3")), np.nan, magnitude)
    table = np.where(code >> 7, -magnitude, magnitude)
    return lambda codes: table[np.asarray(codes).astype(np.uint8)]


def float_stats(readers: list, shape: tuple) -> dict:
    rel, along = read_statistics(readers[0], readers[1], shape)
    return {"kind": "float", "rel": rel, "along": along}


def judge(rows: list, unit: dict) -> None:
    """Walk ``rows`` in computation order: codes before the first flip
    hold to the allowance; after it, every tensor the budget failed (codes
    decoded) holds to the cascade's unit, and a floating tensor of the
    step the first flip happened in, before its update, also to the test
    along itself (module docstring)."""
    first = updated = None              # the first row with a flipped code; the first update after it
    for row in rows:
        st = getattr(row, "fp8", None)
        if first is not None and updated is None and "/param/" in row.name:
            updated = row.name
        if st is None or (st["kind"] == "float" and not math.isfinite(row.max_abs)):
            continue
        if st["kind"] == "codes" and first is None:
            row.ok = st["far"] == 0 and st["one"] <= st["allowed"]
            if st["one"] or st["far"]:
                first = row.name
                row.note = (f"{st['one']} of {st['total']} codes one FP8 step apart, {st['far']} further "
                            f"(float32 rounding allows {st['allowed']} one-step flips: mean at most "
                            f"{st['mu']:.2g})")
            continue
        if first is None or row.ok:
            continue
        cascade = f"FP8 cascade after {first}"
        if "rel" not in st:                                   # E8M0 scales: one step is a factor 2
            row.ok = st["far"] == 0
            row.note = f"{cascade}: E8M0 codes " + ("within one step" if row.ok else
                                                     f"{st['far']} more than one step apart")
            continue
        operand = "/fp8/" in f"/{row.name}"                   # its codes or its scales: the format's step
        bound = unit_step(row.name, unit) if operand else cascade_unit(unit)
        row.ok = st["rel"] <= bound
        why = f"rel fro {st['rel']:.2e} {'<=' if row.ok else '>'} {bound:g}"
        n = math.prod(row.shape)
        if not operand and updated is None and n > 1:             # before the update: along itself too
            along_bound = Z * st["rel"] / math.sqrt(n)
            row.ok = row.ok and st["along"] <= along_bound
            why += (f", along itself {st['along']:.2e} {'<=' if st['along'] <= along_bound else '>'} "
                    f"{along_bound:.2e} = {Z:g} rel fro / sqrt(n)")
        elif not operand and updated is not None:
            why += f" (after {updated.split('/', 1)[0]}'s update: a 1% error is not resolvable here)"
        row.note = "; ".join(filter(None, (row.note, f"{cascade}: {why}")))


def unit_step(name: str, unit: dict) -> float:
    """The relative step of the format a codes tensor (or its scale) is in."""
    return 2.0 ** -SIGNIFICAND[format_of(name, unit)]
