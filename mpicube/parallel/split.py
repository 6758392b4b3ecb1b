"""How a layout cuts one dimension of a parameter into blocks: plain
splits, stacked groups (c_attn's [q | k | v], SwiGLU's [gate | up]) each
split the same way, and grouped-query attention's kv heads, which a head
split finer than them replicates (``SharedColumns``). Pure index
arithmetic; ``params`` re-exports it for the layouts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from .comm import Comm


@dataclass(frozen=True)
class SharedColumns:
    """A run of a block's last-dimension positions that more ranks hold
    than the rest of the block: grouped-query attention's k and v columns
    when the head split exceeds the kv heads (each kv head is then held by
    the ``comm.size`` ranks whose query heads read it). Their gradients are
    partial sums over those ranks' query heads, summed over ``comm`` (after
    the block's own ``grad_comm``, if any); the norm counts them once;
    ``writer`` is True on one rank of ``comm``."""

    cols: slice                 # local positions along the last dimension
    comm: Comm                  # the ranks holding these same columns
    writer: bool = True

    @property
    def share(self) -> int:
        return self.comm.size


def split_index(n: int, parts: int, block: int, groups=1, heads=()) -> np.ndarray:
    """Global indices of block ``block`` of ``parts`` along a dimension of
    length ``n``; with ``groups`` > 1, the dimension is ``groups`` stacked
    tensors of n/groups each and the block takes its share of every one.
    ``groups`` may also be a tuple of the stacked tensors' sizes (summing
    to n), when they differ: grouped-query attention's [q | k | v]. With
    ``heads`` (each group's head count), a group of fewer heads than
    ``parts`` gives the block its whole head block // (parts / heads):
    that head is replicated over parts / heads consecutive blocks."""
    sizes = (n // groups,) * groups if isinstance(groups, int) else tuple(groups)
    starts = np.cumsum((0,) + sizes[:-1])
    heads = tuple(heads) or (parts,) * len(sizes)
    out = []
    for s0, m, nh in zip(starts, sizes, heads):
        if parts > nh:                                   # one whole head, shared by parts / nh blocks
            width, at = m // nh, block // (parts // nh)
        else:
            width, at = m // parts, block
        out.append(s0 + np.arange(at * width, (at + 1) * width))
    return np.concatenate(out)


def split_decl(decl, parts: int, block: int) -> np.ndarray:
    """``split_index`` of ``decl``'s last dimension (a first linear's
    columns, a bias) with its groups and heads: the head split's share."""
    return split_index(decl.shape[-1], parts, block, decl.groups, decl.heads)


def shared_width(decl, parts: int) -> tuple:
    """(width, share): how many of a block's last-dimension positions are
    shared when ``decl`` is split ``parts`` ways (its groups with fewer
    heads than ``parts``, the replicated kv heads, which follow the split
    groups), and over how many blocks each is shared; (0, 1) when none."""
    if not decl.heads or all(parts <= nh for nh in decl.heads):
        return 0, 1
    shared = [parts > nh for nh in decl.heads]
    first = shared.index(True)
    if not all(shared[first:]) or len(set(decl.heads[first:])) != 1:
        raise ValueError(f"{decl.name}: the replicated groups must follow the split ones, with equal head counts")
    return sum(m // nh for m, nh in zip(decl.groups[first:], decl.heads[first:])), parts // decl.heads[first]


def shared_columns(decl, parts: int, block: int, comm) -> Optional[SharedColumns]:
    """The ``SharedColumns`` of block ``block`` of ``parts`` of ``decl``'s
    last dimension when some of its groups have fewer heads than ``parts``
    (``shared_width``), else None. ``comm`` is the sub-group of ranks
    sharing this block's head, derived once by the layout (``Layout.kv_comm``)."""
    width, share = shared_width(decl, parts)
    if not width:
        return None
    if comm is None or comm.size != share:
        raise ValueError(f"{decl.name}: {share} ranks share each head, but the layout's kv group has "
                         f"{None if comm is None else comm.size}")
    total = len(split_index(decl.shape[-1], parts, block, decl.groups, decl.heads))
    return SharedColumns(slice(total - width, total), comm, writer=block % share == 0)


def full_index(n: int) -> np.ndarray:
    return np.arange(n)
