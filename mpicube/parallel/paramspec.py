"""Parameters as declared and as one rank holds them: the model's
declaration of a logical tensor (``ParamDecl``), a layout's answer saying
which block of it this rank holds and where its gradient is summed
(``ParamSpec``), and the pure functions of a spec: which entries are real
rather than vocabulary padding (``real_mask``), the indices to read a full
tensor at (``clipped_index``), the initial values (``init_block``, a pure
function of seed, name and global index, so every layout starts from the
same model). ``params.ParamStore`` lays the blocks out in one flat buffer;
``ParamDecl`` and ``ParamSpec`` can still be imported from ``params``,
where most callers find them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from ..ops import rng
from .comm import Comm
from .split import SharedColumns


@dataclass(frozen=True)
class ParamDecl:
    """A logical parameter as the model sees it.

    ``role`` tells the layout how the tensor is used: ``wte``, ``wpe``, ``norm``,
    ``w_column``/``b_column`` (a column-parallel linear, the first of a
    pair: c_attn, c_fc), ``w_row``/``b_row`` (a row-parallel one, the second:
    c_proj), ``w_replicated`` (a small weight every tensor-parallel rank
    holds whole: layouts/base.LINEAR_KINDS), ``router`` (a mixture's).
    ``groups`` > 1 means the output columns are ``groups`` stacked tensors
    (c_attn's [q | k | v], SwiGLU's [gate | up]) that must each be split
    the same way; a tuple gives their sizes when they differ (grouped-query
    attention's q, k and v). ``heads`` (with a tuple ``groups``) gives each
    group's number of heads: a split finer than a group's heads gives each
    block one whole head of that group, shared by parts / heads blocks
    (grouped-query attention's kv heads when the head split exceeds them).
    """

    name: str
    shape: tuple
    role: str
    init: str              # "normal", "ones" or "zeros"
    std: float = 0.0
    decay: bool = False
    groups: object = 1          # int, or a tuple of sizes
    heads: tuple = ()           # heads per group (with a tuple ``groups``), or () for no head structure


@dataclass
class ParamSpec:
    """How one rank holds one parameter.

    ``index[d]`` lists the global indices (along dimension d) of the local
    block; indices >= ``decl.shape[d]`` are vocabulary padding, always zero.
    ``grad_comm`` is the group of replicas whose partial gradients must be
    summed (None when each rank's gradient is already complete).
    ``replicas`` is how many ranks of the tensor-parallel group hold this same
    block (to count it once in norms); ``writer`` is True on exactly one of them.
    """

    decl: ParamDecl
    index: tuple
    grad_comm: Optional[Comm] = None
    replicas: int = 1
    writer: bool = True
    tied_pair: bool = False     # a copy also sits on another pipeline stage (the tied wte): summed over the pair
    expert: bool = False        # an expert's (--ep): summed over the expert-data group, not all of dp (experts.py)
    shared: Optional[SharedColumns] = None   # columns more ranks hold (replicated kv heads), or None

    @property
    def name(self) -> str:
        return self.decl.name

    @property
    def local_shape(self) -> tuple:
        return tuple(len(ix) for ix in self.index)

    @property
    def size(self) -> int:
        return int(np.prod(self.local_shape))


def real_mask(spec: ParamSpec) -> np.ndarray:
    """Boolean (local shape) mask: True where the block holds a real entry,
    False on vocabulary padding."""
    mask = np.ones(spec.local_shape, dtype=bool)
    for grid, n in zip(np.ix_(*spec.index), spec.decl.shape):
        mask &= grid < n
    return mask


def clipped_index(spec: ParamSpec) -> tuple:
    """``spec.index`` with padding positions pointed at the last real entry,
    for fancy-indexing a full logical tensor."""
    return tuple(np.minimum(ix, n - 1) for ix, n in zip(spec.index, spec.decl.shape))


def init_block(spec: ParamSpec, seed: int) -> np.ndarray:
    """Initial values (host float64) of the block ``spec.index`` of a logical
    tensor: a pure function of (seed, name, global index)."""
    decl = spec.decl
    shape = spec.local_shape
    if decl.init == "ones":
        return np.ones(shape)
    if decl.init == "zeros":
        return np.zeros(shape)
    values = decl.std * rng.normal(rng.make_key(seed, "init", decl.name), rng.flat_index(decl.shape, clipped_index(spec)))
    values[~real_mask(spec)] = 0.0   # vocabulary padding stays exactly zero
    return values
