"""``save``: every rank writes its shard, rank 0 stitches them into
``checkpoint.h5`` with virtual datasets and commits atomically."""

from __future__ import annotations

import itertools
import json
import math
import os
import secrets
import shutil
import warnings
from pathlib import Path
from typing import Iterable, Sequence

import h5py
import numpy as np

from .format import (
    Block, CKPT_DIR, CheckpointError, FORMAT, LATEST, MAIN_FILE, SHARD_DIR, VERSION,
    _MAX_COVER_CELLS, _RESERVED, _STEP_RE, _SelfComm, _as_index, _decode_attr, _encode_attr,
    _fmt_shape, _fsync_dir, _runs, _sha256_file, _shard_rel, _step_name,
)



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
