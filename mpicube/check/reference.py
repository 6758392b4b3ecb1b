"""A reference trace, read as a framework needs it to take the same steps:
the model config, the optimizer, the initial parameters by name, and per
step the batch, the learning rate and the dropout keep masks.

    ref = Reference("ref.h5")
    model.load(ref.init())                 # {trace name: (in, out) array}
    for s in ref.step_numbers():
        x, y = ref.batch(s)                # (B, T) int64 each
        masks = ref.masks(s)               # {"emb": ..., "h.0.attn": ...} or {}
        lr = ref.lr(s)

Every item read is checked: a missing one is bad input naming the file and
the item (``UserError``, exit 2 where a command reports it), not a
KeyError from deep inside h5py.
"""

from __future__ import annotations

import math

import numpy as np

from ..core.errors import UserError
from .names import forward_param_order, param_shapes
from .tracefile import open_trace, read, read_config, read_json_attr, text


def lr_at(schedule: dict, step: int) -> float:
    """The documented schedule (docs/trace-format.md), step 1-based: linear
    warmup to ``peak`` over ``warmup`` steps, then cosine decay to
    ``min_lr`` at ``steps``, held at ``min_lr`` after."""
    peak, warmup, steps, floor = schedule["peak"], schedule["warmup"], schedule["steps"], schedule["min_lr"]
    if warmup > 0 and step <= warmup:
        return peak * step / warmup
    progress = min(1.0, (step - warmup) / max(1, steps - warmup))
    return floor + 0.5 * (peak - floor) * (1.0 + math.cos(math.pi * progress))


class Reference:
    """An open reference trace (close it, or use ``with``)."""

    def __init__(self, path):
        self.path = path
        self.f = open_trace(path)
        try:
            self.config = read_config(self.f, path)
            self.optimizer = read_json_attr(self.f, path, "optimizer")
            if not isinstance(self.optimizer, dict):
                raise UserError(f"{path}: no 'optimizer' attribute, so the steps cannot be repeated")
            self.dtype = text(self.f.attrs.get("dtype")) or "float32"
            self.dropout = float(self.f.attrs.get("dropout", 0.0))
            self.seed = self.f.attrs.get("seed")
            self.tokens = read(self._item("tokens"), path)                    # (N, B, T+1)
        except BaseException:
            self.f.close()
            raise

    def _item(self, name: str):
        if name not in self.f:
            raise UserError(f"{self.path}: no {name}")
        return self.f[name]

    @property
    def steps(self) -> int:
        return len(self.tokens)

    def step_numbers(self) -> range:
        return range(1, self.steps + 1)

    @property
    def decay(self) -> set:
        """The names that get weight decay."""
        return set(self.optimizer.get("decay", []))

    def init(self) -> dict:
        """{name: array} of the parameters before step 1, declaration order,
        each checked against the config's shape."""
        shapes = param_shapes(self.config)
        out = {}
        for name in forward_param_order(self.config):
            value = read(self._item(f"init/{name}"), self.path)
            if value.shape != shapes[name]:
                raise UserError(f"{self.path}: init/{name} has shape {value.shape}, the config gives {shapes[name]}")
            out[name] = value
        return out

    def batch(self, s: int) -> tuple:
        """(x, y), both (B, T) int64: step s's inputs and targets."""
        if not 1 <= s <= self.steps:
            raise UserError(f"{self.path}: no step {s} (the trace has {self.steps})")
        tokens = self.tokens[s - 1].astype(np.int64)                        # (B, T+1)
        return tokens[:, :-1], tokens[:, 1:]

    def lr(self, s: int) -> float:
        """Step s's learning rate: the recorded value, else the schedule's."""
        sched = self.optimizer.get("lr", {})
        values = sched.get("values") or []
        return float(values[s - 1]) if s <= len(values) else lr_at(sched, s)

    def masks(self, s: int) -> dict:
        """{site: (…) uint8 keep mask} of step s, {} without dropout. Replaying
        them makes both runs drop the same elements; the masks your own
        framework draws per rank are better recorded than replayed (a mask
        bug then shows at the mask, not one tensor later)."""
        if self.dropout == 0.0:
            return {}
        group = self._item(f"step_{s}/dropout")
        return {site: read(group[site], self.path) for site in group}

    @property
    def has_state(self) -> bool:
        """Whether the reference holds the training state (``trace --state``):
        a recorder then records it too (``Recorder.step(optimizer=...)``)."""
        return "step_1/state" in self.f

    def state(self, s: int, name: str):
        """A ``step_s/state/`` scalar of the reference (``rng_offset``,
        ``loss_scale``), None when absent."""
        key = f"step_{s}/state/{name}"
        return read(self.f[key], self.path)[()] if key in self.f else None

    def close(self) -> None:
        self.f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False
