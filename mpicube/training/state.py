"""A rank's training state <-> checkpoints: which blocks it writes, and
reading exactly its blocks back from a checkpoint saved on any layout."""

from __future__ import annotations

import json
from contextlib import contextmanager

from ..files import checkpoint
from ..files.checkpoint import CheckpointError


def state_blocks(store, opt, dp_rank: int, with_optimizer: bool = True) -> list:
    """Checkpoint blocks of every parameter and AdamW moment held here.
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
            blocks.append(checkpoint.Block(name=f"{prefix}/{spec.name}", local=local, shape=spec.decl.shape,
                                           index=spec.index, writer=bool(spec.writer and dp_rank == 0)))
    return blocks


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


def model_shapes(config: dict) -> dict:
    """{parameter name: shape} of the GPT a checkpoint's ``config``
    attribute describes (what ``checkpoint.inspect`` checks tensors against)."""
    from ..core.config import ModelConfig
    from ..model.gpt import gpt_params

    return {decl.name: tuple(decl.shape) for decl in gpt_params(ModelConfig.from_dict(config))}


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
