"""What each rank says about its blocks, and the merge of it per tensor.

A writer block becomes one *piece*: the dataset it was stored as in the
rank's shard, its boxes (the product of the runs of consecutive global
indices it covers per dimension: a c_attn column block is three runs) and
its virtual-dataset mappings. Each tensor has an *owner* rank, found from
its name alone; every rank sends each owner the pieces of its tensors, and
the owner merges them and checks that each element has exactly one
writer. So the merge of a 512-rank save's 200,000 pieces is spread over
the ranks instead of falling on rank 0.
"""

from __future__ import annotations

import math
import zlib

import numpy as np

from .format import Block, CheckpointError, _MAX_COVER_CELLS, _as_index, _fmt_shape, _runs


def check_name(name, what: str) -> None:
    if not isinstance(name, str) or not name or name.startswith("/") or any(
            p in ("", ".", "..") for p in name.split("/")):
        raise CheckpointError(f"{what}: bad tensor name {name!r}")


def prepare_block(b: Block, what: str, cache: dict | None = None):
    """Validate a block; return (shape, dtype, stored array or None, runs per dim).

    ``stored`` is the block without its padding (a view where the kept
    positions are contiguous); ``runs[d]`` is an (n, 3) array of (global
    start, local start, length) of the kept positions along dimension d.
    ``cache`` (a dict kept by the caller while the blocks live) reuses the
    work per index array: a parameter and its two moments share theirs."""
    check_name(b.name, what)
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
    dims = [_dim(ix, d, shape[d], what, cache) for d, ix in enumerate(index)]
    if tuple(len(i) for i, _, _ in dims) != local.shape:
        raise CheckpointError(
            f"{what}: local array shape {local.shape} != index lengths "
            f"{tuple(len(i) for i, _, _ in dims)}")
    if not b.writer:
        return shape, local.dtype, None, None
    sel = [s for _, s, _ in dims]
    if all(isinstance(s, slice) for s in sel):
        stored = local[tuple(sel)]
    else:
        stored = local[np.ix_(*[np.arange(s.start, s.stop) if isinstance(s, slice) else s for s in sel])]
    return shape, local.dtype, stored, [r for _, _, r in dims]


def _dim(ix, d: int, n: int, what: str, cache) -> tuple:
    """(index, kept local positions as a slice or array, runs) of one dimension of length n."""
    key = (id(ix), n)
    if cache is not None and key in cache and cache[key][0] is ix:
        return cache[key][1]
    i = _as_index(ix, d, what)
    if i.size > 1 and not np.all(np.diff(i) > 0) and np.unique(i).size != i.size:
        raise CheckpointError(f"{what}: index for dim {d} has repeated values")
    pos = np.nonzero(i < n)[0]
    keep = slice(int(pos[0]), int(pos[-1]) + 1) if pos.size and pos[-1] - pos[0] + 1 == pos.size else pos
    out = (i, keep, _runs(i[pos]))
    if cache is not None:
        cache[key] = (ix, out)
    return out


def box_corners(runs: list) -> tuple:
    """(lo, hi), each (n_boxes, ndim): the boxes of the product of per-dim runs."""
    grids = np.meshgrid(*[r[:, 0] for r in runs], indexing="ij")
    sizes = np.meshgrid(*[r[:, 2] for r in runs], indexing="ij")
    lo = np.stack([g.reshape(-1) for g in grids], axis=1).astype(np.int64)
    return lo, lo + np.stack([s.reshape(-1) for s in sizes], axis=1)


def _regular(runs: np.ndarray) -> list:
    """Runs (n, 3) of one dimension as regular patterns (start, stride,
    count, block): maximal stretches of equal-length runs at equal spacing
    (the three runs of a c_attn column block are one)."""
    out, k, n = [], 0, len(runs)
    while k < n:
        start, length = int(runs[k, 0]), int(runs[k, 2])
        m = k + 1
        stride = int(runs[m, 0]) - start if m < n else 1
        while m < n and int(runs[m, 2]) == length and int(runs[m, 0]) - int(runs[m - 1, 0]) == stride:
            m += 1
        if m == k + 1:
            stride = 1
        out.append((start, stride, m - k, length))
        k = m
    return out


def mappings(runs: list) -> list:
    """How a stored piece maps into its tensor, as few virtual-dataset
    mappings as possible: a list of (virtual, source, stored shape), the
    selections each a list of regular hyperslabs (start, stride, count,
    block) whose union is selected; source ``None`` for the whole stored
    dataset.

    HDF5 pairs the elements of the two selections in row-major order, so
    when the global positions ascend with the local ones (every layout's
    blocks do) one mapping covers the piece: its virtual selection is the
    union of the product of each dimension's regular patterns. Otherwise
    one mapping per box of runs, each with its own source box."""
    stored = tuple(int(r[:, 2].sum()) for r in runs)
    if all(np.all(np.diff(r[:, 0]) > 0) for r in runs):
        per_dim = [_regular(r) for r in runs]
        return [([tuple(zip(*combo)) for combo in _product(per_dim)], None, stored)]
    out = []
    ones = (1,) * len(runs)
    for combo in _product([r.tolist() for r in runs]):
        length = tuple(c[2] for c in combo)
        out.append(([(tuple(c[0] for c in combo), ones, ones, length)],
                    [(tuple(c[1] for c in combo), ones, ones, length)], stored))
    return out


def _product(lists: list) -> list:
    out = [()]
    for options in lists:
        out = [prev + (o,) for prev in out for o in options]
    return out


def check_cover(name: str, shape: tuple, lo: np.ndarray, hi: np.ndarray, owner: np.ndarray) -> None:
    """Every element of the tensor written by exactly one writer block.

    lo, hi (n, nd): the writer boxes; owner (n,): the rank of each. The
    boxes' edges cut the tensor into a grid of cells; a difference array
    over that grid counts the writers of every cell at once."""
    if lo.shape[0] == 0:
        raise CheckpointError(f"tensor {name!r} {_fmt_shape(shape)}: no rank holds it with writer=True")
    nd = len(shape)
    coords = [np.unique(np.concatenate([[0, shape[d]], lo[:, d], hi[:, d]])) for d in range(nd)]
    cells = math.prod(len(c) - 1 for c in coords)
    if cells > _MAX_COVER_CELLS:       # too fragmented to grid: volume check only
        vol = int(np.prod(hi - lo, axis=1).sum())
        if vol != math.prod(shape):
            raise CheckpointError(
                f"tensor {name!r} {_fmt_shape(shape)}: writer blocks cover {vol} elements, "
                f"expected {math.prod(shape)} (each element needs exactly one writer)")
        return
    a = np.stack([np.searchsorted(coords[d], lo[:, d]) for d in range(nd)], axis=1)   # (n, nd) first cell
    b = np.stack([np.searchsorted(coords[d], hi[:, d]) for d in range(nd)], axis=1)   # (n, nd) past the last
    diff = np.zeros([len(c) for c in coords], np.int64)
    for corner in range(1 << nd):                # inclusion-exclusion over the 2^nd corners of each box
        pick = [(corner >> d) & 1 for d in range(nd)]
        at = tuple(np.where(pick[d], b[:, d], a[:, d]) for d in range(nd))
        np.add.at(diff, at, (-1) ** sum(pick))
    for d in range(nd):
        diff = np.cumsum(diff, axis=d)
    grid = diff[tuple(slice(0, len(c) - 1) for c in coords)]
    bad = np.argwhere(grid != 1)
    if not bad.size:
        return
    cell = tuple(int(c) for c in bad[0])
    at = tuple(int(coords[d][cell[d]]) for d in range(nd))
    n = int(grid[cell])
    if n == 0:
        raise CheckpointError(
            f"tensor {name!r} {_fmt_shape(shape)}: element {at} is not written by any "
            "rank (no block with writer=True covers it)")
    inside = np.all((lo <= np.asarray(at)) & (np.asarray(at) < hi), axis=1)
    raise CheckpointError(
        f"tensor {name!r} {_fmt_shape(shape)}: element {at} is written {n} times "
        f"(by ranks {sorted(set(owner[inside].tolist()))}); exactly one replica of each block must have writer=True")


def piece_meta(name: str, shape: tuple, dtype, dset, runs, cache: dict | None = None) -> tuple:
    """One writer piece as its rank sends it to the tensor's owner: the
    entry of ``assemble``, with its boxes and mappings computed by the
    writer. ``cache`` reuses them for blocks with the same runs."""
    key = tuple(id(r) for r in runs)
    hit = cache.get(key) if cache is not None else None
    if hit is None or any(a is not b for a, b in zip(hit[0], runs)):
        hit = (runs, box_corners(runs), mappings(runs))
        if cache is not None:
            cache[key] = hit
    return (name, shape, np.dtype(dtype).str, True, dset, hit[1], hit[2] if dset is not None else None, None)


def owner_of(name: str, size: int) -> int:
    """The rank (of ``size``) that merges and indexes tensor ``name``:
    a hash of the name, so every rank knows it without asking."""
    return zlib.crc32(name.encode()) % size


def route(entries: list, size: int) -> list:
    """A rank's entries sorted into one list per owner rank (for alltoall)."""
    out = [[] for _ in range(size)]
    for e in entries:
        out[owner_of(e[0], size)].append(e)
    return out


def assemble(received) -> dict:
    """Merge the entries of the tensors this rank owns into {name: tensor description}.

    ``received[rank]`` is (entries, shard file) from that rank; an entry is
    (name, shape, dtype, writer, dataset, boxes, mappings, scalar value) as
    ``write.describe_blocks`` makes it. A description holds the shape,
    dtype, the pieces (rank, shard file, dataset, mappings) and, for 0-d
    tensors, the value."""
    tensors: dict[str, dict] = {}
    for rank, (entries, rel) in enumerate(received):
        for name, shape, dtype, writer, dset, boxes, maps, scalar in entries:
            t = tensors.get(name)
            if t is None:
                t = tensors[name] = {"shape": shape, "dtype": dtype, "pieces": [], "boxes": [], "scalar": []}
            elif t["shape"] != shape:
                raise CheckpointError(
                    f"tensor {name!r}: ranks disagree on its logical shape "
                    f"({_fmt_shape(t['shape'])} vs {_fmt_shape(shape)} on rank {rank})")
            elif t["dtype"] != dtype and np.dtype(t["dtype"]) != np.dtype(dtype):
                raise CheckpointError(
                    f"tensor {name!r}: ranks disagree on its dtype "
                    f"({np.dtype(t['dtype'])} vs {np.dtype(dtype)} on rank {rank})")
            if not writer:
                continue
            if len(shape) == 0:
                t["scalar"].append((rank, scalar))
                continue
            t["boxes"].append((rank, boxes))
            if dset is not None:
                t["pieces"].append((rank, rel, dset, maps))
    for name, t in tensors.items():
        if len(t["shape"]) == 0:
            if len(t["scalar"]) != 1:
                raise CheckpointError(
                    f"tensor {name!r} (scalar): written by {len(t['scalar'])} ranks "
                    f"{[r for r, _ in t['scalar']]}; exactly one must have writer=True")
        elif math.prod(t["shape"]) > 0:
            boxes = t["boxes"]
            nd = len(t["shape"])
            lo = np.concatenate([b[0] for _, b in boxes]) if boxes else np.zeros((0, nd), np.int64)
            hi = np.concatenate([b[1] for _, b in boxes]) if boxes else np.zeros((0, nd), np.int64)
            owner = np.concatenate([np.full(len(b[0]), r) for r, b in boxes]) if boxes else np.zeros(0, np.int64)
            check_cover(name, t["shape"], lo, hi, owner)
        del t["boxes"]
    return tensors
