"""A sharded tensor's blocks read from its group and put together: the
one reader of sharded groups, which shards.py (blocks with global
indices) and placements.py (blocks that are also parts of pending sums)
share.

A trace is untrusted input, and what it declares must not drive memory
(compare.py): the group's ``shape`` attribute is checked before anything
is read (``stored_shape``), each member from its metadata alone
(``members``), and a tensor whose shards store fewer elements than it
declares is a divergence said from that metadata (``unheld``), before
any block is read or anything of the declared size allocated; ``merge``
allocates the declared size only for blocks that hold at least as many
elements, so every reader's memory is what the file stores (which is
why a shard's block may not be compressed: ``members``).
"""

from __future__ import annotations

import math

import numpy as np

from ..core.errors import UserError


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


def is_sharded(obj) -> bool:
    """Whether an h5py object is a sharded tensor's group."""
    return not hasattr(obj, "shape") and bool(obj.attrs.get("sharded", 0))


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


def members(group, path) -> tuple:
    """(logical shape, [(key, rank, member group)] in rank order), each
    member checked from its metadata alone: a group holding a ``data``
    dataset of as many dimensions as the shape."""
    import h5py

    name = group.name.lstrip("/")
    shape = stored_shape(group, path)
    found = []
    for key in group:
        member = group[key]
        if not isinstance(member, h5py.Group) or not isinstance(member.get("data"), h5py.Dataset):
            raise UserError(f"{path}: {name}/{key}: no 'data' in a shard")
        if member["data"].ndim != len(shape):
            raise UserError(f"{path}: {name}/{key}: a {member['data'].ndim}-d block of a {len(shape)}-d tensor")
        if member["data"].id.get_create_plist().get_nfilters():   # a few KiB could declare any size
            raise UserError(f"{path}: {name}/{key}: its block is stored compressed (refused: a shard holds its "
                            "bytes uncompressed, so that putting a tensor together costs what the file holds)")
        try:
            rank = int(member.attrs.get("rank", -1))
        except (TypeError, ValueError, OverflowError):
            raise UserError(f"{path}: {name}/{key}: its 'rank' attribute is not an integer") from None
        found.append((rank, key, member))
    found.sort(key=lambda m: m[:2])
    return shape, [(key, rank, member) for rank, key, member in found]


def shortfall(shape: tuple, stored: int) -> str:
    """The divergence of a tensor of ``shape`` whose blocks hold ``stored``
    elements in all, when that is fewer than the shape has ("" otherwise):
    some element is then held by no rank, said without assembling it."""
    declared = math.prod(shape or (1,))              # a scalar (a replicated loss) as one element
    if stored >= declared:
        return ""
    return Problem(f"at least {declared - stored:,} elements held by no rank ({declared:,} declared, "
                   f"{stored:,} stored by the shards)")


def unheld(group, path) -> str:
    """``shortfall`` of a sharded group from its metadata alone."""
    shape, found = members(group, path)
    return shortfall(shape, sum(member["data"].size for _, _, member in found))


def read_blocks(group, path) -> list:
    """[(member name, rank, index list, block)] of a sharded group, in rank
    order, the metadata checked before any block is read (``members``); a
    block whose index does not fit the logical shape is bad input."""
    name = group.name.lstrip("/")
    shape, found = members(group, path)
    blocks = []
    for key, rank, member in found:
        data = member["data"]
        index = []
        for d, n in enumerate(shape):
            if f"index_{d}" not in member:
                raise UserError(f"{path}: {name}/{key}: no index_{d} for a tensor of shape {shape}")
            stored_ix = member[f"index_{d}"]
            if not hasattr(stored_ix, "shape") or stored_ix.shape != (data.shape[d],) or \
                    stored_ix.dtype.kind not in "iu":
                raise UserError(f"{path}: {name}/{key}: index_{d} does not fit a block {data.shape} "
                                f"of a tensor {shape}")
            ix = stored_ix[()].astype(np.int64)
            if ix.size and (ix.min() < 0 or ix.max() >= n):
                raise UserError(f"{path}: {name}/{key}: index_{d} does not fit a block {data.shape} "
                                f"of a tensor {shape}")
            index.append(ix)
        blocks.append((key, rank, index, data[()]))
    return blocks


def merge(blocks, group, path, rtol: float, atol: float):
    """(tensor, problem or "") from ``read_blocks``' blocks: each placed at
    its index, a copy already placed checked against the first. Blocks
    holding fewer elements than the declared shape give (None, problem)
    before anything of that size is allocated."""
    name = group.name.lstrip("/")
    shape = stored_shape(group, path)
    work = shape or (1,)                              # a scalar (a replicated loss) as one element
    if not blocks:
        raise UserError(f"{path}: {name}: a sharded tensor with no shards")
    short = shortfall(shape, sum(np.size(data) for _, _, _, data in blocks))
    if short:
        return None, short
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
    if not seen.all() and not problem:
        at = tuple(int(i) for i in np.argwhere(~seen)[0])
        problem = Problem(f"{int((~seen).sum())} elements held by no rank, first {at}")
    return full.reshape(shape), problem
