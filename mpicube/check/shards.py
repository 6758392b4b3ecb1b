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

import math
from dataclasses import dataclass

import numpy as np

from ..core.errors import UserError


@dataclass
class Shard:
    """One rank's block: ``index`` per dimension (integer arrays or slices)."""

    rank: int
    index: tuple
    data: np.ndarray


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
        data = np.asarray(shard.data, dtype=dtype)
        member.create_dataset("data", data=data)
        for d, (ix, n) in enumerate(zip(shard.index, tensor.shape)):
            ix = np.arange(n)[ix] if isinstance(ix, slice) else np.asarray(ix, dtype=np.int64)
            if ix.shape != (data.shape[d],):
                raise UserError(f"{g.name.lstrip('/')}/{member.name.rsplit('/', 1)[-1]}: index {d} has "
                                f"{ix.size} entries for a block {data.shape[d]} long")
            member.create_dataset(f"index_{d}", data=ix)


class Problem(str):
    """A sharded tensor's divergence, said in words, and for replicas that
    part their largest difference as numbers (``max_abs``, ``max_rel``:
    inf where there is none, as for elements no rank holds), so that the
    comparison's row and its --json line report the disagreement's size
    rather than inf and null."""

    def __new__(cls, text: str, max_abs: float = float("inf"), max_rel: float = float("inf")):
        made = super().__new__(cls, text)
        made.max_abs, made.max_rel = max_abs, max_rel
        return made


def stored_shape(obj, path) -> tuple:
    """The shape a dataset holds, or a sharded group declares (its
    ``shape`` attribute, checked: non-negative integers), read without
    reading any data."""
    if not is_sharded(obj):
        return tuple(obj.shape)
    raw = obj.attrs.get("shape", ())
    try:
        shape = tuple(int(n) for n in np.atleast_1d(raw)) if np.size(raw) else ()
        ok = np.asarray(raw).dtype.kind in "iu" and all(n >= 0 for n in shape) and len(shape) <= 32
    except (TypeError, ValueError, OverflowError):
        ok = False
    if not ok:
        raise UserError(f"{path}: sharded tensor {obj.name.lstrip('/')}: its 'shape' attribute "
                        f"{str(raw)[:60]!r} is not a list of sizes")
    return shape


def assemble(group, path, rtol: float, atol: float):
    """(tensor, problem or "") from a sharded group: the logical tensor,
    and a divergence to report - elements no rank holds, or replicas that
    part by more than ``atol + rtol * scale`` (naming the ranks). A block
    that cannot be placed is bad input."""
    name = group.name.lstrip("/")
    shape = stored_shape(group, path)
    work = shape or (1,)                              # a scalar (a replicated loss) as one element
    members = _members(group, path, name, len(shape))
    stored = sum(member["data"].size for _, member in members)
    if stored < math.prod(work):                      # said before anything of the declared size is allocated
        return None, (f"at least {math.prod(work) - stored:,} elements held by no rank ({math.prod(work):,} "
                      f"declared, {stored:,} stored by the shards)")
    full = seen = owner = None                        # owner: per element, the rank that first wrote it
    problem = ""
    for key, member in members:
        data = member["data"][()]
        if data.ndim != len(shape):
            raise UserError(f"{path}: {name}/{key}: a {data.ndim}-d block of a {len(shape)}-d tensor")
        index = []
        for d, n in enumerate(shape):
            if f"index_{d}" not in member:
                raise UserError(f"{path}: {name}/{key}: no index_{d} for a tensor of shape {shape}")
            stored_ix = member[f"index_{d}"]
            if not hasattr(stored_ix, "shape") or stored_ix.shape != (data.shape[d],) or stored_ix.dtype.kind not in "iu":
                raise UserError(f"{path}: {name}/{key}: index_{d} does not fit a block {data.shape} "
                                f"of a tensor {shape}")
            ix = stored_ix[()].astype(np.int64)
            if ix.size and (ix.min() < 0 or ix.max() >= n):
                raise UserError(f"{path}: {name}/{key}: index_{d} does not fit a block {data.shape} "
                                f"of a tensor {shape}")
            index.append(ix)
        if not shape:
            data, index = data.reshape(1), [np.zeros(1, dtype=np.int64)]
        if full is None:
            full = np.zeros(work, dtype=data.dtype)
            seen = np.zeros(work, dtype=bool)
            owner = np.full(work, -1, dtype=np.int64)
        target = np.ix_(*index)
        rank = int(member.attrs.get("rank", -1))
        again = seen[target]
        if not problem and again.any():               # a replica: it must agree with the copy already placed
            mine, theirs = data[again].astype(np.float64), full[target][again].astype(np.float64)
            diff = np.abs(mine - theirs)
            scale = max(float(np.abs(mine).max()), float(np.abs(theirs).max()))
            if not (np.isfinite(diff).all() and float(diff.max()) <= atol + rtol * scale):
                other = int(owner[target][again][int(np.argmax(np.where(np.isfinite(diff), diff, np.inf)))])
                largest = float(np.nanmax(diff)) if np.isfinite(diff).any() else float("inf")
                worst = largest / scale if scale > 0 else float("inf")
                problem = Problem(f"replicas part: ranks {other} and {rank} differ by max rel {worst:.2e}",
                                  largest if np.isfinite(scale) else float("inf"), worst)
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
        problem = Problem(f"{int((~seen).sum())} elements held by no rank, first {at}")
    return full.reshape(shape), problem


def _members(group, path, name: str, ndim: int) -> list:
    """[(key, member group)] in rank order, each checked from its metadata
    alone: a group holding a ``data`` dataset of ``ndim`` dimensions."""
    import h5py

    members = []
    for key in group:
        member = group[key]
        if not isinstance(member, h5py.Group) or not isinstance(member.get("data"), h5py.Dataset):
            raise UserError(f"{path}: {name}/{key}: no 'data' in a shard")
        if member["data"].ndim != ndim:
            raise UserError(f"{path}: {name}/{key}: a {member['data'].ndim}-d block of a {ndim}-d tensor")
        try:
            rank = int(member.attrs.get("rank", -1))
        except (TypeError, ValueError, OverflowError):
            raise UserError(f"{path}: {name}/{key}: its 'rank' attribute is not an integer") from None
        members.append(((rank, key), member))
    return [(key, member) for (_, key), member in sorted(members, key=lambda m: m[0])]
