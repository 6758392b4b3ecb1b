"""mpicube's own checkpoints (``mpicube.files.checkpoint``) seen as a ModelFile:
the ``model/`` group, the model configuration from the ``config``
attribute. Blocks are read by ``Checkpoint.read``, which already takes
only the hyperslabs a rank needs."""

from __future__ import annotations

import numpy as np

from .. import checkpoint
from ...core import memory
from ..checkpoint.header import model_config
from ...core.config import ModelConfig
from .base import FormatError, ModelFile, first_missing


class NativeModel(ModelFile):
    kind = "mpicube"

    def __init__(self, ck: "checkpoint.Checkpoint"):
        self.ck = ck
        try:
            cfg = model_config(ck.attrs.get("config"), ck.file)       # CheckpointError if it is no model
            config = ModelConfig.from_dict(cfg)
            self._check_described(config)
            super().__init__(ck.path, config)
            self._check_tensors(cfg)
        except (FormatError, checkpoint.CheckpointError):   # ValueErrors too: caught first
            ck.close()
            raise
        except (TypeError, ValueError) as e:
            ck.close()
            raise FormatError(f"{ck.file}: attribute 'config' does not describe a model: {e}") from None
        self.step = ck.step
        self.attrs = ck.attrs

    def _check_described(self, config: ModelConfig) -> None:
        """Before the model's tensor list is built: the first parameter the
        ``config`` attribute implies and the checkpoint lacks, found by
        walking the names one at a time (a config claiming 2**31 layers over
        a checkpoint of two stops at layer 2)."""
        names = set(self.ck.names())
        missing = first_missing(config, lambda name: "model/" + name in names)
        if missing is not None:
            held = sum(1 for n in names if n.startswith("model/"))
            raise FormatError(f"{self.ck.path}: has no tensor 'model/{missing}' (this parameter): its 'config' "
                              f"attribute describes n_layer {memory.format_count(config.n_layer)}, "
                              f"{memory.format_count(memory.tensor_count(config.n_layer))} tensors of "
                              f"{memory.format_count(config.n_params())} parameters, and it holds {held:,} "
                              "model tensors")

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

    def buffer(self, name: str):
        key = "buffers/" + name              # training/state.py writes them so
        if key not in set(self.ck.names()):
            return None
        return self.ck.read(key)

    def describe(self) -> str:
        return f"mpicube checkpoint {self.ck.path} (step {self.step})"

    def close(self) -> None:
        self.ck.close()
