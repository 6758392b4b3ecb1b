"""Finding and opening checkpoints, and reading any block of any tensor."""

from __future__ import annotations

import itertools
import math
import zlib
from pathlib import Path

import h5py
import numpy as np

from . import header, storage
from .format import (CKPT_DIR, CheckpointError, LATEST, MAIN_FILE, _MAX_READS, _STEP_RE, _as_index, _fmt_shape,
                     _sha256_file)

INDEX_FILES_OPEN = 64       # index files a Checkpoint keeps open


def latest(run_dir, notes: list | None = None) -> Path | None:
    """The run's newest committed checkpoint directory, or None.

    ``RUN/ckpt/latest`` names it. If that file is missing, or names a step
    that is not there (a job killed between the commit's two renames), the
    newest step directory that holds a checkpoint.h5 is taken instead, and
    a line saying so is appended to ``notes``."""
    run_dir = Path(run_dir)
    ckpt = run_dir / CKPT_DIR
    f = ckpt / LATEST
    named = f.read_text().strip() if f.is_file() else None
    if named is not None and _STEP_RE.match(named) and (ckpt / named / MAIN_FILE).is_file():
        return ckpt / named
    found = _newest_complete(ckpt)
    if named is None and found is None:
        return None
    if found is None:
        if not _STEP_RE.match(named):
            raise CheckpointError(f"{f}: does not name a step directory (got {named!r})")
        raise CheckpointError(f"{f} points to {ckpt / named}, which has no {MAIN_FILE}, and no other "
                              "complete checkpoint is there")
    if notes is not None:
        why = f"{f} is missing" if named is None else f"{f} names {named!r}, which is not a complete checkpoint"
        notes.append(f"note: {why}; using the newest complete one found, {found}")
    return found


def _newest_complete(ckpt: Path) -> Path | None:
    if not ckpt.is_dir():
        return None
    steps = sorted((p.name for p in ckpt.iterdir() if _STEP_RE.match(p.name) and (p / MAIN_FILE).is_file()),
                   reverse=True)
    return ckpt / steps[0] if steps else None


def _resolve(path) -> Path:
    p = Path(path)
    if p.is_file():
        return p
    if (p / MAIN_FILE).is_file():
        return p / MAIN_FILE
    if p.name == CKPT_DIR and p.is_dir():
        p = p.parent
    if (p / CKPT_DIR).is_dir():
        found = latest(p)
        if found is None:
            raise CheckpointError(f"{p / CKPT_DIR}: no checkpoint committed yet (no {LATEST} file)")
        return found / MAIN_FILE
    raise CheckpointError(
        f"{p}: no checkpoint found (expected a step_XXXXXXXX directory, its {MAIN_FILE}, "
        f"or a run directory with {CKPT_DIR}/{LATEST})")


class Checkpoint:
    """A committed checkpoint opened for reading (see :func:`open_checkpoint`).

    No link is followed before ``storage`` has checked it; ``verify`` also
    checks where every tensor's bytes come from (``storage``), so that a
    loader reads only the files the checkpoint lists, inside its directory."""

    def __init__(self, file: Path, verify: bool = True):
        self.file = Path(file)
        self.path = self.file.parent
        self.bounds = None               # storage.Bounds: the files it may read, once the header is read
        self._index = {}                 # relative path -> open index file, least recently used first
        self._links = {}                 # tensor name -> (its link in checkpoint.h5, index file or None)
        self._inside = set()             # tensors whose path inside their index file was checked
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

    def _check_header(self) -> None:
        head = header.parse_root(header.read_attrs(self._f.attrs, self.file), self.file)
        self.step, self._names, self.shard_sha256, self.attrs = head.step, head.names, head.shard_sha256, head.attrs
        self.bounds = storage.Bounds(self.path, self.shard_sha256)

    def verify(self, files=None) -> None:
        """Check every tensor is present, every listed file inside the
        checkpoint directory and matching its sha256, and every tensor's
        bytes coming from listed files only (``storage``); ``files``: only
        these of the listed files (a rank's share) are hashed, and only the
        tensors indexed in them checked."""
        problems = self.bounds.listing_problems()
        if problems:
            raise CheckpointError(problems[0])
        for name in self._names:            # links are checked, not followed: their files are hashed below
            link, _ = self._link(name)
            if link is None or (not isinstance(link, h5py.ExternalLink)
                                and not isinstance(self._f.get(name), h5py.Dataset)):
                raise CheckpointError(f"{self.file}: tensor {name!r} is missing")
        self._hash(files)
        try:
            for name in self._names:
                index = self._link(name)[1]
                if files is None or index is None or index in files:
                    problems, _ = self.check_storage(name)
                    if problems:
                        raise CheckpointError(problems[0])
        finally:
            self.bounds.close()             # the shards it opened to look at; reads go through HDF5's own

    def check_storage(self, name: str) -> tuple[list, list]:
        """(problems, source files of its virtual mappings) of where tensor
        ``name``'s bytes come from (``storage.tensor_problems``)."""
        try:
            ds = self._ds(name)
        except CheckpointError as e:
            return [str(e)], []
        index = self._link(name)[1]
        return storage.tensor_problems(self.bounds, index or MAIN_FILE, ds, f"{self.file}: tensor {name!r}")

    def _hash(self, files) -> None:
        for rel, digest in sorted(self.shard_sha256.items()):
            if files is not None and rel not in files:
                continue
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
        what = f"{self.file}: tensor {name!r}"
        link, index = self._link(name)
        try:
            f, path = (self._f, name) if index is None else (self._index_file(index), link.path)
        except Exception as e:  # noqa: BLE001 - a link to a missing or damaged index file
            raise CheckpointError(f"{what} is unreadable: {e}") from e
        if index is not None and name not in self._inside:
            why = storage.link_problem(f, path.lstrip("/"), f"{what}: in {index}", final_external=False)
            if why is not None:
                raise CheckpointError(why)
            self._inside.add(name)
        try:
            ds = f.get(path)
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"{what} is unreadable: {e}") from e
        if not isinstance(ds, h5py.Dataset):
            raise CheckpointError(f"{what} is missing" if ds is None else f"{what} is not a dataset")
        return ds

    def _link(self, name: str) -> tuple:
        """(link, index file) of tensor ``name`` in checkpoint.h5: a hard
        link (index None), or an external link into ``index``, one of the
        listed files; (None, None) if there is none; a CheckpointError for
        any other link, checked before anything is followed; cached."""
        if name not in self._links:
            what = f"{self.file}: tensor {name!r}"
            why = storage.link_problem(self._f, name, what, final_external=True)
            if why is not None:
                raise CheckpointError(why)
            link, index = self._f.get(name, getlink=True), None
            if isinstance(link, h5py.ExternalLink):
                index, why = self.bounds.resolve(MAIN_FILE, link.filename, f"{what}: external link")
                if why is not None:
                    raise CheckpointError(why)
            self._links[name] = (link, index)
        return self._links[name]

    def _index_file(self, rel: str) -> h5py.File:
        """An index file, kept open among the last INDEX_FILES_OPEN used:
        HDF5 would open it afresh at every pass through a link (a resumed
        rank passes through each link twice: the shape check and the read)."""
        f = self._index.pop(rel, None)
        if f is None:
            f = h5py.File(self.path / rel, "r", locking=False)
            while len(self._index) >= INDEX_FILES_OPEN:
                self._index.pop(next(iter(self._index))).close()
        self._index[rel] = f
        return f

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
        for f in getattr(self, "_index", {}).values():
            f.close()
        self._index = {}
        if getattr(self, "bounds", None) is not None:
            self.bounds.close()
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


def open_checkpoint(path, verify: bool = True, comm=None) -> Checkpoint:
    """Open a checkpoint: a step dir, its checkpoint.h5, or a run dir (its latest).

    Checks the ``format`` and ``version`` attributes; with ``verify`` (the
    default) also that every shard file exists and matches its sha256, which
    reads the whole checkpoint once. Problems raise :class:`CheckpointError`.

    With ``comm`` (an mpi4py communicator) it is collective: every rank
    opens the same path and hashes only its share of the files (shard
    ``rank_XXXXX`` falls to rank XXXXX modulo the world size, so on the
    saving layout each rank checks what it wrote and will read), and a
    problem found by any rank is raised by every rank with the same message.
    """
    if comm is None or comm.Get_size() == 1:
        return Checkpoint(_resolve(path), verify=verify)
    rank, size = comm.Get_rank(), comm.Get_size()
    ck, error = None, None
    try:
        ck = Checkpoint(_resolve(path), verify=False)
        if verify:
            ck.verify(files={rel for rel in ck.shard_sha256 if verifier_of(rel, size) == rank})
    except CheckpointError as e:
        error = str(e)
    errors = [e for e in comm.allgather(error) if e is not None]
    if errors:
        if ck is not None:
            ck.close()
        raise CheckpointError(errors[0])
    return ck


def verifier_of(rel: str, size: int) -> int:
    """The rank (of ``size``) that hashes the file ``rel`` of a checkpoint."""
    digits = "".join(c for c in Path(rel).stem if c.isdigit())
    return int(digits) % size if digits else zlib.crc32(rel.encode()) % size
