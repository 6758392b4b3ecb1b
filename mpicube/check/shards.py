"""Sharded tensors in a trace: each rank's block with its global index,
put back together, and replicas checked against each other.

A framework that shards a tensor over ranks (tensor parallelism, FSDP,
sequence parallelism) can write each rank's block instead of gathering
the logical tensor first. That is more than a convenience: a tensor that
is *replicated* (a LayerNorm weight's gradient under sequence parallelism,
a bias under tensor parallelism) is computed on several ranks, and a bug
that forgets to reduce it makes the copies drift apart - invisible when
one rank's copy is written, named here with the ranks that part.

In the file a sharded tensor is a group where the dataset would be, with
attributes ``sharded`` = 1 and ``shape`` (the logical shape); each member
group holds one block: attribute ``rank``, dataset ``data`` (the local
block) and datasets ``index_0``, ``index_1``, ... (the global indices
along each dimension: ``data[i0, i1, ...]`` is element
``(index_0[i0], index_1[i1], ...)``). Every element must be held by some
rank; an element held by several must agree between them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..core.errors import UserError


@dataclass
class Shard:
    """One rank's block: ``index`` per dimension (integer arrays or slices)."""

    rank: int
    index: tuple
    data: np.ndarray
    placement: tuple = None     # per mesh axis "R", "S(d)", "P" or "-" (placements.py); None: not recorded
    coords: tuple = None        # the rank's coordinate on each mesh axis


@dataclass
class Sharded:
    """A logical tensor given as shards, for ``TraceWriter`` (writer.py)."""

    shape: tuple
    shards: list


def is_sharded(obj) -> bool:
    """Whether an h5py object is a sharded tensor's group."""
    return not hasattr(obj, "shape") and bool(obj.attrs.get("sharded", 0))


def write(group_parent, name: str, tensor: Sharded, dtype) -> None:
    """Write ``tensor`` as the group ``name`` under ``group_parent`` (an h5py File or Group)."""
    g = group_parent.create_group(name)
    g.attrs["sharded"] = 1
    g.attrs["shape"] = np.asarray(tensor.shape, dtype=np.int64)
    counts = {}
    for shard in tensor.shards:
        k = counts[shard.rank] = counts.get(shard.rank, -1) + 1
        member = g.create_group(f"rank{shard.rank}" + (f"_{k}" if k else ""))
        member.attrs["rank"] = int(shard.rank)
        if shard.placement is not None:                 # format version 3 (placements.py)
            member.attrs["placement"] = ",".join(shard.placement)
            member.attrs["coords"] = np.asarray(shard.coords, dtype=np.int64)
        data = np.asarray(shard.data, dtype=dtype)
        member.create_dataset("data", data=data)
        for d, (ix, n) in enumerate(zip(shard.index, tensor.shape)):
            ix = np.arange(n)[ix] if isinstance(ix, slice) else np.asarray(ix, dtype=np.int64)
            if ix.shape != (data.shape[d],):
                raise UserError(f"{g.name.lstrip('/')}/{member.name.rsplit('/', 1)[-1]}: index {d} has "
                                f"{ix.size} entries for a block {data.shape[d]} long")
            member.create_dataset(f"index_{d}", data=ix)


def assemble(group, path, rtol: float, atol: float):
    """(tensor, problem or "") from a sharded group: the logical tensor,
    and a divergence to report - elements no rank holds, or replicas that
    part by more than ``atol + rtol * scale`` (naming the ranks). A block
    that cannot be placed is bad input. Blocks that carry placements
    (format version 3) go through placements.py, which sums pending sums
    first and checks the placements themselves."""
    if any("placement" in group[k].attrs for k in group):
        from .placements import assemble_placed

        return assemble_placed(group, path, rtol, atol)
    return merge(read_blocks(group, path), group, path, rtol, atol)


def logical_shape(group) -> tuple:
    return tuple(int(n) for n in group.attrs.get("shape", ()))


def read_blocks(group, path) -> list:
    """[(member name, rank, index list, block)] of a sharded group, in rank
    order; a block whose index does not fit the logical shape is bad input."""
    name = group.name.lstrip("/")
    shape = logical_shape(group)
    blocks = []
    for key in sorted(group, key=lambda k: (int(group[k].attrs.get("rank", -1)), k)):
        member = group[key]
        if "data" not in member:
            raise UserError(f"{path}: {name}/{key}: no 'data' in a shard")
        data = member["data"][()]
        if data.ndim != len(shape):
            raise UserError(f"{path}: {name}/{key}: a {data.ndim}-d block of a {len(shape)}-d tensor")
        index = []
        for d, n in enumerate(shape):
            if f"index_{d}" not in member:
                raise UserError(f"{path}: {name}/{key}: no index_{d} for a tensor of shape {shape}")
            ix = member[f"index_{d}"][()].astype(np.int64)
            if ix.shape != (data.shape[d],) or (ix.size and (ix.min() < 0 or ix.max() >= n)):
                raise UserError(f"{path}: {name}/{key}: index_{d} does not fit a block {data.shape} "
                                f"of a tensor {shape}")
            index.append(ix)
        blocks.append((key, int(member.attrs.get("rank", -1)), index, data))
    return blocks


def merge(blocks, group, path, rtol: float, atol: float):
    """(tensor, problem or "") from ``read_blocks``' blocks: each placed at
    its index, a copy already placed checked against the first."""
    name = group.name.lstrip("/")
    shape = logical_shape(group)
    work = shape or (1,)                              # a scalar (a replicated loss) as one element
    full = seen = owner = None                        # owner: per element, the rank that first wrote it
    problem = ""
    for _, rank, index, data in blocks:
        if not shape:
            data, index = data.reshape(1), [np.zeros(1, dtype=np.int64)]
        if full is None:
            full = np.zeros(work, dtype=data.dtype)
            seen = np.zeros(work, dtype=bool)
            owner = np.full(work, -1, dtype=np.int64)
        target = np.ix_(*index)
        again = seen[target]
        if not problem and again.any():               # a replica: it must agree with the copy already placed
            mine, theirs = data[again].astype(np.float64), full[target][again].astype(np.float64)
            diff = np.abs(mine - theirs)
            scale = max(float(np.abs(mine).max()), float(np.abs(theirs).max()))
            if not (np.isfinite(diff).all() and float(diff.max()) <= atol + rtol * scale):
                other = int(owner[target][again][int(np.argmax(np.where(np.isfinite(diff), diff, np.inf)))])
                worst = float(np.nanmax(diff)) / scale if scale > 0 else float("inf")
                problem = f"replicas part: ranks {other} and {rank} differ by max rel {worst:.2e}"
        fresh = ~again
        if fresh.any():
            block = full[target]
            block[fresh] = data[fresh]
            full[target] = block
            mark = owner[target]
            mark[fresh] = rank
            owner[target] = mark
        seen[target] = True
    if full is None:
        raise UserError(f"{path}: {name}: a sharded tensor with no shards")
    if not seen.all() and not problem:
        at = tuple(int(i) for i in np.argwhere(~seen)[0])
        problem = f"{int((~seen).sum())} elements held by no rank, first {at}"
    return full.reshape(shape), problem
