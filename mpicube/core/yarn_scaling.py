"""YaRN's settings as a value of the model's configuration (``ModelConfig.
rope_scaling`` of a deepseek_v3 model), in Hugging Face's field names.

Why here and not beside the frequencies (``ops.yarn``): a configuration
is read, checked and stored by ``core.config`` (a checkpoint's ``config``
attribute holds it), and core may import nothing above it. So the value -
its fields, their checks, how it is written, and the two scalar factors
that follow from them by a formula - lives on the ground floor, and
``ops.yarn`` computes the frequency tables from it (the same split as
Llama 3's ``core.config.RopeScaling`` and ``ops.llama.rope_inv_freq``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Optional


def mscale(scale: float, m: float = 1.0) -> float:
    """YaRN's attention temperature correction 0.1 m ln(scale) + 1 (1 for scale <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def _shown(value) -> str:
    """A JSON value for a message, cut short."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError, RecursionError):
        text = type(value).__name__
    return text if len(text) <= 80 else text[:77] + "..."


@dataclass(frozen=True)
class YarnScaling:
    """YaRN's settings (``ops.yarn`` has the rule). ``mscale``,
    ``mscale_all_dim`` and ``attention_factor`` None: not set."""
    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: Optional[float] = None
    mscale_all_dim: Optional[float] = None
    attention_factor: Optional[float] = None
    truncate: bool = True

    NUMBERS = ("factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor")
    REQUIRED = ("factor", "original_max_position_embeddings")

    @property
    def table_factor(self) -> float:
        """What cos and sin are multiplied by (HF's ``attention_factor``)."""
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return mscale(self.factor, self.mscale) / mscale(self.factor, self.mscale_all_dim)
        return mscale(self.factor)

    @property
    def softmax_factor(self) -> float:
        """What MLA's softmax scale 1/sqrt(dn + dr) is multiplied by."""
        if not self.mscale_all_dim:
            return 1.0
        m = mscale(self.factor, self.mscale_all_dim)
        return m * m

    @classmethod
    def from_dict(cls, params: dict, field: str = "rope_scaling", shown=_shown) -> "YarnScaling":
        """The settings of a rope object (its YaRN fields; others are the
        caller's to refuse), each checked: finite and positive (factor at
        least 1, beta_fast above beta_slow), original_max_position_embeddings
        a positive integer, truncate true or false; the optional numbers may
        be absent or null. A ValueError names ``field.key`` and its value."""
        if not isinstance(params, dict):
            raise ValueError(f"{field} = {shown(params)} is not a JSON object")
        values = {}
        for key in cls.REQUIRED + cls.NUMBERS[1:]:
            value = params.get(key)
            if value is None and key not in cls.REQUIRED:
                continue
            integer = key == "original_max_position_embeddings"
            kind = int if integer else (int, float)
            if isinstance(value, bool) or not isinstance(value, kind) or not (math.isfinite(value) and value > 0):
                raise ValueError(f"{field}.{key} = {shown(value)} is not a positive "
                                 f"{'integer' if integer else 'number'}")
            values[key] = value if integer else float(value)
        truncate = params.get("truncate", True)
        if not isinstance(truncate, bool):
            raise ValueError(f"{field}.truncate = {shown(truncate)} must be true or false")
        y = cls(**values, truncate=truncate)
        if y.factor < 1:
            raise ValueError(f"{field}.factor = {shown(params['factor'])} is below 1 (YaRN stretches the context)")
        if not y.beta_fast > y.beta_slow:
            raise ValueError(f"{field}.beta_fast = {shown(y.beta_fast)} is not above beta_slow {shown(y.beta_slow)}")
        return y

    def to_dict(self) -> dict:
        """As Hugging Face writes it (``rope_type`` first, unset fields left out)."""
        out = {"rope_type": "yarn", "factor": self.factor,
               "original_max_position_embeddings": self.original_max_position_embeddings,
               "beta_fast": self.beta_fast, "beta_slow": self.beta_slow}
        for key in ("mscale", "mscale_all_dim", "attention_factor"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if not self.truncate:
            out["truncate"] = False
        return out
