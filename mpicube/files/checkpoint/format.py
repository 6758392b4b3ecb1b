"""Names, constants, the error type and small helpers shared by the writer,
the reader and inspect."""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...core.errors import UserError
from ..atomic import sync_fd

FORMAT = "mpicube-checkpoint"
VERSION = 1

CKPT_DIR = "ckpt"
LATEST = "latest"
MAIN_FILE = "checkpoint.h5"
SHARD_DIR = "shards"
_STEP_RE = re.compile(r"^step_(\d{8})$")
_RESERVED = ("format", "version", "step", "tensors", "shard_sha256")
_MAX_READS = 256          # hyperslab reads per Checkpoint.read call, at most
_MAX_COVER_CELLS = 10_000_000


class CheckpointError(UserError, ValueError):
    """A checkpoint problem; the message names the file or tensor concerned."""


@dataclass
class Block:
    """One rank's block of a logical tensor.

    ``local[i0, i1, ...]`` is the element at global position
    ``(index[0][i0], index[1][i1], ...)``; positions with ``index[d][i] >=
    shape[d]`` are padding and are not stored.
    """
    name: str                       # e.g. "model/wte", "optimizer/m/h.0.attn.c_attn.weight"
    local: np.ndarray               # host array, shape == tuple(len(ix) for ix in index)
    shape: tuple                    # logical global shape (real, unpadded)
    index: tuple                    # per dim: global index of each local position
    writer: bool = True             # exactly one replica of each block writes it


# --------------------------------------------------------------------------
# small helpers

def _step_name(step: int) -> str:
    return "step_%08d" % step


def _shard_rel(rank: int) -> str:
    return f"{SHARD_DIR}/rank_{rank:05d}.h5"


def _sha256_file(path) -> str:
    """sha256 of a file; also fsyncs it, so the digest is of what is on disk."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            buf = f.read(1 << 23)
            if not buf:
                break
            h.update(buf)
        sync_fd(f.fileno())
    return h.hexdigest()


def _fsync_dir(path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        sync_fd(fd)
    finally:
        os.close(fd)


def _runs(g: np.ndarray) -> np.ndarray:
    """Split a 1-D array of global indices into maximal runs of consecutive values.

    Returns an (n_runs, 3) int64 array of (global_start, local_start, length).
    """
    g = np.asarray(g, dtype=np.int64)
    if g.size == 0:
        return np.zeros((0, 3), np.int64)
    brk = np.nonzero(np.diff(g) != 1)[0] + 1
    starts = np.concatenate(([0], brk))
    stops = np.concatenate((brk, [g.size]))
    return np.stack([g[starts], starts, stops - starts], axis=1).astype(np.int64)


def _as_index(ix, dim: int, what: str) -> np.ndarray:
    a = np.asarray(ix)
    if a.ndim != 1:
        raise CheckpointError(f"{what}: index for dim {dim} must be 1-D, got shape {a.shape}")
    if a.size and not np.issubdtype(a.dtype, np.integer):
        raise CheckpointError(f"{what}: index for dim {dim} must be integers, got {a.dtype}")
    a = a.astype(np.int64, copy=False)
    if a.size and a.min() < 0:
        raise CheckpointError(f"{what}: index for dim {dim} has negative values")
    return a


def _fmt_shape(shape) -> str:
    return "(" + ", ".join(str(s) for s in shape) + ("," if len(shape) == 1 else "") + ")"


def _fmt_size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _decode_attr(v: Any) -> Any:
    if isinstance(v, bytes):
        v = v.decode("utf-8", "replace")
    if isinstance(v, str):
        s = v.lstrip()
        if s[:1] in ("{", "["):
            try:
                return json.loads(v)
            except (ValueError, RecursionError):     # not JSON, or nested past Python's stack
                return v
        return v
    if isinstance(v, np.generic):
        return v.item()
    return v


def _encode_attr(key: str, v: Any) -> Any:
    if isinstance(v, (dict, list, tuple)):
        return json.dumps(v, sort_keys=True)
    if isinstance(v, (str, bool, int, float, np.generic, np.ndarray)):
        return v
    raise CheckpointError(
        f"checkpoint attribute {key!r}: unsupported type {type(v).__name__} "
        "(use str, JSON string, dict/list, number or numpy array)")


class _SelfComm:
    """Stand-in for a one-rank communicator (``comm=None``)."""
    def Get_rank(self): return 0
    def Get_size(self): return 1
    def bcast(self, obj, root=0): return obj
    def gather(self, obj, root=0): return [obj]
    def allgather(self, obj): return [obj]
    def alltoall(self, objs): return list(objs)
    def Barrier(self): pass
