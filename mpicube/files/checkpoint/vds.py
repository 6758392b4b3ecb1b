"""The virtual datasets of a checkpoint, written by the ranks that own them.

``index/rank_XXXXX.h5`` (one per rank that owns tensors) holds, for each
tensor that rank owns, a virtual dataset with one mapping per stored piece
(a rank's block, however many runs it spans) into ``shards/rank_YYYYY.h5``.
``checkpoint.h5`` names every tensor by an external link to its index
dataset. HDF5 follows the link and the mappings, relative to the files'
own directories, so a reader still opens checkpoint.h5 alone and sees
whole tensors, wherever the directory was moved.

Why: a 3-D job of 512 ranks saves some 200,000 pieces. Written into one
file by rank 0, they cost it half a minute (growing with the number of
ranks); spread over the ranks, each writes the mappings of a few tensors,
and rank 0 writes a link per tensor (a link costs a fraction of a dataset
header). The mappings are made with h5py's low-level API: the high-level
``VirtualLayout`` spends a Python round of selections on every run.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import h5py
import numpy as np
from h5py import h5d, h5p, h5s, h5t

from . import h5create
from ..atomic import sync_fd
from .format import FORMAT, VERSION, CheckpointError, _encode_attr

INDEX_DIR = "index"


def index_rel(rank: int) -> str:
    return f"{INDEX_DIR}/rank_{rank:05d}.h5"


def _select(space, parts) -> None:
    """Select the union of regular hyperslabs (start, stride, count, block) in ``space``."""
    space.select_none()
    for start, stride, count, block in parts:
        space.select_hyperslab(start, count, stride, block, op=h5s.SELECT_OR)


def _create(f, name: str, shape: tuple, dtype: np.dtype, dcpl) -> None:
    lcpl = h5p.create(h5p.LINK_CREATE)
    lcpl.set_create_intermediate_group(True)
    h5d.create(f.id, name.encode(), h5t.py_create(dtype), h5s.create_simple(shape), dcpl=dcpl, lcpl=lcpl)


def _virtual_plist(dtype: np.dtype):
    dcpl = h5p.create(h5p.DATASET_CREATE)
    dcpl.set_fill_value(np.zeros((), dtype))
    return dcpl


def _fsync(path: Path) -> None:
    with open(path, "rb") as fh:
        sync_fd(fh.fileno())


def write_index(path: Path, tensors: dict) -> None:
    """An owner's index file: each of its tensors over the pieces of every
    rank (``tensors`` as ``meta.assemble`` returns them; pieces are
    (rank, shard file relative to the checkpoint, dataset, mappings))."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with h5create.create(path) as f:
        f.attrs["format"] = FORMAT + "-index"
        f.attrs["version"] = VERSION
        for name in sorted(tensors):
            t = tensors[name]
            if not t["pieces"]:
                continue
            shape, dtype = t["shape"], np.dtype(t["dtype"])
            dcpl = _virtual_plist(dtype)
            vspace = h5s.create_simple(shape)
            whole = {}                            # stored shape -> a dataspace selecting all of it
            for _, rel, dset, maps in t["pieces"]:
                file_b, dset_b = f"../{rel}".encode(), dset.encode()
                for virtual, source, stored in maps:
                    _select(vspace, virtual)
                    if source is None:
                        sspace = whole.get(stored)
                        if sspace is None:
                            sspace = whole[stored] = h5s.create_simple(stored)
                    else:
                        sspace = h5s.create_simple(stored)
                        _select(sspace, source)
                    dcpl.set_virtual(vspace, file_b, dset_b, sspace)
            try:
                _create(f, name, shape, dtype, dcpl)
            except (ValueError, TypeError, KeyError, OSError, RuntimeError) as e:
                raise CheckpointError(f"tensor {name!r}: cannot create it in {path}: {e}") from e
    _fsync(path)


def verify_index(path: Path, tensors: dict) -> None:
    """The owner's check of the index file it wrote: every tensor present
    with its shape and dtype, as many mappings as it wrote, each into a
    shard some rank wrote, together covering the tensor once (the element
    counts add up; the merge checked that no element has two writers)."""
    with h5py.File(path, "r", locking=False) as f:
        for name, t in tensors.items():
            if not t["pieces"]:
                continue
            shape, n_maps = tuple(t["shape"]), sum(len(p[3]) for p in t["pieces"])
            files = {f"../{p[1]}" for p in t["pieces"]}
            ds = f.get(name)
            if not isinstance(ds, h5py.Dataset) or ds.shape != shape or ds.dtype != np.dtype(t["dtype"]):
                raise CheckpointError(f"{path}: tensor {name!r} missing or not {np.dtype(t['dtype'])} {shape}")
            dcpl = ds.id.get_create_plist()
            count = dcpl.get_virtual_count() if ds.is_virtual else 0
            if count != n_maps:
                raise CheckpointError(f"{path}: tensor {name!r} has {count} virtual mappings, {n_maps} written")
            covered = 0
            for i in range(count):
                source = dcpl.get_virtual_filename(i)
                if source not in files:
                    raise CheckpointError(f"{path}: tensor {name!r}: source {source} is not one of its shards")
                points = dcpl.get_virtual_vspace(i).get_select_npoints()
                src = dcpl.get_virtual_srcspace(i)        # "all" is stored without the source's extent
                if src.get_select_type() != h5s.SEL_ALL and points != src.get_select_npoints():
                    raise CheckpointError(f"{path}: tensor {name!r}: mapping {i} pairs unequal selections")
                covered += points
            if covered != math.prod(shape):
                raise CheckpointError(f"{path}: tensor {name!r}: its mappings cover {covered} of "
                                      f"{math.prod(shape)} elements")


def write_main(path: Path, step: int, attrs: dict, tensors: dict, files: dict) -> None:
    """Rank 0: checkpoint.h5. ``tensors``: {name: (shape, dtype str, index
    file or None, 0-d value or None)}; ``files``: {relative path: (sha256,
    size)} of every shard and index file."""
    with h5create.create(path) as f:
        f.attrs["format"] = FORMAT
        f.attrs["version"] = VERSION
        f.attrs["step"] = step
        for k, v in attrs.items():
            f.attrs[k] = _encode_attr(k, v)
        f.attrs["tensors"] = json.dumps(sorted(tensors))
        f.attrs["shard_sha256"] = json.dumps({rel: d for rel, (d, _) in sorted(files.items())})
        for name in sorted(tensors):
            shape, dtype, index, value = tensors[name]
            dtype = np.dtype(dtype)
            shape = tuple(shape)
            try:
                if len(shape) == 0:
                    f.create_dataset(name, data=np.asarray(value, dtype=dtype))
                elif index is None:         # empty, or nothing but padding
                    f.create_dataset(name, shape=shape, dtype=dtype)
                else:
                    f[name] = h5py.ExternalLink(index, name)
            except (ValueError, TypeError, KeyError, OSError, RuntimeError) as e:
                raise CheckpointError(f"tensor {name!r}: cannot create it in {path}: {e}") from e
    _fsync(path)
