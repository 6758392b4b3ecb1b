"""YaRN rotary scaling (Peng et al. 2023, "YaRN: Efficient Context Window
Extension of Large Language Models"), as DeepSeek-V3's released config
uses it (rope type "yarn", factor 40 over an original context of 4096):
the inverse frequencies and the two attention-scale corrections, computed
on the host in float64 beside Llama 3's scaling (``ops.llama.rope_inv_freq``).

* Frequencies. Frequency m of a head of dr rotary columns turns
  L / (2 pi) f_m times over the original context L. Those that turn more
  than ``beta_fast`` times are kept (extrapolated), those that turn fewer
  than ``beta_slow`` times are divided by ``factor`` (interpolated), and
  between the two the blend is linear in m: with d(r) = dr ln(L / (2 pi r))
  / (2 ln theta) the index that turns r times, low = floor(d(beta_fast)),
  high = ceil(d(beta_slow)) (``truncate``; unrounded otherwise), clamped to
  [0, dr - 1], ramp(m) = clip((m - low) / (high - low), 0, 1) and
  f'_m = f_m / factor * ramp(m) + f_m * (1 - ramp(m)).
* The rotary tables' factor (``attention_factor``): cos and sin are both
  multiplied by it, so the rotary part of every score q.k grows by its
  square. Given explicitly, or mscale(factor, mscale) / mscale(factor,
  mscale_all_dim) when both are set, or mscale(factor) otherwise, with
  mscale(s, m) = 0.1 m ln(s) + 1 for s > 1 and 1 for s <= 1.
* The softmax scale's factor (``softmax_factor``): DeepSeek's MLA also
  multiplies its 1/sqrt(dn + dr) by mscale(factor, mscale_all_dim)^2 (the
  non-rotary columns too); 1 when mscale_all_dim is unset. DeepSeek-V3's
  mscale = mscale_all_dim = 1 leaves the tables unscaled and multiplies
  the softmax scale by (0.1 ln 40 + 1)^2 ~ 1.87.

These are Hugging Face's ``rope_type`` "yarn" semantics (field names
included); ``files.formats.hf_deepseek_config`` reads them. The settings
and the two scalar factors are a value of the configuration
(``core.rope_scaling.YarnScaling``: checkpoints store it); the tables
are computed here.
"""

from __future__ import annotations

import math

import numpy as np

from ..core.rope_scaling import YarnScaling, mscale  # noqa: F401 (the settings' value lives in core: config stores it)


def correction_dim(rotations: float, dim: int, theta: float, context: int) -> float:
    """The (fractional) frequency index m whose frequency turns ``rotations``
    times over ``context`` positions: dim ln(context / (2 pi r)) / (2 ln theta)."""
    return dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(theta))


def yarn_inv_freq(head_dim: int, theta: float, y: YarnScaling):
    """(hd/2,) float64 inverse frequencies of YaRN (the module docstring's rule)."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)    # (hd/2,) unscaled
    L = y.original_max_position_embeddings
    low = correction_dim(y.beta_fast, head_dim, theta, L)
    high = correction_dim(y.beta_slow, head_dim, theta, L)
    if y.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001                       # a step, not a division by zero (HF's choice, kept for equality)
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)   # (hd/2,) 1: slow
    return inv_freq / y.factor * ramp + inv_freq * (1.0 - ramp)
