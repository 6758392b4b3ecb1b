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
from .blocks import Problem, is_sharded, merge, read_blocks, stored_shape, unheld  # noqa: F401 - the readers' names
from .placements import assemble_placed


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
    that cannot be placed is bad input. Shards that store fewer elements
    than the group declares give (None, problem), said from the metadata
    before any block is read (blocks.py). Blocks that carry placements
    (format version 3) go through placements.py, which sums pending sums
    first and checks the placements themselves."""
    short = unheld(group, path)
    if short:
        return None, short
    if any("placement" in group[k].attrs for k in group):
        return assemble_placed(group, path, rtol, atol)
    return merge(read_blocks(group, path), group, path, rtol, atol)
