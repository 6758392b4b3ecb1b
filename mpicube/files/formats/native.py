"""mpicube's own checkpoints (``mpicube.files.checkpoint``) seen as a ModelFile:
the ``model/`` group, the model configuration from the ``config``
attribute. Blocks are read by ``Checkpoint.read``, which already takes
only the hyperslabs a rank needs."""

from __future__ import annotations

import numpy as np

from .. import checkpoint
from ..checkpoint.header import model_config
from ...core.config import ModelConfig
from .base import FormatError, ModelFile


class NativeModel(ModelFile):
    kind = "mpicube"

    def __init__(self, ck: "checkpoint.Checkpoint"):
        self.ck = ck
        try:
            cfg = model_config(ck.attrs.get("config"), ck.file)       # CheckpointError if it is no model
        except checkpoint.CheckpointError:
            ck.close()
            raise
        super().__init__(ck.path, ModelConfig.from_dict(cfg))
        self.step = ck.step
        self.attrs = ck.attrs
        try:
            self._check_tensors(cfg)
        except (FormatError, checkpoint.CheckpointError):
            ck.close()
            raise

    def _check_tensors(self, cfg: dict) -> None:
        """Every parameter present, shaped like the ``config`` attribute says."""
        names = set(self.ck.names())
        described = ", ".join(f"{k} {v}" for k, v in cfg.items())
        for name, want in self.shapes.items():
            if "model/" + name not in names:
                raise FormatError(f"{self.ck.path}: has no tensor 'model/{name}' (this parameter)")
            have = tuple(self.ck.shape("model/" + name))
            if have != tuple(want):
                raise FormatError(f"{self.ck.path}: tensor 'model/{name}' has shape {have} but this model needs "
                                  f"{tuple(want)} (checkpoint model {described})")

    def dtype(self, name: str) -> np.dtype:
        return self.ck.dtype("model/" + name)

    def read(self, name: str, index=None, dtype=None) -> np.ndarray:
        return self.ck.read("model/" + name, index=index, dtype=dtype)

    def describe(self) -> str:
        return f"mpicube checkpoint {self.ck.path} (step {self.step})"

    def close(self) -> None:
        self.ck.close()
