"""What every model file looks like to the rest of mpicube.

A ``ModelFile`` is a model opened for reading, whatever wrote it: its
``ModelConfig`` and every parameter as a full logical tensor under its
GPT-2 name, in mpicube's orientation (weights (in, out), the real
vocabulary). ``read`` takes per-dimension global index arrays, so a rank
reads only its block: indices past a dimension are vocabulary padding and
read as zeros, as in ``mpicube.files.checkpoint``. How a block is fetched is the
format's business (``read_box``); cutting an arbitrary block into the few
contiguous boxes a file can serve is shared here.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import numpy as np

from ...core import memory
from ...core.config import ModelConfig
from ...core.errors import ConfigError, UserError

MAX_BOXES = 64          # contiguous reads per block before falling back to bounding boxes


class FormatError(UserError, ValueError):
    """A model file that cannot be read or a model mpicube cannot represent;
    the message names the file and what is wrong with it."""


def gpt2_shapes(cfg: ModelConfig) -> dict:
    """{GPT-2 name: shape} of every parameter, in mpicube's order."""
    from ...model.gpt import gpt_params

    return {decl.name: tuple(decl.shape) for decl in gpt_params(cfg)}


def first_missing(cfg: ModelConfig, have) -> str | None:
    """The first parameter name of the model ``cfg`` for which ``have(name)``
    is false, or None. The names are walked one at a time, so a header
    claiming 2**31 layers over a file of two costs as many steps as the
    file has tensors: run it before anything as long as the claim is built."""
    from ...model.gpt import param_names

    for name in param_names(cfg):
        if not have(name):
            return name
    return None


class ModelFile:
    """Base class: subclasses set ``kind``, ``path``, ``config`` and
    implement ``read_box``, ``dtype`` and ``close``."""

    kind = "?"
    step = 0
    attrs: dict = {}           # mpicube's root attributes; foreign files have none

    def __init__(self, path, config: ModelConfig):
        self.path = Path(path)
        self.config = config
        try:
            self.shapes = gpt2_shapes(config)
        except ConfigError as e:                 # its tensor list alone does not fit in memory
            raise FormatError(f"{self.path}: {e}") from None

    # --- what a format provides -------------------------------------------
    def read_box(self, name: str, box: tuple) -> np.ndarray:
        """The block ``box`` (a tuple of slices, mpicube orientation) of ``name``."""
        raise NotImplementedError

    def dtype(self, name: str) -> np.dtype:
        raise NotImplementedError

    def buffer(self, name: str):
        """The model's persistent tensor ``name`` that is not a parameter
        (a router's bias, ``ParamStore.persist``) whole, or None where the
        file holds none (the model keeps its initial value)."""
        return None

    def read_buffers(self) -> dict:
        """{name: whole tensor} of the configuration's buffers the file holds
        (``core.deepseek_moe.bias_names``: the sigmoid routers' biases)."""
        from ...core.deepseek_moe import bias_names

        held = {name: self.buffer(name) for name in bias_names(self.config)}
        return {name: value for name, value in held.items() if value is not None}

    def close(self) -> None:
        pass

    def describe(self) -> str:
        """One line saying what the file is (for notes and inspect)."""
        return f"{self.kind} model {self.path}"

    # --- shared -------------------------------------------------------------
    def names(self) -> list:
        return list(self.shapes)

    def shape(self, name: str) -> tuple:
        return self.shapes[name]

    def read(self, name: str, index=None, dtype=None) -> np.ndarray:
        """The whole tensor, or the block at per-dimension global indices
        (any order; values past the shape are padding and read as 0)."""
        shape = self.shapes[name]
        if index is None:
            index = tuple(np.arange(n) for n in shape)
        out = read_block(lambda box: self.read_box(name, box), shape, index, dtype or self.dtype(name))
        return out

    def read_all(self, dtype=None) -> dict:
        """{name: whole tensor} of every parameter."""
        return {name: self.read(name, dtype=dtype) for name in self.names()}

    def require_memory(self, whole: bool) -> None:
        """Refuse in one line, before reading, a model this process cannot
        hold: ``whole``, every tensor at once (``convert``); else the largest
        tensor with a float64 copy of it (``inspect``'s statistics)."""
        sizes = [(math.prod(shape), self.dtype(name).itemsize) for name, shape in self.shapes.items()]
        if whole:
            need, what = sum(n * item for n, item in sizes), f"reading all of {self.path}"
        else:
            need, what = max(n * (item + 8) for n, item in sizes), f"reading the largest tensor of {self.path}"
        try:
            memory.require(need, what)
        except ConfigError as e:
            raise FormatError(str(e)) from None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _runs(values: np.ndarray) -> list:
    """Sorted unique ``values`` as [(lo, hi)] runs of consecutive integers."""
    u = np.unique(values)
    if u.size == 0:
        return []
    cut = np.flatnonzero(np.diff(u) != 1) + 1
    return [(int(r[0]), int(r[-1]) + 1) for r in np.split(u, cut)]


def read_block(read_box, shape: tuple, index: tuple, dtype) -> np.ndarray:
    """Assemble the block at ``index`` (one global index array per
    dimension) from contiguous boxes fetched by ``read_box(tuple of
    slices)``. A c_attn column block is three runs (its q, k, v parts), so
    it costs three reads; a block with more pieces than MAX_BOXES is read
    through its bounding box instead."""
    index = tuple(np.asarray(ix, dtype=np.int64).reshape(-1) for ix in index)
    out = np.zeros(tuple(len(ix) for ix in index), dtype=dtype)
    if out.size == 0:
        return out
    real = [ix[ix < n] for ix, n in zip(index, shape)]
    if any(r.size == 0 for r in real):
        return out
    runs = [_runs(r) for r in real]
    if np.prod([len(r) for r in runs]) > MAX_BOXES:
        runs = [[(int(r.min()), int(r.max()) + 1)] for r in real]
    for combo in itertools.product(*runs):
        box = tuple(slice(lo, hi) for lo, hi in combo)
        data = np.asarray(read_box(box))
        src, dst = [], []
        for d, (lo, hi) in enumerate(combo):
            pos = np.flatnonzero((index[d] >= lo) & (index[d] < hi))   # where these indices sit in the block
            dst.append(pos)
            src.append(index[d][pos] - lo)
        out[np.ix_(*dst)] = data[np.ix_(*src)]
    return out


def check_shapes(path, found: dict, expected: dict, what: str = "tensor") -> None:
    """FormatError for the first parameter that is missing or shaped unlike
    the model the file's configuration describes."""
    for name, shape in expected.items():
        if name not in found:
            raise FormatError(f"{path}: missing {what} {name!r} (the model needs every GPT-2 parameter)")
        if tuple(found[name]) != tuple(shape):
            raise FormatError(f"{path}: {what} {name!r} has shape {tuple(found[name])} but its configuration "
                              f"needs {tuple(shape)}")


def model_config(path, n_layer, n_head, n_embd, n_ctx, vocab_size) -> ModelConfig:
    """A ModelConfig from a file's header or configuration, checked the way
    every layout needs (positive sizes, heads dividing the width)."""
    values = dict(vocab_size=vocab_size, n_ctx=n_ctx, n_layer=n_layer, n_head=n_head, n_embd=n_embd)
    for key, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise FormatError(f"{path}: {key} must be a positive integer, got {value!r}")
    if n_embd % n_head:
        raise FormatError(f"{path}: n_embd {n_embd} is not divisible by n_head {n_head}")
    return ModelConfig(**{k: int(v) for k, v in values.items()})
