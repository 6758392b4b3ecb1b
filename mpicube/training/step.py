"""The optimizer step the trainer runs: gradient sums, norm and AdamW as
one object, replicated over data-parallel replicas (--zero 0) or sharded
over them (--zero 1, see ``parallel.zero``; --zero 2 and 3, whose
gradients arrive reduce-scattered during backward, ``parallel.fsdp``).
Both sum gradients with the same ``parallel.gradients.GradientSync``,
built from the store and the axes (tp replica groups, cp ring, the tied
wte pair of a pipeline, dp); they differ in the norm (whole buffer or
owned chunks) and in what follows AdamW (nothing, or the gather).

Both objects answer the same three calls, in this order every step:
``sync()`` (sum the gradients), ``grad_norm()`` (the global L2 norm, for
clipping and the log) and ``step(lr, grad_scale)``; ``adam`` holds the
moments and the step count (of AdamW, or of plain SGD: ``--optimizer sgd``). The trainer, ``bench`` and
tests/parallel_check.py all build theirs with ``make_step``, so the check
tests the trainer's own code.
"""

from __future__ import annotations

import math

from ..parallel.gradients import GradientSync, SharedSquares, global_grad_norm, weighted_squares
from ..parallel.params import ParamStore
from .optim import OPTIMIZERS
from .muon import Muon


class ReplicatedStep:
    """The optimizer step of --zero 0: every data-parallel replica sums the
    whole gradient (all-reduce) and updates the whole buffer. Built once and
    called every step by the trainer and tests/parallel_check.py, with the
    same calls as ``ShardedStep``; ``adam`` holds the moments and the
    step count."""

    def __init__(self, store: ParamStore, axes, weight_decay: float = 0.1, optimizer: str = "adamw",
                 muon_qkv: str = "split"):
        self.store, self.axes = store, axes
        self.adam = build_optimizer(optimizer, store, axes, weight_decay, muon_qkv)   # AdamW, SGD or Muon
        self.sync = GradientSync(store, axes)     # sync(): every axis's sum, the dp all-reduce last

    def grad_norm(self) -> float:
        return global_grad_norm(self.store, self.axes.tp, self.axes.pp, self.axes.ep)   # pp: the sum over stages

    def step(self, lr: float, grad_scale: float = 1.0) -> None:
        self.adam.step(lr, grad_scale)


def make_step(store: ParamStore, axes, weight_decay: float = 0.1, optimizer: str = "adamw", muon_qkv: str = "split"):
    """The optimizer step for ``store``: sharded over dp if the store is
    (``zero=1``), else replicated; ``optimizer`` "adamw", "sgd" or "muon"
    (``muon_qkv``: c_attn's q, k, v orthogonalised "split" or "joint")."""
    if store.partition.sharded:
        return ShardedStep(store, axes, weight_decay, optimizer, muon_qkv)
    return ReplicatedStep(store, axes, weight_decay, optimizer, muon_qkv)


def build_optimizer(name: str, store: ParamStore, axes, weight_decay: float, muon_qkv: str = "split"):
    """AdamW, SGD, or Muon (which gathers each hidden matrix over tp: training.muon)."""
    if name == "muon":
        return Muon(store, weight_decay=weight_decay, tp=axes.tp, qkv=muon_qkv)
    return OPTIMIZERS[name](store, weight_decay=weight_decay)


class ShardedStep:
    """The optimizer step of --zero 1; built once, called every step by the
    trainer and by tests/parallel_check.py (``sync``, ``grad_norm``,
    ``step``). ``adam`` holds the moments of the owned chunk and the step
    count."""

    def __init__(self, store, axes, weight_decay: float = 0.1, optimizer: str = "adamw", muon_qkv: str = "split"):
        if not store.partition.sharded or store.dp not in (axes.dp, getattr(axes, "dp_shard", None)):
            raise ValueError("ShardedStep needs a ParamStore sharded over this layout's dp axis (zero >= 1)")
        self.store, self.axes = store, axes
        self.adam = build_optimizer(optimizer, store, axes, weight_decay, muon_qkv)   # AdamW, SGD or Muon
        # sync(): every axis's sum; the owned chunk of flat_grad then holds the summed gradient
        # (--zero 1: reduce-scattered over dp here; --zero 2/3: per layer during backward)
        self.sync = GradientSync(store, axes)
        # (replicas, slice of the chunk): the gradient norm counts each replicated block once
        self.replica_runs = [(r, run) for r, whole in store.replica_runs for run in store.partition.local([whole])]
        self.shared = SharedSquares(store, store.partition.windows())    # replicated kv columns counted once
        ep = getattr(axes, "ep", None)
        self.folded = ep is not None and ep.size > 1 and axes.cp.size > 1 and store.expert_run is not None
        if self.folded:   # the experts' part of the chunk: [C_d, C) (zero.ExpertPartition, zero.Segments)
            cd = store.partition.expert_at
            self.expert_runs = [(r, slice(max(cd, run.start), run.stop)) for r, run in self.replica_runs
                                if run.stop > cd]

    def grad_norm(self) -> float:
        """L2 norm of the logical gradient from the owned chunks: one
        float64 all-reduce over the world; the only copy to the host is the
        final number."""
        store = self.store
        chunk, xp, cp = store.grad_chunk, store.backend.xp, self.axes.cp.size                 # (C,)
        local = weighted_squares(xp, chunk, self.replica_runs) + self.shared(xp, chunk)       # (1,)
        if self.folded:   # --ep under --cp: the experts' chunks differ over the ring, the dense ones repeat
            experts = weighted_squares(xp, chunk, self.expert_runs)                           # (1,)
            both = self.axes.world.allreduce(xp.concatenate([local - experts, experts]))      # (2,)
            return math.sqrt(float(both[0]) / cp + float(both[1]))
        replicas = getattr(self.axes, "dp_replica", None)
        copies = cp * (replicas.size if replicas is not None else 1)   # --hsdp: R replicas hold it too
        total = float(self.axes.world.allreduce(local)[0]) / copies   # cp ranks hold the same chunk
        return math.sqrt(total)

    def step(self, lr: float, grad_scale: float = 1.0) -> None:
        """AdamW on the owned chunk, then the parameters all-gathered over dp
        (``ParamStore.refresh_work``), so the next forward, a save or an
        evaluation sees complete parameters."""
        self.adam.step(lr, grad_scale)
        self.store.refresh_work()
