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

On a GPU the same functions run on CuPy arrays, which have no FP8 type:
there ``q`` holds the FP8 values in float32 (every FP8 value is a float32
one), rounded by ``round_to_format``'s bit arithmetic, which a test holds
equal to ml_dtypes' cast on every tie and edge of both formats; E8M0
scales are their uint8 bytes. ``fp8_bytes`` gives the same bytes from either.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..device.arrays import array_module

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
    value (the saturation bound), the exponent of that value's leading
    power of two (``emax``, the MX scale rule's subtrahend), its stored
    significand bits and its smallest normal exponent (``round_to_format``)."""

    name: str
    type_name: str          # ml_dtypes' name of the type
    max: float
    emax: int
    mantissa_bits: int
    emin: int               # 2^emin: the smallest normal value; subnormals are multiples of 2^(emin - mantissa_bits)

    @property
    def dtype(self) -> type:
        return getattr(ml_dtypes(), self.type_name)


E4M3 = Fp8Format("e4m3", "float8_e4m3fn", 448.0, 8, 3, -6)       # no inf; 0x7f/0xff NaN
E5M2 = Fp8Format("e5m2", "float8_e5m2", 57344.0, 15, 2, -14)     # IEEE-like, with inf
FORMATS = {"e4m3": E4M3, "e5m2": E5M2}


class NonFiniteError(ValueError):
    """NaN or inf reached a quantizer: the message names the tensor."""


def require_finite(x, what: str) -> None:
    """NonFiniteError naming ``what`` unless every element of x is finite
    (on a GPU: one scalar comes back to the host per operand)."""
    xp = array_module(x)
    if not bool(xp.isfinite(x).all()):
        bad = "NaN" if bool(xp.isnan(x).any()) else "inf"
        raise NonFiniteError(f"{bad} reached the FP8 quantizer of {what}")


# --- 1. amax per scaling group --------------------------------------------

def group_amax(x, group):
    """max |x| of each scaling group of x (n, K), contraction along K.
    ``group``: "tensor" -> (1, 1); "row" -> (n, 1); ("tile", b) -> (n, K/b),
    1 x b tiles along each row; ("block", b) -> (n/b, K/b), b x b blocks.
    A tile or block never straddles the array's edge: K (and n for blocks)
    must be multiples of b (the layouts check their shards first)."""
    xp = array_module(x)
    a = xp.abs(x.astype(xp.float32, copy=False))                 # (n, K)
    n, k = a.shape
    if group == "tensor":
        return _max(a.reshape(1, n * k), 1)                      # (1, 1)
    if group == "row":
        return _max(a, 1)                                        # (n, 1)
    kind, b = group
    if k % b or (kind == "block" and n % b):
        raise ValueError(f"a {n} x {k} operand does not split into {kind}s of {b}")
    if kind == "tile":
        return _max(a.reshape(n, k // b, b), 2)[:, :, 0]         # (n, K/b)
    return _max(_max(a.reshape(n // b, b, k // b, b), 3), 1)[:, 0, :, 0]   # (n/b, K/b)


def _max(a, axis: int):
    """max of ``a`` along ``axis``, kept as a length-1 axis; 0 where the
    axis is empty (an expert that got no tokens; CuPy's max has no
    ``initial``)."""
    xp = array_module(a)
    if a.shape[axis] == 0:
        return xp.zeros(a.shape[:axis] + (1,) + a.shape[axis + 1:], dtype=a.dtype)
    return a.max(axis=axis, keepdims=True)


def expand(scales, group, shape):
    """Per-group scales (as ``group_amax`` shapes them) broadcast to every
    element of an operand of ``shape`` (n, K)."""
    if group in ("tensor", "row"):
        return scales
    xp = array_module(scales)
    kind, b = group
    s = xp.repeat(scales, b, axis=1)                             # (., K)
    return xp.repeat(s, b, axis=0) if kind == "block" else s     # (n, K)


# --- 2. scales -------------------------------------------------------------

def _array(a):
    """``a`` if it is an array (NumPy's or CuPy's), else a NumPy one (a Python number)."""
    return a if hasattr(a, "astype") else np.asarray(a)


def current_scale(amax, fmt: Fp8Format, power_of_2: bool = False):
    """The multiplier into the format's range, fmt_max / amax, computed in
    float64 and rounded once to float32 (torchao ``amax_to_scale``;
    DeepSeek-V3 stores its reciprocal); an all-zero group divides by
    ``AMAX_FLOOR``. ``power_of_2`` rounds it down to 2^floor(log2 s), so
    the scaling multiply is exact (torchao's rowwise option)."""
    amax = _array(amax)
    xp = array_module(amax)
    s = (fmt.max / xp.maximum(amax.astype(xp.float64), AMAX_FLOOR)).astype(xp.float32)
    if power_of_2:
        s = xp.exp2(xp.floor(xp.log2(s))).astype(xp.float32)
    return s


def mx_scale(amax, fmt: Fp8Format = E4M3):
    """OCP MX v1.0's shared scale of each block as E8M0:
    X = 2^(floor(log2 amax) - emax_elem), the exponent clamped to the
    E8M0 range [-127, 127]; a block whose amax is NaN or inf gets the NaN
    scale (0xFF), a zero block the smallest scale 2^-127 (its elements
    are zeros whatever X is). floor(log2) is read off the float32
    exponent field, as the spec's hardware does (subnormal amax -> -127)."""
    amax = _array(amax)
    xp = array_module(amax)
    a = amax.astype(xp.float32)
    exp_field = (a.view(xp.uint32) >> 23) & 0xFF                 # biased float32 exponent
    unbiased = exp_field.astype(xp.int32) - 127 - fmt.emax
    biased = xp.clip(unbiased, -E8M0_BIAS, E8M0_BIAS) + E8M0_BIAS
    biased = xp.where(xp.isfinite(a), biased, 0xFF).astype(xp.uint8)
    return biased.view(ml_dtypes().float8_e8m0fnu) if xp is np else biased   # CuPy: the bytes


def mx_scale_value(scale_e8m0):
    """The E8M0 scales as float64 powers of two (NaN for 0xFF), from their
    bytes: 2^(byte - 127)."""
    xp = array_module(scale_e8m0)
    biased = scale_e8m0.view(xp.uint8).astype(xp.int32)
    value = xp.ldexp(xp.ones(biased.shape, dtype=xp.float64), biased - E8M0_BIAS)
    return xp.where(biased == 0xFF, xp.nan, value)


# --- 3. quantize and dequantize -----------------------------------------------

def saturate_cast(scaled, fmt: Fp8Format):
    """float32 values -> fmt, rounded to nearest-even after clamping to
    +-fmt.max (finite overflow saturates, as every recipe here casts;
    NaN stays NaN, inf becomes +-max): ml_dtypes' cast on the host, the
    same values in float32 on a GPU (``round_to_format``)."""
    xp = array_module(scaled)
    clamped = xp.clip(scaled, -fmt.max, fmt.max)
    return clamped.astype(fmt.dtype) if xp is np else round_to_format(clamped, fmt)


def round_to_format(v, fmt: Fp8Format):
    """float32 v with |v| <= fmt.max (or NaN) -> the nearest value of
    ``fmt``, ties to even, as float32. A value in [2^e, 2^(e+1)) sits on a
    grid of step 2^(e - mantissa_bits), and below the smallest normal
    2^emin on the subnormals' fixed step 2^(emin - mantissa_bits); scaling
    by the step is exact (a power of two), so ``rint`` (ties to even)
    does the one rounding. A value rounding up to the next power of two
    lands on that grid's first point, which is in the format too."""
    xp = array_module(v)
    _, exponent = xp.frexp(v)                                    # v = m 2^exponent, 1/2 <= |m| < 1
    step = xp.maximum(exponent - 1, fmt.emin) - fmt.mantissa_bits   # log2 of the grid step at |v|
    return xp.ldexp(xp.rint(xp.ldexp(v, -step)), step).astype(xp.float32)


def quantize(x, scale, group, fmt: Fp8Format):
    """x (n, K) -> its FP8 bytes (n, K) of ``fmt``: float32(x) times the
    float32 scale of its group (``current_scale``), saturated and rounded."""
    x32 = x.astype(array_module(x).float32, copy=False)          # (n, K)
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
    xp = array_module(x)
    x32 = x.astype(xp.float32, copy=False)                       # (n, K)
    big_x = expand(mx_scale_value(scale_e8m0), ("tile", block), x.shape)   # (n, K) float64
    with np.errstate(invalid="ignore"):
        p = (x32.astype(xp.float64) / big_x).astype(xp.float32)   # exact quotient, one rounding to float32
    p = xp.where(xp.isnan(big_x), xp.float32(xp.nan), p)
    return saturate_cast(p, fmt)


def mx_dequantize(q, scale_e8m0, block: int, dtype):
    """q * X in ``dtype`` (n, K)."""
    return q.astype(dtype) * expand(mx_scale_value(scale_e8m0), ("tile", block), q.shape).astype(dtype)


def fp8_bytes(q, fmt: Fp8Format = None):
    """The raw bytes of an FP8 or E8M0 array as a host uint8 array (what
    traces record). A GPU's FP8 values are float32 (``saturate_cast``):
    they come to the host and are cast there exactly, into ``fmt``; its
    E8M0 scales are bytes already."""
    xp = array_module(q)
    if xp is not np:
        q = xp.asnumpy(q)
        if q.dtype != np.uint8:
            q = q.astype(fmt.dtype)
    return q.view(np.uint8)
