"""``save``: every rank writes its shard, the owners of the tensors index
them with virtual datasets (``vds``), rank 0 writes ``checkpoint.h5`` over
the indexes and commits atomically."""

from __future__ import annotations

import os
import re
import secrets
import shutil
import warnings
from pathlib import Path
from typing import Iterable, Sequence

import h5py
import numpy as np

from . import h5create, meta, vds
from ..atomic import sync_fd
from .format import (Block, CKPT_DIR, CheckpointError, FORMAT, LATEST, MAIN_FILE, SHARD_DIR, VERSION,
                     _RESERVED, _STEP_RE, _SelfComm, _decode_attr, _encode_attr, _fsync_dir, _sha256_file,
                     _shard_rel, _step_name)

_OWNER_RE = re.compile(r"^[A-Za-z0-9]+$")
_HDF5_ERRNO = re.compile(r"\berrno = (\d+)")       # how HDF5's text of a failed system call gives errno


def describe_blocks(rank: int, blocks: Sequence[Block]):
    """(entries for rank 0, [(dataset, stored array, logical shape)] to write):
    this rank's blocks validated, without their padding, as ``meta.assemble``
    takes them."""
    entries = []      # (name, shape, dtype str, writer, dataset, boxes, mappings, scalar); see meta.assemble
    to_write = []
    used: dict[str, int] = {}
    cache: dict = {}
    for k, b in enumerate(blocks):
        what = f"block {k} ({getattr(b, 'name', '?')!r}) on rank {rank}"
        shape, dtype, stored, runs = meta.prepare_block(b, what, cache)
        if not b.writer:
            entries.append((b.name, shape, dtype.str, False, None, None, None, None))
        elif len(shape) == 0:          # 0-d: rank 0 stores the value in checkpoint.h5
            entries.append((b.name, shape, dtype.str, True, None, None, None, stored.copy()))
        elif stored.size == 0:         # all padding (or empty tensor): nothing to store
            entries.append(meta.piece_meta(b.name, shape, dtype, None, runs, cache))
        else:
            n = used.get(b.name, 0)
            used[b.name] = n + 1
            dset = b.name if n == 0 else f"{b.name}#{n}"
            entries.append(meta.piece_meta(b.name, shape, dtype, dset, runs, cache))
            to_write.append((dset, stored, shape))
    return entries, to_write


def _write_shard(tmp: Path, rank: int, step: int, blocks: Sequence[Block]):
    """Write this rank's shard, check it and hash it; return the metadata
    rank 0 needs: (entries, (shard file, sha256, size) or None)."""
    entries, to_write = describe_blocks(rank, blocks)
    shard = None
    if to_write:
        rel = _shard_rel(rank)
        path = tmp / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        with h5create.create(path) as f:
            f.attrs["format"] = FORMAT + "-shard"
            f.attrs["version"] = VERSION
            f.attrs["step"] = step
            f.attrs["rank"] = rank
            for dset, arr, shape in to_write:
                ds = f.create_dataset(dset, data=arr, chunks=True, fletcher32=True)
                ds.attrs["logical_shape"] = np.asarray(shape, np.int64)
        _check_shard(path, to_write)
        shard = (rel, _sha256_file(path), path.stat().st_size)
    return entries, shard


def _check_shard(path: Path, written: list) -> None:
    """The writer's own check of what it wrote: every dataset there, with
    its shape and dtype (rank 0 no longer opens the shards)."""
    with h5py.File(path, "r", locking=False) as f:
        for dset, arr, _ in written:
            ds = f.get(dset)
            if not isinstance(ds, h5py.Dataset) or ds.shape != arr.shape or ds.dtype != arr.dtype:
                raise CheckpointError(f"shard {path}: dataset {dset!r} did not come back as written")


def _check_files(tmp: Path, files: dict) -> None:
    """Rank 0, before the rename: every shard and index file is there with
    the size its writer reported (each writer checked its own content)."""
    for rel, (_, size) in files.items():
        p = tmp / rel
        if not p.is_file():
            raise CheckpointError(f"shard {p} is missing before commit")
        if p.stat().st_size != size:
            raise CheckpointError(
                f"shard {p}: size {p.stat().st_size} != {size} reported by its writer")


def _first_error(errors: list):
    """The first rank's error, and how many more ranks failed (None if none
    did): one short line, where a full disk fails every rank alike."""
    errors = [e for e in errors if e is not None]
    if not errors:
        return None
    more = len(errors) - 1
    return errors[0] + (f" (and {more} more rank{'s' if more > 1 else ''})" if more else "")


def _write_latest(ckpt: Path, name: str) -> None:
    tmp = ckpt / f".latest.tmp_{secrets.token_hex(4)}"
    try:
        with open(tmp, "w") as fh:
            fh.write(name + "\n")
            fh.flush()
            sync_fd(fh.fileno())
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


def _remove_dir(ckpt: Path, d: Path, owner: str) -> None:
    """Delete a step dir so that no half-deleted step_* dir can remain."""
    trash = ckpt / f".del_{owner}_{d.name}_{secrets.token_hex(4)}"
    os.replace(d, trash)
    shutil.rmtree(trash, ignore_errors=True)


ABANDONED_DIR = "abandoned"     # RUN/ckpt/abandoned/: later steps of a trajectory a resumed run left


def _abandoned(ckpt: Path, current: Path) -> list:
    """Step dirs numbered after ``current``, the step just committed. A save
    of step s with step t > s on disk means this run resumed from an older
    checkpoint than t (``latest`` named an older step, or was pointed back
    by hand): t belongs to the trajectory it abandoned. Left in place, t
    would outlive this run's own checkpoints under ``keep``, be what
    ``latest``'s fallback (the newest complete step) takes after a crash,
    and survive until this run happened to reach step t again."""
    number = int(_STEP_RE.match(current.name).group(1))
    return [p for p in ckpt.iterdir() if (m := _STEP_RE.match(p.name)) and p.is_dir() and int(m.group(1)) > number]


def _set_aside(ckpt: Path, abandoned: list) -> None:
    """Move abandoned step dirs into ``RUN/ckpt/abandoned/`` (a run keeping
    every checkpoint deletes none): out of reach of ``latest`` and of later
    saves, still there for whoever wants them."""
    aside = ckpt / ABANDONED_DIR
    aside.mkdir(exist_ok=True)
    for p in abandoned:
        dst, n = aside / p.name, 1
        while dst.exists():
            dst, n = aside / f"{p.name}.{n}", n + 1
        os.replace(p, dst)
    _fsync_dir(ckpt)


def _prune(ckpt: Path, keep: int, current: Path, owner: str) -> None:
    """Keep the ``keep`` newest step dirs (and ``current``), after removing
    the abandoned ones numbered after ``current`` (``_abandoned``), which
    never count among the newest; remove this saver's own leftovers, never
    another job's (``recover`` clears those of dead jobs, under the run
    directory's lock)."""
    for p in _abandoned(ckpt, current):
        _remove_dir(ckpt, p, owner)
    steps = sorted((int(m.group(1)), p) for p in ckpt.iterdir()
                   if (m := _STEP_RE.match(p.name)) and p.is_dir())
    survivors = {p for _, p in steps[-keep:]} | {current}
    for _, p in steps:
        if p not in survivors:
            _remove_dir(ckpt, p, owner)
    mine = re.compile(rf"^(\.tmp_step_\d{{8}}_{owner}_|\.del_{owner}_)")
    for p in ckpt.iterdir():
        if p.is_dir() and mine.match(p.name):
            shutil.rmtree(p, ignore_errors=True)


def recover(run_dir) -> list:
    """Tidy ``RUN/ckpt`` after jobs that died; call it only while no other
    job can be saving there (the run directory's lock held). A step dir
    moved aside by an overwrite that never completed is moved back; the
    rest of the debris (temporary saves, half-deleted dirs) is removed.
    Returns what was done, one line each."""
    ckpt = Path(run_dir) / CKPT_DIR
    done = []
    if not ckpt.is_dir():
        return done
    for p in sorted(ckpt.iterdir()):
        if p.name.startswith(".old_step_"):
            step = p.name[len(".old_"):len(".old_") + len("step_00000000")]
            if _STEP_RE.match(step) and not (ckpt / step).exists() and (p / MAIN_FILE).is_file():
                os.replace(p, ckpt / step)
                done.append(f"restored {ckpt / step} (moved aside by a save that did not finish)")
                continue
        if p.name.startswith((".tmp_step_", ".del_", ".old_step_", ".latest.tmp_")):
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
            done.append(f"removed {p.name} (left by a job that died)")
    return done


def _errmsg(rank: int, e: BaseException) -> str:
    """One rank's failure in a few words: a failed system call as its errno
    text (HDF5's own text of a full disk runs to 300 characters and names a
    temporary file that is removed)."""
    number = e.errno if isinstance(e, OSError) else None
    if not number and (found := _HDF5_ERRNO.search(str(e))):
        number = int(found.group(1))
    if number:
        return f"rank {rank}: {os.strerror(number)}"
    return f"rank {rank}: {type(e).__name__}: {e}"


def save(run_dir, step: int, blocks: Iterable[Block], attrs: dict | None = None,
         comm=None, keep: int | None = None, owner: str | None = None) -> Path:
    """Write checkpoint ``RUN/ckpt/step_%08d`` collectively; return its path.

    Every rank of ``comm`` (an mpi4py communicator; ``None`` means a single
    process) calls this with the blocks it holds.  ``attrs`` become root
    attributes of checkpoint.h5 (str, numbers, numpy arrays; dicts and lists
    are stored as JSON strings).  With ``keep=N`` only the N highest-numbered
    step directories (and always the one just written) are kept. Step
    directories numbered after ``step`` were left by a trajectory that this
    run abandoned when it resumed from an older checkpoint: with ``keep``
    they are pruned first, never counted among the N; without it they are
    moved into ``RUN/ckpt/abandoned/`` (see ``_abandoned``).
    ``owner`` (letters and digits) names this saver in its temporary
    directories, so that it removes only its own.

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
            if owner is not None and not _OWNER_RE.match(owner):
                raise CheckpointError(f"{where}: owner {owner!r} must be letters and digits")
            for k in _RESERVED:
                if k in attrs and not (k == "step" and _decode_attr(attrs[k]) == step):
                    raise CheckpointError(f"{where}: attribute {k!r} is reserved")
            attrs.pop("step", None)
            for k, v in attrs.items():
                _encode_attr(k, v)
            ckpt.mkdir(parents=True, exist_ok=True)
            owner = owner or secrets.token_hex(4)
            tmp_name = f".tmp_{_step_name(step)}_{owner}_{secrets.token_hex(6)}"
            (ckpt / tmp_name).mkdir()
        except Exception as e:  # noqa: BLE001 - reported to every rank
            err = _errmsg(rank, e)
    err, tmp_name, owner = comm.bcast((err, tmp_name, owner), root=0)
    if err is not None:
        raise CheckpointError(f"saving {where} failed: {err}")
    tmp = ckpt / tmp_name

    # phase 1: every rank writes, checks and hashes its shard (in parallel)
    entries, shard, failed = [], None, None
    local_exc = None
    try:
        entries, shard = _write_shard(tmp, rank, step, blocks)
    except Exception as e:  # noqa: BLE001
        local_exc, failed = e, _errmsg(rank, e)
    shards_failed = _first_error(comm.allgather(failed))      # the same on every rank
    failed = None

    # phase 2: the owner of each tensor merges its pieces, indexes and checks them
    owned, index, summary = {}, None, {}
    if shards_failed is None:
        received = comm.alltoall([(bucket, shard[0] if shard else None)
                                  for bucket in meta.route(entries, size)])
        try:
            owned = meta.assemble(received)
            del received
            if any(t["pieces"] for t in owned.values()):
                rel = vds.index_rel(rank)
                vds.write_index(tmp / rel, owned)
                vds.verify_index(tmp / rel, owned)
                index = (rel, _sha256_file(tmp / rel), (tmp / rel).stat().st_size)
            summary = {name: (t["shape"], t["dtype"], index[0] if t["pieces"] else None,
                              t["scalar"][0][1] if t["scalar"] else None) for name, t in owned.items()}
        except Exception as e:  # noqa: BLE001
            local_exc, failed = e, _errmsg(rank, e)
    reports = comm.gather((failed, summary, [f for f in (shard, index) if f]), root=0)

    # phase 3: rank 0 writes checkpoint.h5 over the indexes and commits
    result = None
    if rank == 0:
        result = shards_failed or _first_error([r[0] for r in reports])
        if result is None:
            try:
                tensors = {name: t for _, s, _ in reports for name, t in s.items()}
                files = {rel: (digest, n) for *_, fs in reports for rel, digest, n in fs}
                vds.write_main(tmp / MAIN_FILE, step, attrs, tensors, files)
                _check_files(tmp, files)
                for sub in (SHARD_DIR, vds.INDEX_DIR, "."):
                    _fsync_dir(tmp / sub)
                _commit(ckpt, tmp, final)
            except Exception as e:  # noqa: BLE001
                result = _errmsg(0, e)
        if result is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            try:
                if keep is not None:
                    _prune(ckpt, int(keep), final, owner)
                elif _abandoned(ckpt, final):
                    _set_aside(ckpt, _abandoned(ckpt, final))
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
