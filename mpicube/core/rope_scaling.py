"""The rotary scalings a model's configuration may hold
(``ModelConfig.rope_scaling``), as values in Hugging Face's field names:
Llama 3's (``RopeScaling``, rope type "llama3") and YaRN's
(``YarnScaling``, rope type "yarn": DeepSeek-V3's), and which family
stores which (``scaling_from_dict``).

Why here and not beside the frequencies (``ops.llama``, ``ops.yarn``): a
configuration is read, checked and stored by ``core.config`` (a
checkpoint's ``config`` attribute holds it), and core may import nothing
above it. So the values - their fields, their checks, how they are
written, and the scalar factors that follow from them by a formula -
live on the ground floor, and ops computes the frequency tables from them.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3's rotary frequency scaling (Hugging Face's ``rope_type``
    "llama3"): wavelengths longer than ``original_max_position_embeddings``
    / ``low_freq_factor`` are stretched ``factor`` times, those shorter than
    it / ``high_freq_factor`` are kept, and the band between is blended
    smoothly (``ops.llama.rope_inv_freq``). Held as a value so that a
    configuration stays hashable and prints by name."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")

    @classmethod
    def from_dict(cls, d, where: str = "rope_scaling") -> "RopeScaling":
        """The scaling of a JSON object holding the four KEYS (and perhaps
        rope_type "llama3", rope_theta), or a ValueError naming the field
        ``where.key`` that is missing or out of range."""
        if not isinstance(d, dict):
            raise ValueError(f"{where} must be a JSON object, got {d!r}")
        values = {}
        for key in cls.KEYS:
            value = d.get(key)
            kind = int if key == "original_max_position_embeddings" else (int, float)
            if isinstance(value, bool) or not isinstance(value, kind) or not (math.isfinite(value) and value > 0):
                what = "a positive integer" if kind is int else "a positive number"
                raise ValueError(f"{where}.{key} must be {what}, got {value!r}")
            values[key] = value if kind is int else float(value)
        if values["factor"] < 1:
            raise ValueError(f"{where}.factor must be at least 1 (it stretches wavelengths), got {values['factor']!r}")
        if not values["low_freq_factor"] < values["high_freq_factor"]:
            raise ValueError(f"{where}.low_freq_factor {values['low_freq_factor']!r} must be less than "
                             f"high_freq_factor {values['high_freq_factor']!r}")
        return cls(**values)

    def to_dict(self) -> dict:
        """As Hugging Face writes it (``rope_type`` first)."""
        return {"rope_type": "llama3", **{k: getattr(self, k) for k in self.KEYS}}

    def as_tuple(self) -> tuple:
        """(factor, low_freq_factor, high_freq_factor, original_max_position_embeddings), for ``ops``."""
        return tuple(getattr(self, k) for k in self.KEYS)


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


# each family's rotary scaling: (its rope_type, the value class); a stored config's rope_scaling is one of these
SCALINGS = {"llama": ("llama3", RopeScaling), "deepseek_v3": ("yarn", YarnScaling)}


def scaling_from_dict(arch: str, d) -> object:
    """A stored configuration's rope_scaling: Llama 3's (``RopeScaling``) for
    a Llama, YaRN's (``YarnScaling``) for a deepseek_v3 model; a ValueError
    names the field (a rope_type of the other family's included)."""
    kind, cls = SCALINGS[arch]
    if isinstance(d, dict) and d.get("rope_type", kind) != kind:
        raise ValueError(f"rope_scaling.rope_type must be {kind!r} for an {arch} model, got {d.get('rope_type')!r}")
    if cls is YarnScaling and isinstance(d, dict):
        d = {k: v for k, v in d.items() if k != "rope_type"}
        unknown = sorted(set(d) - set(YarnScaling.REQUIRED + YarnScaling.NUMBERS + ("truncate",)))
        if unknown:
            raise ValueError(f"rope_scaling.{unknown[0]} is not a YaRN field")
    return cls.from_dict(d, "rope_scaling")
