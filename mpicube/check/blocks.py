"""A sharded tensor's blocks read from its group and put together: the
reading and merging that shards.py (blocks with global indices) and
placements.py (blocks that are also parts of pending sums) share."""

from __future__ import annotations

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
