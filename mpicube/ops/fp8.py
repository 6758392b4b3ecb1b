"""FP8 quantization, emulated exactly: the formats, the amax of each scaling
group, the scale rules and the rounding, written from their definitions.

A recipe quantizes a GEMM operand in three moves, kept apart here so that
a layout can reduce the middle one over the ranks holding pieces of the
tensor (``parallel/fp8.py``) before the last:

1. ``group_amax``: max |x| over each scaling group of a 2-D operand whose
   *last axis is the GEMM's contraction* (the caller transposes):
   the whole tensor, each row, each 1 x b tile along the row, each b x b
   block;
2. a scale from the amax: ``current_scale`` (torchao's and Transformer
   Engine's rule, fmt_max / amax rounded to float32, optionally down to a
   power of two; DeepSeek-V3's tiles and blocks use it too) or
   ``mx_scale`` (OCP Microscaling v1.0: an E8M0 power of two);
3. ``quantize``: the operand in float32, times its scale (one float32
   rounding), clamped to the format's largest finite value (saturation)
   and rounded to nearest-even into e4m3 or e5m2 by ml_dtypes.

``dequantize`` gives back q / scale (or q * 2^e for MX) in the GEMM's
accumulation format: exact in float64 (a 4-bit significand times a
float32), so FP8 products summed in float64 do not depend on the order.
NaN and inf never get here silently: ``require_finite`` names the tensor.
Only ``mx_scale`` follows the spec's rule for them (a NaN scale).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_ML_DTYPES = []              # [the module, or None where it is not installed], once looked for


def ml_dtypes():
    """ml_dtypes (a core dependency), imported on first use; None without
    it, so that mpicube runs until --fp8 (or bfloat16) is asked for. Not
    at import: it costs about half a CPU second, which every command on
    every rank would pay though only FP8 runs use it."""
    if not _ML_DTYPES:
        try:
            import ml_dtypes as module
        except ImportError:
            module = None
        _ML_DTYPES.append(module)
    return _ML_DTYPES[0]


E8M0_BIAS = 127
AMAX_FLOOR = 1e-12          # torchao's EPS: an all-zero group gets the scale fmt_max / 1e-12


@dataclass(frozen=True)
class Fp8Format:
    """One FP8 element format: its ml_dtypes type (``dtype``), its largest finite
    value (the saturation bound) and the exponent of that value's leading
    power of two (``emax``, the MX scale rule's subtrahend)."""

    name: str
    type_name: str          # ml_dtypes' name of the type
    max: float
    emax: int

    @property
    def dtype(self) -> type:
        return getattr(ml_dtypes(), self.type_name)


E4M3 = Fp8Format("e4m3", "float8_e4m3fn", 448.0, 8)     # no inf; 0x7f/0xff NaN
E5M2 = Fp8Format("e5m2", "float8_e5m2", 57344.0, 15)    # IEEE-like, with inf
FORMATS = {"e4m3": E4M3, "e5m2": E5M2}


class NonFiniteError(ValueError):
    """NaN or inf reached a quantizer: the message names the tensor."""


def require_finite(x, what: str) -> None:
    """NonFiniteError naming ``what`` unless every element of x is finite."""
    if not np.isfinite(x).all():
        bad = "NaN" if np.isnan(x).any() else "inf"
        raise NonFiniteError(f"{bad} reached the FP8 quantizer of {what}")


# --- 1. amax per scaling group --------------------------------------------

def group_amax(x, group):
    """max |x| of each scaling group of x (n, K), contraction along K.
    ``group``: "tensor" -> (1, 1); "row" -> (n, 1); ("tile", b) -> (n, K/b),
    1 x b tiles along each row; ("block", b) -> (n/b, K/b), b x b blocks.
    A tile or block never straddles the array's edge: K (and n for blocks)
    must be multiples of b (the layouts check their shards first)."""
    a = np.abs(x.astype(np.float32, copy=False))                 # (n, K)
    n, k = a.shape
    if group == "tensor":
        return a.max(initial=0.0, keepdims=True).reshape(1, 1)   # (1, 1)
    if group == "row":
        return a.max(axis=1, initial=0.0, keepdims=True)         # (n, 1)
    kind, b = group
    if k % b or (kind == "block" and n % b):
        raise ValueError(f"a {n} x {k} operand does not split into {kind}s of {b}")
    if kind == "tile":
        return a.reshape(n, k // b, b).max(axis=2, initial=0.0)  # (n, K/b)
    return a.reshape(n // b, b, k // b, b).max(axis=(1, 3), initial=0.0)   # (n/b, K/b)


def expand(scales, group, shape):
    """Per-group scales (as ``group_amax`` shapes them) broadcast to every
    element of an operand of ``shape`` (n, K)."""
    if group in ("tensor", "row"):
        return scales
    kind, b = group
    s = np.repeat(scales, b, axis=1)                             # (., K)
    return np.repeat(s, b, axis=0) if kind == "block" else s     # (n, K)


# --- 2. scales -------------------------------------------------------------

def current_scale(amax, fmt: Fp8Format, power_of_2: bool = False):
    """The multiplier into the format's range, fmt_max / amax, computed in
    float64 and rounded once to float32 (torchao ``amax_to_scale``;
    DeepSeek-V3 stores its reciprocal); an all-zero group divides by
    ``AMAX_FLOOR``. ``power_of_2`` rounds it down to 2^floor(log2 s), so
    the scaling multiply is exact (torchao's rowwise option)."""
    s = (fmt.max / np.maximum(np.asarray(amax, dtype=np.float64), AMAX_FLOOR)).astype(np.float32)
    if power_of_2:
        s = np.exp2(np.floor(np.log2(s))).astype(np.float32)
    return s


def mx_scale(amax, fmt: Fp8Format = E4M3):
    """OCP MX v1.0's shared scale of each block as E8M0:
    X = 2^(floor(log2 amax) - emax_elem), the exponent clamped to the
    E8M0 range [-127, 127]; a block whose amax is NaN or inf gets the NaN
    scale (0xFF), a zero block the smallest scale 2^-127 (its elements
    are zeros whatever X is). floor(log2) is read off the float32
    exponent field, as the spec's hardware does (subnormal amax -> -127)."""
    a = np.asarray(amax, dtype=np.float32)
    exp_field = (a.view(np.uint32) >> 23) & 0xFF                 # biased float32 exponent
    unbiased = exp_field.astype(np.int32) - 127 - fmt.emax
    biased = np.clip(unbiased, -E8M0_BIAS, E8M0_BIAS) + E8M0_BIAS
    biased = np.where(np.isfinite(a), biased, 0xFF).astype(np.uint8)
    return biased.view(ml_dtypes().float8_e8m0fnu)


def mx_scale_value(scale_e8m0):
    """The E8M0 scales as float64 powers of two (NaN for 0xFF)."""
    return scale_e8m0.astype(np.float64)


# --- 3. quantize and dequantize -----------------------------------------------

def saturate_cast(scaled, fmt: Fp8Format):
    """float32 values -> fmt, rounded to nearest-even after clamping to
    +-fmt.max (finite overflow saturates, as every recipe here casts;
    NaN stays NaN, inf becomes +-max)."""
    return np.clip(scaled, -fmt.max, fmt.max).astype(fmt.dtype)


def quantize(x, scale, group, fmt: Fp8Format):
    """x (n, K) -> its FP8 bytes (n, K) of ``fmt``: float32(x) times the
    float32 scale of its group (``current_scale``), saturated and rounded."""
    x32 = x.astype(np.float32, copy=False)                       # (n, K)
    scaled = x32 * expand(scale, group, x.shape)                 # (n, K) float32: one rounding
    return saturate_cast(scaled, fmt)


def dequantize(q, scale, group, dtype):
    """q / scale in ``dtype`` (n, K): exact in float64."""
    return q.astype(dtype) / expand(scale, group, q.shape).astype(dtype)


def mx_quantize(x, scale_e8m0, block: int, fmt: Fp8Format = E4M3):
    """x (n, K) -> FP8 elements (n, K): x / X in float32 (exact: X is a
    power of two, unless the quotient is subnormal, where it rounds once),
    clamped to fmt's largest normal and rounded to nearest-even (OCP MX
    v1.0 6.3); a NaN scale makes its whole block NaN."""
    x32 = x.astype(np.float32, copy=False)                       # (n, K)
    big_x = expand(mx_scale_value(scale_e8m0), ("tile", block), x.shape)   # (n, K) float64
    with np.errstate(invalid="ignore"):
        p = (x32.astype(np.float64) / big_x).astype(np.float32)   # exact quotient, one rounding to float32
    p = np.where(np.isnan(big_x), np.float32(np.nan), p)
    return saturate_cast(p, fmt)


def mx_dequantize(q, scale_e8m0, block: int, dtype):
    """q * X in ``dtype`` (n, K)."""
    return q.astype(dtype) * expand(mx_scale_value(scale_e8m0), ("tile", block), q.shape).astype(dtype)


def fp8_bytes(q):
    """The raw bytes of an FP8 or E8M0 array as uint8 (what traces record)."""
    return q.view(np.uint8)
