"""The range of every float of a model configuration (one rule wherever
the value comes from), shared by ``config`` and ``deepseek_moe``."""

from __future__ import annotations

import math

# Every float of a model config, one rule for each wherever it comes from (the command line, a Hugging
# Face config.json, a checkpoint's config): finite, and in (low, high), an end included where the flag
# says. json reads 1e400 as inf and Python's float("inf") is a number: a norm's eps of inf makes every
# norm output zero, a coefficient of inf a loss of inf, so each is refused by its name.
FLOAT_RANGES = {                  # field: (low, low included, high, high included)
    "rms_eps": (0.0, False, 1.0, False),
    "rope_theta": (1.0, False, math.inf, False),
    "router_aux_loss_coef": (0.0, True, 1e3, True),
    "router_z_loss_coef": (0.0, True, 1e3, True),
    "routed_scaling_factor": (0.0, False, 1e3, True),
    "bias_update_rate": (0.0, True, 1.0, True),
    "seq_aux_loss_coef": (0.0, True, 1e3, True),
}


def float_problem(field: str, value) -> str | None:
    """Why ``value`` cannot be the model config's float ``field``
    (FLOAT_RANGES), as the end of a sentence naming it ("must be ..., got
    inf"), or None. The one check of the command line's options, Hugging
    Face's fields and a checkpoint's config."""
    low, low_in, high, high_in = FLOAT_RANGES[field]
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) and (
        (value >= low if low_in else value > low) and (value <= high if high_in else value < high))
    if ok:
        return None
    span = f"{'[' if low_in else '('}{low:g}, {high:g}{']' if high_in else ')'}"
    if isinstance(value, float) and not math.isfinite(value):
        shown = repr(value)
    else:
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
    return f"must be a finite number in {span}, got {shown}"
