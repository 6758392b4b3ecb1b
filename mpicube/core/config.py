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
        names = {f.name for f in fields(cls)}
        return cls(**{k: int(v) for k, v in d.items() if k in names})

    def n_params(self) -> int:
        """Logical parameter count (tied head counted once)."""
        h, L = self.n_embd, self.n_layer
        per_layer = 2 * 2 * h + (h * 3 * h + 3 * h) + (h * h + h) + (h * 4 * h + 4 * h) + (4 * h * h + h)
        return self.vocab_size * h + self.n_ctx * h + L * per_layer + 2 * h
