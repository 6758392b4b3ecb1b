"""Where a checkpoint's bytes come from: the trust check of docs/design.md section 6.

A checkpoint is untrusted input, and HDF5 reads far more than the files a
checkpoint lists. Left to itself it follows, without a word:

* external links (``checkpoint.h5``'s links to the index files) to any
  path, absolute or ``../..``, and soft links to anything they name;
* raw *external storage* (``h5py``'s ``external=``): a dataset whose bytes
  are any file at all, ``/etc/passwd`` as well as a shard;
* virtual-dataset sources anywhere; a missing source reads as fill values
  (zeros), and a relative source that is not beside the file holding the
  dataset is looked for in the current directory instead;
* a source dataset that is itself virtual or external, a source selection
  past the end of its dataset, a mapping that leaves part of the tensor
  unmapped, a dataset whose storage was never written: all read as zeros.

So before the bytes of a tensor are read, its path from ``checkpoint.h5`` is
checked here: hard links only, but for a tensor's final external link into
one of the listed index files; contiguous, chunked or compact storage, fully
written, or a virtual dataset whose every source is a hard-linked, fully
written, non-virtual dataset of a *listed* file (a key of ``shard_sha256``),
that resolves, relative to the file holding the mapping and with symbolic
links followed, to a regular file inside the step directory; the mappings
cover the tensor exactly once. HDF5 then finds each source beside the file
that maps it, where it was just seen.

The checks return problems as lines of text rather than raising, so that
``mpicube inspect`` lists them all; a reader raises the first one.
"""

from __future__ import annotations

import math
import os
import stat
from pathlib import Path

import h5py
import numpy as np
from h5py import h5s

from ...core.h5trust import link_problem, stored_problem  # noqa: F401 - the shared rule, used here and by read.py
from .format import CheckpointError
from .meta import check_cover

FILES_OPEN = 64             # listed files Bounds keeps open at once (HDF5 opens the sources again to read them)


def lexical_problem(rel) -> str | None:
    """Why ``rel`` (a file name from checkpoint.h5) cannot name a file of
    the step directory by its spelling alone, or None: it must be a
    normalized relative path without ``..`` (and without ``%``, which HDF5
    expands in virtual source names)."""
    if not isinstance(rel, str) or not rel or "\0" in rel:
        return f"file name {rel!r} is empty or not text"
    if os.path.isabs(rel) or os.path.normpath(rel) != rel or rel.split("/")[0] == "..":
        return f"file name {rel!r} is not a plain path inside the checkpoint directory"
    if "%" in rel:
        return f"file name {rel!r} holds '%' (an HDF5 source-name pattern)"
    return None


class Bounds:
    """The files a checkpoint may read: those its ``shard_sha256`` lists,
    found inside its step directory. Opens listed files (once each) to
    check the datasets that virtual datasets map."""

    def __init__(self, step_dir, listed):
        self.dir = Path(step_dir)
        self.root = os.path.realpath(self.dir)
        self.listed = set(listed)
        self._open: dict[str, h5py.File] = {}
        self._sources: dict[tuple, tuple] = {}      # (file, dataset) -> (shape, dtype) or a problem str

    def file_problem(self, rel: str, must_exist: bool = False) -> str | None:
        """Why the listed file ``rel`` may not be read, or None. A missing
        file is left to the sha256 check, unless ``must_exist``."""
        why = lexical_problem(rel)
        if why is not None:
            return f"{self.dir}: checkpoint.h5 lists a {why}"
        p = self.dir / rel
        real = os.path.realpath(p)
        if os.path.commonpath([real, self.root]) != self.root:
            return f"{p}: resolves to {real}, outside the checkpoint directory {self.root}"
        try:
            mode = os.stat(real).st_mode
        except FileNotFoundError:
            return f"{p}: shard file is missing (tensors stored in it would read as zeros)" if must_exist else None
        except OSError as e:
            return f"{p}: cannot read it ({e.strerror})"
        return None if stat.S_ISREG(mode) else f"{p}: not a regular file"

    def listing_problems(self) -> list[str]:
        return [p for p in (self.file_problem(rel) for rel in sorted(self.listed, key=str)) if p]

    def resolve(self, holder: str, name, what: str) -> tuple[str | None, str | None]:
        """(relative path, problem) of the file ``name`` that a link or
        mapping in the listed file ``holder`` points to: relative to
        ``holder``'s directory, one of the listed files, there."""
        if not isinstance(name, str) or os.path.isabs(name):
            return None, f"{what} points to {name!r}, outside the checkpoint directory"
        rel = os.path.normpath(os.path.join(os.path.dirname(holder), name))
        if lexical_problem(rel) is not None:
            return None, f"{what} points to {name!r}, outside the checkpoint directory {self.root}"
        if rel not in self.listed:
            return None, f"{what} points to {rel}, which is not one of the files checkpoint.h5 lists"
        return rel, self.file_problem(rel, must_exist=True)

    def open(self, rel: str) -> h5py.File:
        """The listed file ``rel``, kept open among the last FILES_OPEN used."""
        f = self._open.pop(rel, None)
        if f is None:
            f = h5py.File(self.dir / rel, "r", locking=False)
            while len(self._open) >= FILES_OPEN:
                self._open.pop(next(iter(self._open))).close()
        self._open[rel] = f
        return f

    def close(self) -> None:
        for f in self._open.values():
            f.close()
        self._open.clear()


def tensor_problems(bounds: Bounds, holder: str, ds: h5py.Dataset, what: str) -> tuple[list, list]:
    """(problems, source files) of a tensor's dataset ``ds``, in the listed
    file ``holder`` (or checkpoint.h5): stored in its own file, or virtual
    over sources that ``source_problem`` accepts, covering it once."""
    try:
        if not ds.is_virtual:
            return [p for p in [stored_problem(ds, what)] if p], []
        return _virtual_problems(bounds, holder, ds, what)
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - a damaged property list
        return [f"{what}: cannot read its storage description: {e}"], []


def _virtual_problems(bounds: Bounds, holder: str, ds: h5py.Dataset, what: str) -> tuple[list, list]:
    dcpl = ds.id.get_create_plist()
    problems, files, lo, hi = [], [], [], []
    for i in range(dcpl.get_virtual_count()):
        rel, why = bounds.resolve(holder, dcpl.get_virtual_filename(i), f"{what}: virtual source {i}")
        if why is None:
            files.append(rel)
            why = _mapping_problem(bounds, rel, dcpl, i, ds, what)
        if why is not None:
            problems.append(why)
            continue
        blocks = dcpl.get_virtual_vspace(i).get_select_hyper_blocklist()      # (n, 2, ndim), ends inclusive
        lo.append(blocks[:, 0, :])
        hi.append(blocks[:, 1, :] + 1)
    if not problems and ds.size:
        problems += _cover_problem(ds, what, lo, hi)
    return problems, files


def _mapping_problem(bounds: Bounds, rel: str, dcpl, i: int, ds: h5py.Dataset, what: str) -> str | None:
    """Why mapping ``i`` of ``ds`` does not read real data of ``rel``, or None."""
    dset = dcpl.get_virtual_dsetname(i)
    src = source_problem(bounds, rel, dset)
    if isinstance(src, str):
        return f"{what}: virtual source {rel}:{dset}: {src}"
    shape, dtype = src
    if dtype != ds.dtype:
        return f"{what}: virtual source {rel}:{dset} is {dtype}, the tensor {ds.dtype}"
    vspace, sspace = dcpl.get_virtual_vspace(i), dcpl.get_virtual_srcspace(i)
    if vspace.get_select_type() != h5s.SEL_HYPERSLABS:
        return f"{what}: virtual mapping {i} is not a hyperslab selection"
    if sspace.get_select_type() == h5s.SEL_ALL:
        fits = vspace.get_select_npoints() == math.prod(shape)
    else:
        start, end = sspace.get_select_bounds()
        fits = (len(end) == len(shape) and all(e < n for e, n in zip(end, shape))
                and sspace.get_select_npoints() == vspace.get_select_npoints())
    return None if fits else f"{what}: virtual mapping {i} reads past the end of {rel}:{dset} {shape}"


def source_problem(bounds: Bounds, rel: str, dset) -> tuple | str:
    """(shape, dtype) of dataset ``dset`` of the listed file ``rel`` if a
    virtual source may read it (hard links, stored in ``rel`` itself),
    else the problem; cached per (file, dataset)."""
    key = (rel, dset)
    if key not in bounds._sources:
        bounds._sources[key] = _source(bounds, rel, dset)
    return bounds._sources[key]


def _source(bounds: Bounds, rel: str, dset) -> tuple | str:
    if not isinstance(dset, str) or not dset or "%" in dset:
        return f"dataset name {dset!r} is empty or holds '%'"
    try:
        f = bounds.open(rel)
        why = link_problem(f, dset.lstrip("/"), "dataset", final_external=False)
        if why is not None:
            return why
        ds = f.get(dset)
        if not isinstance(ds, h5py.Dataset):
            return "is missing (would read as zeros)" if ds is None else "is not a dataset"
        if ds.is_virtual:
            return "is itself a virtual dataset (sources are stored data)"
        why = stored_problem(ds, "dataset")
        return why if why is not None else (tuple(ds.shape), ds.dtype)
    except Exception as e:  # noqa: BLE001 - an unreadable shard is a problem, not a crash
        return f"cannot open it: {e}"


def _cover_problem(ds: h5py.Dataset, what: str, lo: list, hi: list) -> list:
    """The mappings must cover every element once: an unmapped element
    reads as the fill value, silently."""
    nd = len(ds.shape)
    lo = np.concatenate(lo) if lo else np.zeros((0, nd), np.int64)
    hi = np.concatenate(hi) if hi else np.zeros((0, nd), np.int64)
    try:
        check_cover(ds.name, tuple(ds.shape), lo.astype(np.int64), hi.astype(np.int64),
                    np.zeros(len(lo), np.int64))
    except CheckpointError:
        return [f"{what}: its virtual mappings do not cover every element exactly once "
                "(an unmapped element would read as zero)"]
    return []
