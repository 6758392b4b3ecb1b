"""HDF5 checkpoints written in parallel, read by anyone (DESIGN.md section 6).

A checkpoint is a directory ``RUN/ckpt/step_%08d/``::

    checkpoint.h5            the only file a reader opens
    shards/rank_00000.h5     one file per rank that wrote something
    shards/rank_00003.h5     ...

Every rank holds *blocks* of logical tensors.  A block is described by one
global index array per dimension (a block need not be contiguous: the column
block of ``c_attn.weight`` is three runs, one in each of q, k, v), and index
values at or past the logical shape are padding (vocabulary padding) and are
never stored.  Replicas of a block are written once, by the replica with
``writer=True``.

``save`` is collective.  Each writer rank writes the non-padding part of its
blocks into its own shard file (plain h5py, chunked, fletcher32) and hashes
the file (sha256).  Rank 0 gathers the metadata and writes ``checkpoint.h5``:
root attributes (``format``, ``version``, ``step``, the caller's ``attrs``,
``tensors`` = JSON list of names, ``shard_sha256`` = JSON {file: digest}) and,
for every tensor, an HDF5 *virtual dataset* of the full logical shape whose
pieces map onto the shard datasets through relative paths, so the directory
can be moved and plain ``h5py`` sees whole tensors::

    with h5py.File("RUN/ckpt/step_00001000/checkpoint.h5") as f:
        wte = f["model/wte"][...]          # (V, h), real vocabulary only

Commit is atomic: everything goes to ``RUN/ckpt/.tmp_step_%08d_<random>/``,
rank 0 checks it (coverage of every tensor by exactly one writer, every
source file and dataset present with the size its writer reported), renames
it to ``step_%08d`` and only then rewrites ``RUN/ckpt/latest`` (via a
temporary file and ``os.replace``).  A failure on any rank is agreed on by
all ranks, the temporary directory is removed and every rank raises
:class:`CheckpointError`; the previous checkpoint and ``latest`` are untouched.

Loading verifies, because a missing virtual-dataset source silently reads as
fill values: :func:`open_checkpoint` checks the format/version attributes and
the presence and sha256 digest of every shard.  Hashing reads every byte of
the checkpoint once per call; that is acceptable at the sizes mpicube trains,
and when many ranks load the same checkpoint, let one rank verify
(``verify=True``) and the others open with ``verify=False`` after a barrier.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import re
import secrets
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import h5py
import numpy as np

from .errors import UserError

__all__ = [
    "FORMAT", "VERSION", "CheckpointError", "Block", "Checkpoint",
    "save", "latest", "open_checkpoint", "inspect",
]

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
        try:
            os.fsync(f.fileno())
        except OSError:
            pass
    return h.hexdigest()


def _fsync_dir(path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
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
            except ValueError:
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
    def Barrier(self): pass


# --------------------------------------------------------------------------
# save

def _prepare_block(b: Block, what: str):
    """Validate a block; return (shape, dtype, stored array or None, runs per dim)."""
    if not isinstance(b.name, str) or not b.name or b.name.startswith("/") or any(
            p in ("", ".", "..") for p in b.name.split("/")):
        raise CheckpointError(f"{what}: bad tensor name {b.name!r}")
    shape = tuple(int(s) for s in b.shape)
    if any(s < 0 for s in shape):
        raise CheckpointError(f"{what}: negative logical shape {shape}")
    local = np.asarray(b.local)
    if local.dtype == object:
        raise CheckpointError(f"{what}: object arrays cannot be checkpointed")
    index = tuple(b.index)
    if len(index) != len(shape) or local.ndim != len(shape):
        raise CheckpointError(
            f"{what}: logical shape {shape} has {len(shape)} dims but the index has "
            f"{len(index)} and the local array {local.ndim}")
    idx = [_as_index(ix, d, what) for d, ix in enumerate(index)]
    if tuple(len(i) for i in idx) != local.shape:
        raise CheckpointError(
            f"{what}: local array shape {local.shape} != index lengths "
            f"{tuple(len(i) for i in idx)}")
    for d, i in enumerate(idx):
        if np.unique(i).size != i.size:
            raise CheckpointError(f"{what}: index for dim {d} has repeated values")
    if not b.writer:
        return shape, local.dtype, None, None
    # keep the non-padding positions; slices (views) where they are contiguous
    sel, runs = [], []
    for d, i in enumerate(idx):
        pos = np.nonzero(i < shape[d])[0]
        if pos.size and pos[-1] - pos[0] + 1 == pos.size:
            sel.append(slice(int(pos[0]), int(pos[-1]) + 1))
        else:
            sel.append(pos)
        runs.append(_runs(i[pos]))
    if all(isinstance(s, slice) for s in sel):
        stored = local[tuple(sel)]
    else:
        stored = local[np.ix_(*[np.arange(s.start, s.stop) if isinstance(s, slice) else s
                                for s in sel])]
    return shape, local.dtype, stored, runs


def _write_shard(tmp: Path, rank: int, step: int, blocks: Sequence[Block]):
    """Write this rank's shard; return the metadata rank 0 needs."""
    entries = []      # (name, shape, dtype str, writer, shard dataset or None, runs or None, scalar)
    to_write = []
    used: dict[str, int] = {}
    for k, b in enumerate(blocks):
        what = f"block {k} ({getattr(b, 'name', '?')!r}) on rank {rank}"
        shape, dtype, stored, runs = _prepare_block(b, what)
        if not b.writer:
            entries.append((b.name, shape, dtype.str, False, None, None, None))
        elif len(shape) == 0:          # 0-d: rank 0 stores the value in checkpoint.h5
            entries.append((b.name, shape, dtype.str, True, None, None, stored.copy()))
        elif stored.size == 0:         # all padding (or empty tensor): nothing to store
            entries.append((b.name, shape, dtype.str, True, None, runs, None))
        else:
            n = used.get(b.name, 0)
            used[b.name] = n + 1
            dset = b.name if n == 0 else f"{b.name}#{n}"
            entries.append((b.name, shape, dtype.str, True, dset, runs, None))
            to_write.append((dset, stored, shape))
    shard = None
    if to_write:
        rel = _shard_rel(rank)
        path = tmp / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        with h5py.File(path, "w", locking=False) as f:
            f.attrs["format"] = FORMAT + "-shard"
            f.attrs["version"] = VERSION
            f.attrs["step"] = step
            f.attrs["rank"] = rank
            for dset, arr, shape in to_write:
                ds = f.create_dataset(dset, data=arr, chunks=True, fletcher32=True)
                ds.attrs["logical_shape"] = np.asarray(shape, np.int64)
        digest = _sha256_file(path)
        shard = (rel, digest, path.stat().st_size)
    return entries, shard


def _check_cover(name: str, shape: tuple, boxes: list) -> None:
    """Every element of the tensor written by exactly one writer block."""
    if not boxes:
        raise CheckpointError(f"tensor {name!r} {_fmt_shape(shape)}: no rank holds it with writer=True")
    nd = len(shape)
    coords = [np.unique(np.concatenate([[0, shape[d]]] + [[b[1][d], b[2][d]] for b in boxes]))
              for d in range(nd)]
    cells = math.prod(len(c) - 1 for c in coords)
    if cells > _MAX_COVER_CELLS:       # too fragmented to grid: volume check only
        vol = sum(math.prod(hi - lo for lo, hi in zip(b[1], b[2])) for b in boxes)
        if vol != math.prod(shape):
            raise CheckpointError(
                f"tensor {name!r} {_fmt_shape(shape)}: writer blocks cover {vol} elements, "
                f"expected {math.prod(shape)} (each element needs exactly one writer)")
        return
    grid = np.zeros([len(c) - 1 for c in coords], np.int32)
    for _, lo, hi in boxes:
        grid[tuple(slice(np.searchsorted(coords[d], lo[d]), np.searchsorted(coords[d], hi[d]))
                   for d in range(nd))] += 1
    bad = np.argwhere(grid != 1)
    if bad.size:
        cell = tuple(int(c) for c in bad[0])
        at = tuple(int(coords[d][cell[d]]) for d in range(nd))
        n = int(grid[cell])
        if n == 0:
            raise CheckpointError(
                f"tensor {name!r} {_fmt_shape(shape)}: element {at} is not written by any "
                "rank (no block with writer=True covers it)")
        ranks = sorted({r for r, lo, hi in boxes
                        if all(lo[d] <= at[d] < hi[d] for d in range(nd))})
        raise CheckpointError(
            f"tensor {name!r} {_fmt_shape(shape)}: element {at} is written {n} times "
            f"(by ranks {ranks}); exactly one replica of each block must have writer=True")


def _assemble(gathered) -> dict:
    """Rank 0: merge the per-rank metadata into {name: tensor description}."""
    tensors: dict[str, dict] = {}
    for rank, (entries, shard) in enumerate(gathered):
        rel = shard[0] if shard else None
        for name, shape, dtype, writer, dset, runs, scalar in entries:
            t = tensors.setdefault(name, {"shape": shape, "dtype": dtype, "pieces": [],
                                          "boxes": [], "scalar": [], "ranks": set()})
            t["ranks"].add(rank)
            if t["shape"] != shape:
                raise CheckpointError(
                    f"tensor {name!r}: ranks disagree on its logical shape "
                    f"({_fmt_shape(t['shape'])} vs {_fmt_shape(shape)} on rank {rank})")
            if np.dtype(t["dtype"]) != np.dtype(dtype):
                raise CheckpointError(
                    f"tensor {name!r}: ranks disagree on its dtype "
                    f"({np.dtype(t['dtype'])} vs {np.dtype(dtype)} on rank {rank})")
            if not writer:
                continue
            if len(shape) == 0:
                t["scalar"].append((rank, scalar))
                continue
            for combo in itertools.product(*[r.tolist() for r in runs]):
                lo = tuple(c[0] for c in combo)
                hi = tuple(c[0] + c[2] for c in combo)
                t["boxes"].append((rank, lo, hi))
            if dset is not None:
                t["pieces"].append((rel, dset, runs))
    for name, t in tensors.items():
        if len(t["shape"]) == 0:
            if len(t["scalar"]) != 1:
                raise CheckpointError(
                    f"tensor {name!r} (scalar): written by {len(t['scalar'])} ranks "
                    f"{[r for r, _ in t['scalar']]}; exactly one must have writer=True")
        elif math.prod(t["shape"]) > 0:
            _check_cover(name, t["shape"], t["boxes"])
    return tensors


def _write_main(tmp: Path, step: int, attrs: dict, tensors: dict, shards: dict) -> None:
    path = tmp / MAIN_FILE
    with h5py.File(path, "w", locking=False) as f:
        f.attrs["format"] = FORMAT
        f.attrs["version"] = VERSION
        f.attrs["step"] = step
        for k, v in attrs.items():
            f.attrs[k] = _encode_attr(k, v)
        f.attrs["tensors"] = json.dumps(sorted(tensors))
        f.attrs["shard_sha256"] = json.dumps({rel: d for rel, (d, _) in sorted(shards.items())})
        for name in sorted(tensors):
            t = tensors[name]
            shape, dtype = t["shape"], np.dtype(t["dtype"])
            try:
                if len(shape) == 0:
                    f.create_dataset(name, data=np.asarray(t["scalar"][0][1], dtype=dtype))
                elif not t["pieces"]:      # empty tensor
                    f.create_dataset(name, shape=shape, dtype=dtype)
                else:
                    layout = h5py.VirtualLayout(shape=shape, dtype=dtype)
                    for rel, dset, runs in t["pieces"]:
                        src_shape = tuple(int(r[:, 2].sum()) for r in runs)
                        src = h5py.VirtualSource(rel, dset, shape=src_shape, dtype=dtype)
                        for combo in itertools.product(*[r.tolist() for r in runs]):
                            g = tuple(slice(c[0], c[0] + c[2]) for c in combo)
                            loc = tuple(slice(c[1], c[1] + c[2]) for c in combo)
                            layout[g] = src[loc]
                    f.create_virtual_dataset(name, layout, fillvalue=0)
            except (ValueError, TypeError, KeyError, OSError) as e:
                raise CheckpointError(f"tensor {name!r}: cannot create it in {path}: {e}") from e
    with open(path, "rb") as fh:
        try:
            os.fsync(fh.fileno())
        except OSError:
            pass


def _verify_tmp(tmp: Path, tensors: dict, shards: dict) -> None:
    """Rank 0, before the rename: every source of every tensor is there.

    Structure and sizes are checked; the content digests were computed by
    each writer from its file after closing it (re-hashing everything on
    rank 0 would serialise a full read of the checkpoint).
    """
    for rel, (_, size) in shards.items():
        p = tmp / rel
        if not p.is_file():
            raise CheckpointError(f"shard {p} is missing before commit")
        if p.stat().st_size != size:
            raise CheckpointError(
                f"shard {p}: size {p.stat().st_size} != {size} reported by its writer")
    open_shards: dict[str, h5py.File] = {}
    try:
        with h5py.File(tmp / MAIN_FILE, "r", locking=False) as f:
            if json.loads(f.attrs["tensors"]) != sorted(tensors):
                raise CheckpointError(f"{tmp / MAIN_FILE}: tensor list does not match")
            for name, t in tensors.items():
                if name not in f or not isinstance(f[name], h5py.Dataset):
                    raise CheckpointError(f"{tmp / MAIN_FILE}: tensor {name!r} missing")
                ds = f[name]
                if ds.shape != t["shape"]:
                    raise CheckpointError(f"{tmp / MAIN_FILE}: tensor {name!r} has shape {ds.shape}")
                if not ds.is_virtual:
                    continue
                for m in ds.virtual_sources():
                    if m.file_name not in shards:
                        raise CheckpointError(
                            f"tensor {name!r}: source {m.file_name} is not a known shard")
                    if m.file_name not in open_shards:
                        open_shards[m.file_name] = h5py.File(tmp / m.file_name, "r", locking=False)
                    src = open_shards[m.file_name].get(m.dset_name)
                    if not isinstance(src, h5py.Dataset) or src.dtype != ds.dtype:
                        raise CheckpointError(
                            f"tensor {name!r}: source dataset {m.dset_name!r} missing or "
                            f"of the wrong dtype in {tmp / m.file_name}")
    finally:
        for sf in open_shards.values():
            sf.close()


def _write_latest(ckpt: Path, name: str) -> None:
    tmp = ckpt / f".latest.tmp_{secrets.token_hex(4)}"
    try:
        with open(tmp, "w") as fh:
            fh.write(name + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, ckpt / LATEST)
    finally:
        if tmp.exists():
            tmp.unlink()
    _fsync_dir(ckpt)


def _commit(ckpt: Path, tmp: Path, final: Path) -> None:
    """Rename tmp -> final and point `latest` at it; undo on failure."""
    aside = None
    if final.exists():
        aside = ckpt / f".old_{final.name}_{secrets.token_hex(4)}"
        os.replace(final, aside)
    def restore(exc):
        if aside is not None:
            try:
                os.replace(aside, final)
            except OSError as e2:
                raise CheckpointError(
                    f"{exc}; and the previous {final.name} could not be moved back from "
                    f"{aside} ({e2}): rename it to {final} by hand") from exc
    try:
        os.replace(tmp, final)
    except BaseException as e:
        restore(e)
        raise
    try:
        _fsync_dir(ckpt)
        _write_latest(ckpt, final.name)
    except BaseException as e:
        os.replace(final, tmp)           # the caller removes tmp
        restore(e)
        raise
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


def _remove_dir(ckpt: Path, d: Path) -> None:
    """Delete a step dir so that no half-deleted step_* dir can remain."""
    trash = ckpt / f".del_{d.name}_{secrets.token_hex(4)}"
    os.replace(d, trash)
    shutil.rmtree(trash, ignore_errors=True)


def _prune(ckpt: Path, keep: int, current: Path) -> None:
    steps = sorted((int(m.group(1)), p) for p in ckpt.iterdir()
                   if (m := _STEP_RE.match(p.name)) and p.is_dir())
    survivors = {p for _, p in steps[-keep:]} | {current}
    for _, p in steps:
        if p not in survivors:
            _remove_dir(ckpt, p)
    for p in ckpt.iterdir():                   # debris of earlier crashed saves
        if p.is_dir() and (p.name.startswith(".tmp_step_") or p.name.startswith(".del_")):
            shutil.rmtree(p, ignore_errors=True)


def _errmsg(rank: int, e: BaseException) -> str:
    return f"rank {rank}: {type(e).__name__}: {e}"


def save(run_dir, step: int, blocks: Iterable[Block], attrs: dict | None = None,
         comm=None, keep: int | None = None) -> Path:
    """Write checkpoint ``RUN/ckpt/step_%08d`` collectively; return its path.

    Every rank of ``comm`` (an mpi4py communicator; ``None`` means a single
    process) calls this with the blocks it holds.  ``attrs`` become root
    attributes of checkpoint.h5 (str, numbers, numpy arrays; dicts and lists
    are stored as JSON strings).  With ``keep=N`` only the N highest-numbered
    step directories (and always the one just written) are kept.

    On any failure, on any rank, nothing is committed, the temporary
    directory is removed and every rank raises :class:`CheckpointError`.
    """
    comm = _SelfComm() if comm is None else comm
    rank, size = comm.Get_rank(), comm.Get_size()
    step = int(step)
    run_dir = Path(run_dir)
    ckpt = run_dir / CKPT_DIR
    final = ckpt / _step_name(step)
    attrs = dict(attrs or {})
    blocks = list(blocks)
    where = f"checkpoint {final}"

    # phase 0: rank 0 validates arguments and creates the temporary dir
    err, tmp_name = None, None
    if rank == 0:
        try:
            if step < 0 or step > 99_999_999:
                raise CheckpointError(f"{where}: step {step} out of range")
            if keep is not None and int(keep) < 1:
                raise CheckpointError(f"{where}: keep must be >= 1, got {keep}")
            for k in _RESERVED:
                if k in attrs and not (k == "step" and _decode_attr(attrs[k]) == step):
                    raise CheckpointError(f"{where}: attribute {k!r} is reserved")
            attrs.pop("step", None)
            for k, v in attrs.items():
                _encode_attr(k, v)
            ckpt.mkdir(parents=True, exist_ok=True)
            tmp_name = f".tmp_{_step_name(step)}_{secrets.token_hex(6)}"
            (ckpt / tmp_name).mkdir()
        except Exception as e:  # noqa: BLE001 - reported to every rank
            err = _errmsg(rank, e)
    err, tmp_name = comm.bcast((err, tmp_name), root=0)
    if err is not None:
        raise CheckpointError(f"saving {where} failed: {err}")
    tmp = ckpt / tmp_name

    # phase 1: every rank writes its shard (in parallel)
    local_exc, mine = None, None
    try:
        mine = _write_shard(tmp, rank, step, blocks)
    except Exception as e:  # noqa: BLE001
        local_exc = e
    gathered = comm.gather((None if local_exc is None else _errmsg(rank, local_exc), mine), root=0)

    # phase 2: rank 0 writes checkpoint.h5, verifies, commits
    result = None
    if rank == 0:
        errs = [m for m, _ in gathered if m is not None]
        try:
            if errs:
                raise CheckpointError("; ".join(errs))
            metas = [meta for _, meta in gathered]
            tensors = _assemble(metas)
            shards = {s[0]: (s[1], s[2]) for _, s in metas if s is not None}
            _write_main(tmp, step, attrs, tensors, shards)
            _verify_tmp(tmp, tensors, shards)
            _fsync_dir(tmp / SHARD_DIR)
            _fsync_dir(tmp)
            _commit(ckpt, tmp, final)
        except Exception as e:  # noqa: BLE001
            shutil.rmtree(tmp, ignore_errors=True)
            result = str(e) if errs else _errmsg(0, e)
        else:
            if keep is not None:
                try:
                    _prune(ckpt, int(keep), final)
                except OSError as e:
                    warnings.warn(f"{where}: could not delete old checkpoints: {e}")
    result = comm.bcast(result, root=0)
    comm.Barrier()
    if result is not None:
        exc = CheckpointError(f"saving {where} failed ({size} ranks), nothing was committed: {result}")
        if local_exc is not None:
            raise exc from local_exc
        raise exc
    return final


# --------------------------------------------------------------------------
# load

def latest(run_dir) -> Path | None:
    """The checkpoint directory ``RUN/ckpt/latest`` points to, or None."""
    run_dir = Path(run_dir)
    f = run_dir / CKPT_DIR / LATEST
    if not f.is_file():
        return None
    name = f.read_text().strip()
    if not _STEP_RE.match(name):
        raise CheckpointError(f"{f}: does not name a step directory (got {name!r})")
    d = run_dir / CKPT_DIR / name
    if not (d / MAIN_FILE).is_file():
        raise CheckpointError(f"{f} points to {d}, which has no {MAIN_FILE}")
    return d


def _resolve(path) -> Path:
    p = Path(path)
    if p.is_file():
        return p
    if (p / MAIN_FILE).is_file():
        return p / MAIN_FILE
    if (p / CKPT_DIR / LATEST).is_file():
        return latest(p) / MAIN_FILE
    if (p / LATEST).is_file() and p.name == CKPT_DIR:
        return latest(p.parent) / MAIN_FILE
    if p.is_dir() and (p / CKPT_DIR).is_dir():
        raise CheckpointError(f"{p / CKPT_DIR}: no checkpoint committed yet (no {LATEST} file)")
    raise CheckpointError(
        f"{p}: no checkpoint found (expected a step_XXXXXXXX directory, its {MAIN_FILE}, "
        f"or a run directory with {CKPT_DIR}/{LATEST})")


class Checkpoint:
    """A committed checkpoint opened for reading (see :func:`open_checkpoint`)."""

    def __init__(self, file: Path, verify: bool = True):
        self.file = Path(file)
        self.path = self.file.parent
        try:
            self._f = h5py.File(self.file, "r", locking=False)
        except Exception as e:  # noqa: BLE001 - h5py raises OSError, sometimes others
            raise CheckpointError(
                f"{self.file}: cannot open checkpoint (truncated or not an HDF5 file?): {e}") from e
        try:
            self._check_header()
            if verify:
                self.verify()
        except BaseException:
            self._f.close()
            raise

    def _attr(self, key: str):
        try:
            return self._f.attrs[key]
        except KeyError:
            raise CheckpointError(f"{self.file}: root attribute {key!r} is missing") from None
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"{self.file}: cannot read root attribute {key!r}: {e}") from e

    def _check_header(self) -> None:
        fmt = _decode_attr(self._attr("format"))
        if fmt != FORMAT:
            raise CheckpointError(f"{self.file}: attribute 'format' is {fmt!r}, expected {FORMAT!r}")
        ver = _decode_attr(self._attr("version"))
        if ver != VERSION:
            raise CheckpointError(
                f"{self.file}: attribute 'version' is {ver!r}; this mpicube reads version {VERSION}")
        try:
            self.step = int(_decode_attr(self._attr("step")))
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"{self.file}: attribute 'step' is not an integer") from e
        names = _decode_attr(self._attr("tensors"))
        if not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
            raise CheckpointError(f"{self.file}: attribute 'tensors' is not a JSON list of names")
        self._names = names
        shards = _decode_attr(self._attr("shard_sha256"))
        if not (isinstance(shards, dict) and all(isinstance(v, str) for v in shards.values())):
            raise CheckpointError(f"{self.file}: attribute 'shard_sha256' is not a JSON object")
        self.shard_sha256 = shards
        self.attrs = {}
        try:
            for k in self._f.attrs:
                if k not in ("tensors", "shard_sha256"):
                    self.attrs[k] = _decode_attr(self._f.attrs[k])
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"{self.file}: cannot read root attributes: {e}") from e

    def verify(self) -> None:
        """Check every tensor is present and every shard exists with its sha256."""
        for name in self._names:
            try:
                obj = self._f.get(name)
            except Exception as e:  # noqa: BLE001
                raise CheckpointError(f"{self.file}: tensor {name!r} is unreadable: {e}") from e
            if not isinstance(obj, h5py.Dataset):
                raise CheckpointError(f"{self.file}: tensor {name!r} is missing")
        for rel, digest in sorted(self.shard_sha256.items()):
            p = self.path / rel
            if not p.is_file():
                raise CheckpointError(
                    f"{p}: shard file is missing (tensors stored in it would read as zeros)")
            got = _sha256_file(p)
            if got != digest:
                raise CheckpointError(
                    f"{p}: shard file is corrupt (sha256 {got[:16]}..., expected {digest[:16]}...)")

    def names(self) -> list[str]:
        return list(self._names)

    def __contains__(self, name) -> bool:
        return name in self._names

    def _ds(self, name: str) -> h5py.Dataset:
        if name not in self._names:
            raise CheckpointError(
                f"{self.file}: no tensor {name!r} (it has {len(self._names)}: "
                f"{', '.join(self._names[:8])}{', ...' if len(self._names) > 8 else ''})")
        return self._f[name]

    def shape(self, name: str) -> tuple:
        return tuple(self._ds(name).shape)

    def dtype(self, name: str) -> np.dtype:
        return self._ds(name).dtype

    def read(self, name: str, index=None, dtype=None) -> np.ndarray:
        """The whole tensor, or the block at per-dim global index arrays.

        ``index[d]`` may hold any non-negative global indices in any order;
        values ``>= shape[d]`` are padding and come back as 0.  Only bounding
        boxes of runs of the needed indices are read from the file.
        """
        ds = self._ds(name)
        shape = ds.shape
        what = f"{self.file}: tensor {name!r}"
        try:
            if index is None:
                out = ds[()]
                return np.asarray(out if dtype is None else out.astype(dtype, copy=False))
            index = tuple(index)
            if len(index) != len(shape):
                raise CheckpointError(f"{what}: index has {len(index)} dims, tensor {_fmt_shape(shape)}")
            idx = [_as_index(range(*ix.indices(shape[d])) if isinstance(ix, slice) else ix, d, what)
                   for d, ix in enumerate(index)]
            out = np.zeros(tuple(len(i) for i in idx), dtype=dtype or ds.dtype)
            if out.size == 0:
                return out
            pos = [np.nonzero(i < shape[d])[0] for d, i in enumerate(idx)]
            if any(p.size == 0 for p in pos):
                return out
            clusters = _clusters([idx[d][p] for d, p in enumerate(pos)])
            for combo in itertools.product(*clusters):
                box = tuple(slice(lo, hi) for lo, hi, _ in combo)
                slab = ds[box]
                src = np.ix_(*[idx[d][pos[d][sel]] - lo for d, (lo, _, sel) in enumerate(combo)])
                dst = np.ix_(*[pos[d][sel] for d, (_, _, sel) in enumerate(combo)])
                out[dst] = slab[src]
            return out
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 - fletcher32 failures etc.
            raise CheckpointError(f"{what}: read failed: {e}") from e

    def close(self) -> None:
        if getattr(self, "_f", None) is not None:
            self._f.close()
            self._f = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return f"Checkpoint({str(self.path)!r}, step={getattr(self, 'step', '?')}, tensors={len(self._names)})"


def _clusters(gs: list) -> list:
    """Per dim: groups (lo, hi, positions) of the wanted indices to read as one slab.

    Starts from maximal runs of sorted unique indices and merges across the
    smallest gaps until at most _MAX_READS slabs are needed in total.
    """
    per_dim = []
    for g in gs:
        u = np.unique(g)
        gaps = np.diff(u) - 1
        per_dim.append((u, gaps, int(np.count_nonzero(gaps > 0)) + 1))
    counts = [c for _, _, c in per_dim]
    while math.prod(counts) > _MAX_READS:
        d = int(np.argmax(counts))
        counts[d] = max(1, counts[d] // 2)
    out = []
    for (u, gaps, _), c, g in zip(per_dim, counts, gs):
        if c > 1:
            cut = np.sort(np.argsort(-gaps, kind="stable")[: c - 1]) + 1
        else:
            cut = np.zeros(0, np.int64)
        edges = np.concatenate(([0], cut, [u.size]))
        groups = []
        for a, b in zip(edges[:-1], edges[1:]):
            lo, hi = int(u[a]), int(u[b - 1]) + 1
            groups.append((lo, hi, np.nonzero((g >= lo) & (g < hi))[0]))
        out.append(groups)
    return out


def open_checkpoint(path, verify: bool = True) -> Checkpoint:
    """Open a checkpoint: a step dir, its checkpoint.h5, or a run dir (its latest).

    Checks the ``format`` and ``version`` attributes; with ``verify`` (the
    default) also that every shard file exists and matches its sha256, which
    reads the whole checkpoint once.  Problems raise :class:`CheckpointError`.
    """
    return Checkpoint(_resolve(path), verify=verify)


# --------------------------------------------------------------------------
# inspect

def _shape_problems(ck) -> list:
    """GPT tensors shaped unlike the model that the ``config`` attribute
    describes (a checkpoint no reader could load)."""
    from .config import ModelConfig
    from .model import gpt_params

    cfg = ck.attrs.get("config")
    if not isinstance(cfg, dict):
        return [f"{ck.file}: attribute 'config' is missing or not a JSON object"]
    try:
        decls = gpt_params(ModelConfig.from_dict(cfg))
    except (TypeError, ValueError) as e:
        return [f"{ck.file}: attribute 'config' does not describe a model: {e}"]
    have, problems = set(ck.names()), []
    for decl in decls:
        for prefix in ("model", "optimizer/m", "optimizer/v"):
            name = f"{prefix}/{decl.name}"
            if name in have and tuple(ck.shape(name)) != tuple(decl.shape):
                problems.append(f"{ck.file}: tensor {name!r} has shape {tuple(ck.shape(name))} but the model in "
                                f"its 'config' attribute needs {tuple(decl.shape)}")
    return problems


def inspect(path) -> tuple[bool, str]:
    """Human-readable report of a checkpoint and a full integrity check.

    Lists tensors (shape, dtype, pieces), attributes (config, training
    options, the layout that saved it) and, for every shard, its sha256 and
    a read of every dataset in it (which checks the fletcher32 checksums).
    Returns ``(ok, report)``; never raises for a broken checkpoint.
    """
    lines: list[str] = []
    problems: list[str] = []
    try:
        ck = open_checkpoint(path, verify=False)
    except CheckpointError as e:
        return False, f"checkpoint {path}\nPROBLEM: {e}\nresult: FAILED"
    with ck:
        lines.append(f"checkpoint {ck.path}")
        lines.append(f"  format {ck.attrs.get('format')} version {ck.attrs.get('version')}, step {ck.step}")
        lines.append("attributes:")
        for k, v in ck.attrs.items():
            if k in ("format", "version", "step"):
                continue
            s = json.dumps(v, sort_keys=True) if isinstance(v, (dict, list)) else repr(v)
            lines.append(f"  {k}: {s}")
        lines.append(f"tensors ({len(ck.names())}):")
        total = 0
        for name in ck.names():
            try:
                ds = ck._f.get(name)
                if not isinstance(ds, h5py.Dataset):
                    raise CheckpointError("missing")
                nbytes = ds.size * ds.dtype.itemsize
                total += nbytes
                if ds.is_virtual:
                    srcs = ds.virtual_sources()
                    files = sorted({m.file_name for m in srcs})
                    for fn in files:
                        if fn not in ck.shard_sha256:
                            problems.append(f"tensor {name!r}: source {fn} has no recorded sha256")
                        elif not (ck.path / fn).is_file():
                            problems.append(f"tensor {name!r}: source {ck.path / fn} is missing")
                    how = f"{len(srcs)} pieces in {len(files)} shard(s)"
                else:
                    how = "stored in checkpoint.h5"
                lines.append(f"  {name:<40s} {_fmt_shape(ds.shape):<14s} {str(ds.dtype):<8s} {how}")
            except Exception as e:  # noqa: BLE001
                problems.append(f"{ck.file}: tensor {name!r}: {e}")
        lines.append(f"  total {_fmt_size(total)}")
        problems += _shape_problems(ck)
        lines.append(f"shards ({len(ck.shard_sha256)}):")
        for rel, digest in sorted(ck.shard_sha256.items()):
            p = ck.path / rel
            if not p.is_file():
                problems.append(f"{p}: shard file is missing")
                lines.append(f"  {rel}  MISSING")
                continue
            got = _sha256_file(p)
            sha = "sha256 ok" if got == digest else "sha256 MISMATCH"
            if got != digest:
                problems.append(f"{p}: sha256 mismatch (file is corrupt)")
            nd, bad = 0, []
            try:
                with h5py.File(p, "r", locking=False) as sf:
                    dsets = []
                    sf.visititems(lambda n, o: dsets.append(n) if isinstance(o, h5py.Dataset) else None)
                    for n in dsets:
                        try:
                            sf[n][()]
                            nd += 1
                        except Exception as e:  # noqa: BLE001
                            bad.append(n)
                            problems.append(f"{p}: dataset {n!r} unreadable (checksum?): {e}")
            except Exception as e:  # noqa: BLE001
                problems.append(f"{p}: cannot open shard: {e}")
                bad.append("<file>")
            read = f"{nd} datasets read ok" if not bad else f"{len(bad)} dataset(s) FAILED"
            lines.append(f"  {rel}  {_fmt_size(p.stat().st_size)}  {sha}  {read}")
    for pr in problems:
        lines.append(f"PROBLEM: {pr}")
    ok = not problems
    lines.append("result: OK" if ok else f"result: FAILED ({len(problems)} problem(s))")
    return ok, "\n".join(lines)
