"""The FP8 recipes as data: for each of a linear's three GEMMs, how each
operand is quantized (its scaling group and format), and a local
``quantize_operand`` that applies one of them to a 2-D operand whose last
axis is that GEMM's contraction (``ops/fp8.py`` holds the arithmetic).

For y = x W with x (n, K_in), W (K_in, K_out), dy (n, K_out):

=========  ==================  =============================  ==============================
GEMM       contraction         operand 1 (as quantized)       operand 2 (as quantized)
=========  ==================  =============================  ==============================
forward    K_in                x (n, K_in)                    W^T (K_out, K_in)
dgrad      K_out               dy (n, K_out)                  W (K_in, K_out)
wgrad      n (tokens)          x^T (K_in, n)                  dy^T (K_out, n)
=========  ==================  =============================  ==============================

A recipe's scaling group for each (``group_amax``): "tensor" (tensorwise,
delayed), "row" (rowwise: one scale per row along the contraction),
("tile", 128) / ("block", 128) (DeepSeek-V3: activations and gradients in
1 x 128 tiles along the contraction, weights in 128 x 128 blocks, which
read the same in either orientation), ("mx", 32) (MXFP8: 32 along the
contraction, E8M0 scale).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..device.arrays import array_module
from .fp8 import (E4M3, FORMATS, Fp8Format, current_scale, dequantize, fp8_bytes, group_amax, mx_dequantize,
                  mx_quantize, mx_scale, quantize)

RECIPES = ("tensorwise", "delayed", "rowwise", "blockwise", "mxfp8")
ROLES = ("x", "w", "dy")                 # the three tensors a linear quantizes
GEMMS = ("forward", "dgrad", "wgrad")
DEEPSEEK_BLOCK = 128                     # DeepSeek-V3's tile length and weight block side
MX_BLOCK = 32                            # OCP MX v1.0's block size


@dataclass(frozen=True)
class Recipe:
    """One resolved FP8 recipe: its name, the format of gradients
    (``grad_format``), the block length (``block``: DeepSeek's 128, MX's
    32, smaller only to test small models), power-of-two scales
    (``power_of_2``, rowwise), the amax history of ``delayed``
    (``history`` steps, ``history_rule`` "max" or "recent") and the
    accumulation format of the emulated GEMMs (``accumulate``)."""

    name: str
    grad_format: str = "e5m2"
    block: int = 0
    power_of_2: bool = False
    history: int = 16
    history_rule: str = "max"
    accumulate: str = "float32"

    def group(self, role: str, gemm: str):
        """The scaling group of operand ``role`` in ``gemm``, its
        contraction along the last axis of the 2-D operand as the table in
        this module's docstring orients it."""
        if self.name in ("tensorwise", "delayed"):
            return "tensor"
        if self.name == "rowwise":
            return "row"
        if self.name == "blockwise":
            return ("block", self.block) if role == "w" else ("tile", self.block)
        return ("mx", self.block)

    def format(self, role: str):
        """e4m3 for x and W; ``grad_format`` for dy."""
        return FORMATS[self.grad_format] if role == "dy" else E4M3

    @property
    def mx(self) -> bool:
        return self.name == "mxfp8"


def default_grad_format(name: str) -> str:
    """e5m2 for the tensor-scaled recipes (torchao's and Transformer
    Engine's default), e4m3 for rowwise (torchao's recipe), DeepSeek-V3's
    ("e4m3 throughout") and MXFP8."""
    return "e5m2" if name in ("tensorwise", "delayed") else "e4m3"


def default_block(name: str) -> int:
    return {"blockwise": DEEPSEEK_BLOCK, "mxfp8": MX_BLOCK}.get(name, 0)


def local_group(group):
    """``group_amax``'s form of a recipe group (MX tiles are tiles)."""
    if isinstance(group, tuple) and group[0] == "mx":
        return ("tile", group[1])
    return group


@dataclass
class Quantized:
    """One quantized operand: its FP8 elements ``q`` (n, K), its scales
    (float32 multipliers, or E8M0 for MX), the group they scale and the
    elements' format. On a GPU ``q`` holds the FP8 values in float32 and
    MX scales are their bytes (``ops/fp8.py``): ``host_bytes`` and
    ``host_scale`` are what a trace records, the same from either."""

    q: np.ndarray
    scale: np.ndarray
    group: object
    fmt: Fp8Format = E4M3

    def host_bytes(self) -> np.ndarray:
        """The elements' FP8 bytes (n, K) uint8, on the host."""
        return fp8_bytes(self.q, self.fmt)

    def host_scale(self) -> np.ndarray:
        """The scales on the host: float32 multipliers, or MX's E8M0 bytes as uint8."""
        if isinstance(self.group, tuple) and self.group[0] == "mx":
            return fp8_bytes(self.scale)
        xp = array_module(self.scale)
        return self.scale if xp is np else xp.asnumpy(self.scale)

    def values(self, dtype):
        """The operand the GEMM multiplies, in ``dtype``: q / scale (q * X for MX)."""
        if isinstance(self.group, tuple) and self.group[0] == "mx":
            return mx_dequantize(self.q, self.scale, self.group[1], dtype)
        return dequantize(self.q, self.scale, self.group, dtype)


def scale_from_amax(amax, group, fmt, recipe: Recipe):
    """The scales of a group's amax (after any reduction over ranks)."""
    if isinstance(group, tuple) and group[0] == "mx":
        return mx_scale(amax, fmt)
    return current_scale(amax, fmt, recipe.power_of_2)


def quantize_with(a, amax, group, fmt, recipe: Recipe) -> Quantized:
    """a (n, K) quantized with the scales of ``amax`` (shaped as
    ``group_amax`` gives them for ``local_group(group)``)."""
    scale = scale_from_amax(amax, group, fmt, recipe)
    if isinstance(group, tuple) and group[0] == "mx":
        return Quantized(mx_quantize(a, scale, group[1], fmt), scale, group, fmt)
    return Quantized(quantize(a, scale, group, fmt), scale, group, fmt)


def pad_tiles(a, group):
    """a (n, K) with zero columns up to whole tiles of ``group`` (a short
    last tile: an expert's token rows come in any number; zeros change
    no amax), or a itself."""
    if not isinstance(group, tuple) or group[0] == "block" or a.shape[1] % group[1] == 0:
        return a
    b, xp = group[1], array_module(a)
    pad = xp.zeros((a.shape[0], -a.shape[1] % b), dtype=a.dtype)   # (n, pad)
    return xp.concatenate([a, pad], axis=1)                        # (n, K rounded up to b)


def quantize_operand(a, role: str, gemm: str, recipe: Recipe) -> Quantized:
    """a (n, K), contraction along K, quantized on one rank as the recipe
    says (the serial case: nothing to reduce; the delayed recipe's
    history is the caller's). Its values: ``.values(dtype)[:, :K]``."""
    group = recipe.group(role, gemm)
    a = pad_tiles(a, group)
    amax = group_amax(a, local_group(group))
    return quantize_with(a, amax, group, recipe.format(role), recipe)
