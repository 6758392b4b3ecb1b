"""A rank's training state <-> checkpoints: which blocks it writes, and
reading exactly its blocks back from a checkpoint saved on any layout."""

from __future__ import annotations

import json
import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from ..files import checkpoint
from ..files.checkpoint import CheckpointError

MAX_STEP = 99_999_999           # the largest step a checkpoint directory is named for (step_%08d)
BUFFERS = "buffers"             # the model's persistent tensors that are not parameters (ParamStore.persist)


def state_blocks(store, opt, dp_rank: int, with_optimizer: bool = True) -> list:
    """Checkpoint blocks of every parameter and AdamW moment held here;
    ``dp_rank`` is 0 on the one replica that writes (under --cp, the sum
    of the dp and cp ranks: 0 on dp and cp rank 0 only).
    Under --zero 1 the master weights (mixed precision) and the moments are
    gathered over dp first (collective: every rank calls this), so the blocks
    are whole local tensors as with --zero 0."""
    blocks = []
    buffers = [("model", store.full_master())]
    if with_optimizer:
        m, v = opt.full_moments()
        buffers += [("optimizer/m", m), ("optimizer/v", v)]
    for spec in store.specs:
        lo, hi = store.offsets[spec.name]
        for prefix, flat in buffers:
            local = store.backend.to_host(flat[lo:hi]).reshape(spec.local_shape)
            for index, part, writer in spec_pieces(spec, local):
                blocks.append(checkpoint.Block(name=f"{prefix}/{spec.name}", local=part, shape=spec.decl.shape,
                                               index=index, writer=bool(writer and (dp_rank == 0 or spec.expert))))
    for name, value in store.persistent.items():    # buffers (a router's bias): whole on every rank, written once
        local = np.asarray(store.backend.to_host(value))
        blocks.append(checkpoint.Block(name=f"{BUFFERS}/{name}", local=local, shape=local.shape,
                                       index=tuple(np.arange(n) for n in local.shape),
                                       writer=bool(store.persistent_writer[name] and dp_rank == 0)))
    return blocks


def spec_pieces(spec, local) -> list:
    """[(index, local part, writer)]: the block whole, or, with shared
    columns (replicated kv heads), the columns only this rank holds and
    the shared ones apart, each written by one rank: the checkpoint stays
    layout-independent (every element written once)."""
    if spec.shared is None:
        return [(spec.index, local, spec.writer)]
    cols = spec.shared.cols
    mine = np.r_[0:cols.start, cols.stop:spec.local_shape[-1]]                # (w_own,) local positions
    *rows, last = spec.index
    pieces = [((*rows, last[cols]), local[..., cols], spec.writer and spec.shared.writer)]
    return ([((*rows, last[mine]), local[..., mine], spec.writer)] if mine.size else []) + pieces


def load_state(ck, store, opt=None, comm=None) -> None:
    """Read exactly this rank's block of every parameter (and, given ``opt``,
    of the AdamW moments) from a checkpoint written on any layout. With
    ``comm``, a read that fails on some ranks (a damaged chunk that only
    they read) fails on every rank with the same message, so none is left
    waiting in the next collective."""
    error = None
    try:
        _load_state(ck, store, opt)
    except CheckpointError as e:
        error = str(e)
    if comm is not None:
        for rank, message in enumerate(comm.allgather(error)):
            if message is not None:
                raise CheckpointError(message if rank == 0 else f"rank {rank}: {message}")
    elif error is not None:
        raise CheckpointError(error)


def _load_state(ck, store, opt=None) -> None:
    prefixes = ["model"] + (["optimizer/m", "optimizer/v"] if opt is not None else [])
    names = set(ck.names())
    for spec in store.specs:                   # check everything before reading anything
        for prefix in prefixes:
            name = f"{prefix}/{spec.name}"
            if name not in names:
                what = "optimizer state (needed by --resume)" if prefix != "model" else "this parameter"
                raise CheckpointError(f"{ck.path}: has no tensor {name!r} ({what})")
            have, want = tuple(ck.shape(name)), tuple(spec.decl.shape)
            if have != want:
                raise CheckpointError(
                    f"{ck.path}: tensor {name!r} has shape {have} but this model needs {want} "
                    f"(checkpoint model {_describe_cfg(ck.attrs.get('config'))})")
    backend = store.backend
    for name, value in store.persistent.items():    # bitwise, in their own format; absent (a file without): as built
        key = f"{BUFFERS}/{name}"
        if key in names:
            if tuple(ck.shape(key)) != tuple(value.shape):
                raise CheckpointError(f"{ck.path}: tensor {key!r} has shape {tuple(ck.shape(key))} but this model "
                                      f"needs {tuple(value.shape)}")
            block = ck.read(key, index=tuple(np.arange(n) for n in value.shape), dtype=value.dtype)
            value[...] = backend.asarray(block, dtype=value.dtype)
    with store.writing_master() as flat, _moments(opt) as (m, v):    # under --zero 1, each keeps its chunk
        master = flat.dtype                                 # float32 under 16-bit storage
        for spec in store.specs:
            lo, hi = store.offsets[spec.name]
            targets = [("model", flat)]
            if opt is not None:
                targets += [("optimizer/m", m), ("optimizer/v", v)]
            for prefix, buf in targets:
                block = ck.read(f"{prefix}/{spec.name}", index=spec.index, dtype=master)
                buf[lo:hi] = backend.asarray(block.reshape(-1), dtype=master)


@contextmanager
def _moments(opt):
    """``opt.writing_moments()``, or (None, None) without an optimizer."""
    if opt is None:
        yield None, None
    else:
        with opt.writing_moments() as mv:
            yield mv


def model_shapes(config: dict, names=None) -> dict:
    """{parameter name: shape} of the GPT a checkpoint's ``config``
    attribute describes (what ``checkpoint.inspect`` checks tensors against).
    Given the checkpoint's tensor ``names``, a parameter the config implies
    and the checkpoint lacks is a ValueError found before the list is built,
    by walking the names one at a time: a config claiming 100,000 layers
    over a checkpoint of one costs one layer's steps, not a list of 1.2
    million shapes."""
    from ..core import memory
    from ..core.config import ModelConfig
    from ..files.formats.base import first_missing
    from ..model.gpt import gpt_params

    cfg = ModelConfig.from_dict(config)
    if names is not None:
        missing = first_missing(cfg, lambda name: f"model/{name}" in names)
        if missing is not None:
            raise ValueError(f"it describes n_layer {memory.format_count(cfg.n_layer)} "
                             f"({memory.format_count(memory.tensor_count(cfg.n_layer))} parameter tensors), but "
                             f"there is no tensor 'model/{missing}'")
    return {decl.name: tuple(decl.shape) for decl in gpt_params(cfg)}


def describe_layout(d: dict) -> str:
    """``{"layout": "3d", "tp": 8, "dp": 1, "q": 2}`` -> ``layout 3d (tp 8, dp 1, q 2)``."""
    rest = ", ".join(f"{k} {v}" for k, v in d.items() if k != "layout")
    return f"layout {d.get('layout')}" + (f" ({rest})" if rest else "")


def _describe_cfg(cfg) -> str:
    if isinstance(cfg, str):
        try:
            cfg = json.loads(cfg)
        except ValueError:
            return cfg
    if not isinstance(cfg, dict):
        return "unknown"
    return ", ".join(f"{k} {v}" for k, v in cfg.items())


def attr_dict(value) -> dict:
    """A checkpoint attribute that holds JSON (decoded or not)."""
    if isinstance(value, (str, bytes)):
        try:
            value = json.loads(value)
        except ValueError:
            return {}
    return value if isinstance(value, dict) else {}


@dataclass
class Saved:
    """What a model file's attributes record of the run that wrote it,
    every value checked: a checkpoint is untrusted input (docs/design.md
    section 6), and ``adam_t = "x"`` or ``data.step = -5`` must be one line,
    not a traceback or a run that starts at step -4. A foreign model file
    records nothing, and reads as a fresh start."""

    step: int = 0                       # the last completed step (data.step, else the checkpoint's step)
    adam_t: int = 0                     # AdamW's step count (bias correction)
    batch_size: Optional[int] = None    # train.batch_size: the saving run's global batch
    train: dict = field(default_factory=dict)      # the saving run's options, as recorded
    data: dict = field(default_factory=dict)       # path, val (str or absent), builtin (bool)
    loss_scale: Optional[dict] = None   # float16: scale, good_steps, skipped
    fp8: Optional[dict] = None          # --fp8 delayed: step, history {key: [amax]}, seen {key: amax}


def saved_state(model_file) -> Saved:
    """``Saved`` from ``model_file.attrs`` (a CheckpointError naming the
    file and the attribute for the first value of the wrong type or range)."""
    attrs = getattr(model_file, "attrs", None) or {}
    where = getattr(model_file, "path", "model file")

    def bad(what, value, wanted):
        shown = repr(value)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        return CheckpointError(f"{where}: attribute {what} is {shown}, not {wanted}")

    def integer(what, value, lo, hi):
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise bad(what, value, f"an integer from {lo:,} to {hi:,}")
        return value

    def document(key):
        value = attrs.get(key, {})
        decoded = attr_dict(value)
        if not decoded and value not in ({}, "", None):
            raise bad(f"'{key}'", value, "a JSON object")
        return decoded

    base = integer("'step'", getattr(model_file, "step", 0), 0, MAX_STEP)
    train, data = document("train"), document("data")
    step = integer("'data' step", data.get("step", base), 0, MAX_STEP)
    adam_t = integer("'adam_t'", attrs.get("adam_t", step), 0, 1 << 62)
    batch = train.get("batch_size")
    if batch is not None:
        batch = integer("'train' batch_size", batch, 1, 1 << 62)
    for key in ("path", "val"):
        if data.get(key) is not None and not isinstance(data[key], str):
            raise bad(f"'data' {key}", data[key], "a file name")
    if not isinstance(data.get("builtin", False), bool):
        raise bad("'data' builtin", data["builtin"], "true or false")
    loss_scale = None
    if "loss_scale" in attrs:
        loss_scale = document("loss_scale")
        scale = loss_scale.get("scale")
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not (math.isfinite(scale) and scale > 0):
            raise bad("'loss_scale' scale", scale, "a finite number > 0")
        for key in ("good_steps", "skipped"):
            integer(f"'loss_scale' {key}", loss_scale.get(key), 0, 1 << 62)
    fp8 = None
    if "fp8" in attrs:
        fp8 = document("fp8")
        integer("'fp8' step", fp8.get("step"), 0, MAX_STEP)
        for part in ("history", "seen"):
            amaxes = fp8.get(part)
            if not isinstance(amaxes, dict):
                raise bad(f"'fp8' {part}", amaxes, "a JSON object")
            for key, value in amaxes.items():
                values = value if part == "history" and isinstance(value, list) else [value]
                if part == "history" and not isinstance(value, list) or not all(
                        not isinstance(a, bool) and isinstance(a, (int, float)) and math.isfinite(a) and a >= 0
                        for a in values):
                    raise bad(f"'fp8' {part} of {key}", value, "finite amaxes >= 0")
    return Saved(step=step, adam_t=adam_t, batch_size=batch, train=train, data=data, loss_scale=loss_scale,
                 fp8=fp8)
