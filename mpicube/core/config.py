"""Configuration dataclasses: the model's shape and the training options."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields


@dataclass(frozen=True)
class ModelConfig:
    """GPT-2 hyper-parameters (DESIGN.md section 2)."""

    vocab_size: int = 256
    n_ctx: int = 64
    n_layer: int = 4
    n_head: int = 12
    n_embd: int = 144

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        """The sizes of a stored configuration (a checkpoint's ``config``
        attribute), each an integer of at least 1; a ValueError names the
        first that is not. Nothing is converted: 32.7, "32" or true as a
        width is a damaged file, not 32 or 1."""
        names = [f.name for f in fields(cls)]
        values = {}
        for name in names:
            if name not in d:
                raise ValueError(f"{name} is missing")
            value = d[name]
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
            values[name] = value
        return cls(**values)

    def n_params(self) -> int:
        """Logical parameter count (tied head counted once)."""
        h, L = self.n_embd, self.n_layer
        per_layer = 2 * 2 * h + (h * 3 * h + 3 * h) + (h * h + h) + (h * 4 * h + 4 * h) + (4 * h * h + h)
        return self.vocab_size * h + self.n_ctx * h + L * per_layer + 2 * h
