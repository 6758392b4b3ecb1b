"""Expert parallelism (``--ep``): where each expert lives and how tokens
reach it.

The ep ranks are taken from the data-parallel replicas, as Megatron and
DeepSpeed fold them: replica d belongs to expert-parallel group d // ep,
at ep rank d % ep, and holds experts [r E/ep, (r+1) E/ep) of every MoE
layer (r its ep rank). The dp/ep replicas that hold the same experts form
its expert-data group ("edp": replicas d with the same d % ep), over which
those experts' gradients are summed; dense parameters are summed over all
of dp as always. A rank's store declares only its own experts
(``model_specs``), so expert memory per rank falls by ep. Under --cp the
ep ranks come from dp x cp, as Megatron folds them: rank (d, c) is
q = d cp + c (``grid.build_layout``), and q takes d's place above.

Dispatch (``Dispatch``): a rank routes its own tokens, sorts the kept
(token, expert) entries by expert (so by destination rank), and sends each
rank the rows of its experts with a nonblocking all-to-all-v (counts
first), keeping the rows for its own experts where they are; each expert
runs on the rows it holds, grouped by source rank (the global token order
within the ep group), and the outputs travel back along the same pairs.
model/moe_experts.py computes the own rows while the others travel. With
ep 1 both exchanges are the identity and the code path is the serial model's.
"""

from __future__ import annotations

import re

import numpy as np

from . import comm_alltoall
from .comm import Comm, Pending
from ..device.arrays import array_module

_EXPERT = re.compile(r"^h\.\d+\.moe\.experts\.(\d+)\.")


def expert_of(name: str):
    """The expert index of an expert's parameter name, else None."""
    m = _EXPERT.match(name)
    return None if m is None else int(m.group(1))


def local_experts(n_experts: int, ep: Comm) -> range:
    """The experts this rank's ep rank holds."""
    per = n_experts // ep.size
    return range(ep.rank * per, (ep.rank + 1) * per)


def model_specs(layout, decls: list) -> list:
    """This rank's ParamSpecs of the model's ``decls``: every dense
    parameter, and the experts of its ep rank only, marked ``expert`` (their
    gradients are summed over the expert-data group) and written to a
    checkpoint by that group's rank 0 (at cp rank 0)."""
    ep, edp = layout.axes.ep, layout.axes.edp
    specs = []
    for decl in decls:
        e = expert_of(decl.name)
        if e is None:
            specs.append(layout.shard(decl))
            continue
        if ep is not None and e // (layout.cfg.n_experts // ep.size) != ep.rank:
            continue
        spec = layout.shard(decl)
        spec.expert = True
        # ep 1 under --cp: the ring's ranks hold the same experts and its rank 0 writes; with ep > 1 the
        # edp group spans the ring (folded, grid.build_layout) and holds every copy
        ring = layout.axes.cp if ep is None or ep.size == 1 else None
        spec.writer = spec.writer and (edp is None or edp.rank == 0) and (ring is None or ring.rank == 0)
        specs.append(spec)
    return specs


class Dispatch:
    """One MoE layer's exchange of token rows with the ranks that hold
    their experts, for one micro-batch, built from the kept entries'
    experts (grouped ascending) after exchanging their counts.

    Rows travel in two parts. A rank's rows for its own experts stay where
    they are (``own``: they never enter MPI, comm_alltoall); the others
    go by a nonblocking all-to-all-v (``post``, ``post_back``) whose
    ``Pending`` the caller waits on after computing what it can without
    them. Buffers of received rows hold the other ranks' rows, grouped by
    source then local expert, without the own ones (``others_index``);
    ``gathered`` and ``split`` convert to and from all of them in source
    order (the ep group's global token order), ``sent`` puts the two parts
    of a reply back in the sent order. The backward pass uses the same counts."""

    def __init__(self, ep: Comm, kept_counts: np.ndarray, n_experts: int):
        g = ep.size
        per = n_experts // g
        self.ep, self.per, me = ep, per, ep.rank
        self.send_matrix = kept_counts.reshape(g, per)                           # (g, per) by destination
        self.send_counts = self.send_matrix.sum(axis=1)                          # (g,) rows to each rank
        # (g, per): rows of each of this rank's experts that each source sends (counts exchanged first)
        self.recv_matrix = comm_alltoall.exchange_counts(ep, self.send_matrix)
        self.recv_counts = self.recv_matrix.sum(axis=1)                          # (g,)
        self.own_counts = self.send_matrix[me]                                   # (per,) own rows per local expert
        self.n_own = int(self.own_counts.sum())
        self.own_start = int(self.send_counts[:me].sum())                        # in the sent rows
        self.own_place = int(self.recv_counts[:me].sum())                        # in all received rows

    def own(self, rows):
        """rows (m, w) grouped by destination -> (s, w) those for this
        rank's own experts, grouped by expert (a view)."""
        return rows[self.own_start:self.own_start + self.n_own]

    def post(self, rows):
        """Start sending rows (m, w) grouped by destination (the own ones
        in their place, not sent); ``wait()`` -> (r_o, w) the other
        ranks' rows for this rank's experts, grouped by source then expert."""
        return self._post(rows, self.send_counts, self.recv_counts, True)

    def post_back(self, rows):
        """Start returning rows (r_o, w) shaped as ``post`` delivered them;
        ``wait()`` -> (m - s, w) the replies to this rank's sent rows,
        grouped by destination, without the own part."""
        return self._post(rows, self.recv_counts, self.send_counts, False)

    def _post(self, rows, send_counts, recv_counts, own_in_rows: bool):
        if self.ep.size == 1:
            return Pending(lambda: rows[:0])
        return comm_alltoall.ialltoallv(self.ep, rows, send_counts, recv_counts, own_in_rows)

    def gathered(self, own, others):
        """own (s, w), others (r_o, w) -> (r, w) every row for this rank's
        experts in source order, the own rows at this rank's place."""
        if others.shape[0] == 0:
            return own
        xp = array_module(own)
        return xp.concatenate([others[:self.own_place], own, others[self.own_place:]])

    def split(self, rows):
        """(r, w) in source order, as ``gathered`` returns -> (own (s, w), others (r_o, w))."""
        if rows.shape[0] == self.n_own:
            return rows, rows[:0]
        xp = array_module(rows)
        end = self.own_place + self.n_own
        return rows[self.own_place:end], xp.concatenate([rows[:self.own_place], rows[end:]])

    def sent(self, own, others):
        """own (s, w), others (m - s, w) as ``post_back`` delivered them ->
        (m, w) in the order the rows were sent."""
        if others.shape[0] == 0:
            return own
        xp = array_module(own)
        return xp.concatenate([others[:self.own_start], own, others[self.own_start:]])

    def own_index(self, local: int) -> np.ndarray:
        """Indices into the own rows of local expert ``local``'s."""
        start = int(self.own_counts[:local].sum())
        return np.arange(start, start + int(self.own_counts[local]))

    def others_index(self, local: int) -> np.ndarray:
        """Indices into the other ranks' rows (``post``) of local expert
        ``local``'s, source by source."""
        matrix = self.recv_matrix.copy()
        matrix[self.ep.rank] = 0
        return _expert_index(matrix, local)

    def all_index(self, local: int) -> np.ndarray:
        """Indices into every received row (``gathered``) of local expert
        ``local``'s, source by source (the ep group's global token order)."""
        return _expert_index(self.recv_matrix, local)


def _expert_index(matrix: np.ndarray, local: int) -> np.ndarray:
    """matrix (g, per): rows from each source for each local expert, laid
    out source-major -> the indices of expert ``local``'s rows."""
    flat = matrix.reshape(-1)
    starts = np.cumsum(flat) - flat                                              # (g per,)
    g, per = matrix.shape
    out = [np.arange(starts[s * per + local], starts[s * per + local] + matrix[s, local]) for s in range(g)]
    return np.concatenate(out).astype(np.int64)
