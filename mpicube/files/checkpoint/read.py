"""Finding and opening checkpoints, and reading any block of any tensor."""

from __future__ import annotations

import itertools
import math
import zlib
from pathlib import Path

import h5py
import numpy as np

from .format import (CKPT_DIR, CheckpointError, FORMAT, LATEST, MAIN_FILE, VERSION, _MAX_READS, _STEP_RE,
                     _as_index, _decode_attr, _fmt_shape, _sha256_file)

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
    """A committed checkpoint opened for reading (see :func:`open_checkpoint`)."""

    def __init__(self, file: Path, verify: bool = True):
        self.file = Path(file)
        self.path = self.file.parent
        self._index = {}                 # relative path -> open index file, least recently used first
        self._links = {}                 # tensor name -> its link in checkpoint.h5
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

    def verify(self, files=None) -> None:
        """Check every tensor is present and every shard exists with its
        sha256; ``files``: only these of the shard files (a rank's share)."""
        for name in self._names:            # links are checked, not followed: their files are hashed below
            link = self._link(name)
            if link is None or (not isinstance(link, h5py.ExternalLink)
                                and not isinstance(self._f.get(name), h5py.Dataset)):
                raise CheckpointError(f"{self.file}: tensor {name!r} is missing")
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
        try:
            link = self._link(name)
            if not isinstance(link, h5py.ExternalLink):
                return self._f[name]
            return self._index_file(link.filename)[link.path]
        except Exception as e:  # noqa: BLE001 - a link to a missing or damaged index file
            raise CheckpointError(f"{self.file}: tensor {name!r} is unreadable: {e}") from e

    def _link(self, name: str):
        """The link of tensor ``name`` in checkpoint.h5 (an ExternalLink to
        its index dataset, or a HardLink), None if there is none; cached."""
        if name not in self._links:
            self._links[name] = self._f.get(name, getlink=True)
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
