"""Dynamic loss scaling for float16 training.

float16 holds magnitudes from 6e-8 (subnormal) to 65504. The gradients of
activations in a language model are far smaller than the loss (the loss is
a mean over every token of the batch), so in float16 many would round to
zero. The backward pass therefore starts from ``scale`` times the loss
gradient, and the float32 parameter gradients are divided by ``scale``
before clipping and the optimizer step.

Too large a scale overflows instead: some gradient becomes inf or NaN. Then
the step is skipped on every rank (no update; the ranks agree first, so no
replica steps alone) and the scale is multiplied by ``backoff``. After
``growth_interval`` consecutive good steps it is multiplied by ``growth``,
so it settles just under the largest scale that does not overflow. The
defaults are the usual ones (PyTorch's GradScaler uses the same).

bfloat16 has float32's exponent range and needs none of this.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass

from ..core.errors import ConfigError

DEFAULT_SCALE = 2.0 ** 16
DEFAULT_GROWTH_INTERVAL = 2000
DEFAULT_BACKOFF = 0.5
GROWTH = 2.0


@dataclass
class LossScaler:
    """The scale and its counters: all of it goes into checkpoints, so a
    resumed run scales, skips and grows exactly as the uninterrupted one."""

    scale: float = DEFAULT_SCALE
    growth_interval: int = DEFAULT_GROWTH_INTERVAL
    backoff: float = DEFAULT_BACKOFF
    good_steps: int = 0          # finite steps since the scale last changed
    skipped: int = 0             # steps skipped for overflow, over the whole run

    def __post_init__(self):
        if not (math.isfinite(self.scale) and self.scale > 0):
            raise ConfigError(f"--loss-scale must be a positive number, got {self.scale}")
        if self.growth_interval < 1:
            raise ConfigError(f"--loss-scale-growth-interval must be at least 1, got {self.growth_interval}")
        if not 0.0 < self.backoff < 1.0:
            raise ConfigError(f"--loss-scale-backoff must be between 0 and 1 (exclusive), got {self.backoff}")

    def update(self, finite: bool) -> None:
        """After a step: back off on overflow, grow after enough good steps."""
        if not finite:
            self.scale *= self.backoff
            self.good_steps = 0
            self.skipped += 1
            return
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale *= GROWTH
            self.good_steps = 0

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    def restore(self, text) -> None:
        """Take the scale and counters of a checkpoint's ``loss_scale``
        attribute (the growth interval and backoff stay this run's options)."""
        saved = json.loads(text) if isinstance(text, (str, bytes)) else dict(text)
        self.scale = float(saved["scale"])
        self.good_steps = int(saved["good_steps"])
        self.skipped = int(saved["skipped"])


def scaler_for(dtype: str, scale, growth_interval, backoff):
    """The LossScaler of a run, or None. float16 always scales (defaults for
    options not given); any other format refuses the options, since they
    would do nothing there."""
    given = [name for name, value in (("--loss-scale", scale),
                                      ("--loss-scale-growth-interval", growth_interval),
                                      ("--loss-scale-backoff", backoff)) if value is not None]
    if dtype != "float16":
        if given:
            raise ConfigError(f"{', '.join(given)}: loss scaling applies to --dtype float16 only, "
                              f"not --dtype {dtype}")
        return None
    return LossScaler(scale=DEFAULT_SCALE if scale is None else float(scale),
                      growth_interval=DEFAULT_GROWTH_INTERVAL if growth_interval is None else int(growth_interval),
                      backoff=DEFAULT_BACKOFF if backoff is None else float(backoff))
