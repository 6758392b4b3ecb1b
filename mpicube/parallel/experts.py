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
rank the rows of its experts with all-to-all-v (counts first); each expert
runs on the rows it received, grouped by source rank (the global token
order within the ep group), and the outputs travel back along the same
pairs. With ep 1 both exchanges are the identity and the code path is the
serial model's.
"""

from __future__ import annotations

import re

import numpy as np

from . import comm_alltoall
from .comm import Comm

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
    their experts, for one micro-batch: built from the kept entries'
    experts (grouped ascending), it sends rows there (``send``), hands each
    local expert its rows (``expert_rows``), and brings rows back
    (``back``); the backward pass uses the same counts."""

    def __init__(self, ep: Comm, kept_counts: np.ndarray, n_experts: int):
        g = ep.size
        per = n_experts // g
        self.ep, self.per = ep, per
        self.send_counts = self.destinations(kept_counts, g)                     # (g,) rows to each rank
        mine = kept_counts.reshape(g, per)                                       # (g, per) by destination
        # (g, per): rows of each of this rank's experts that each source sends (counts exchanged first)
        self.recv_matrix = comm_alltoall.exchange_counts(ep, mine)
        self.recv_counts = self.recv_matrix.sum(axis=1)                          # (g,)

    @staticmethod
    def destinations(kept_counts: np.ndarray, g: int) -> np.ndarray:
        """(g,) rows for each ep rank from (E,) kept rows per expert: rank
        r holds experts [r E/g, (r+1) E/g) (``local_experts``)."""
        return kept_counts.reshape(g, -1).sum(axis=1)

    def send(self, rows):
        """rows (m, w) grouped by destination -> (r, w) grouped by source, then expert."""
        return comm_alltoall.alltoallv(self.ep, rows, self.send_counts, self.recv_counts)[0]

    def back(self, rows):
        """rows (r, w) as ``send`` returned them -> (m, w) in the sent order."""
        return comm_alltoall.alltoallv(self.ep, rows, self.recv_counts, self.send_counts)[0]

    def expert_rows(self, local: int) -> np.ndarray:
        """Indices into the received rows of local expert ``local``'s rows,
        source by source (the ep group's global token order)."""
        starts = np.cumsum(self.recv_matrix.reshape(-1)) - self.recv_matrix.reshape(-1)   # (g per,)
        out = [np.arange(starts[s * self.per + local], starts[s * self.per + local] + self.recv_matrix[s, local])
               for s in range(self.ep.size)]
        return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)

