"""Gradient sums and the gradient norm over the parameter store.

Every step sums each rank's partial gradients twice: inside the tensor-
parallel group, over the ranks that replicate a block (a bias replicated
over the 3-D cube's (i, k) plane, every 1-D LayerNorm), and over the data-
parallel replicas. The norm counts each logical element once however many
ranks hold it. These are collectives over a ``ParamStore``, so they live in
the parallel layer; the step objects of ``training.step`` call them.
"""

from __future__ import annotations

import math

from ..device import precision
from .comm import Comm
from .params import ParamStore


def gradient_wire(store: ParamStore):
    """The wire format of the step's gradient sums (replica groups and dp),
    ``precision.gradient_wire`` of the store's storage format: bfloat16
    words for a bfloat16 store, else the master format (MPI's own sum)."""
    return precision.gradient_wire(store.backend.dtype)


def sync_replica_groups(store: ParamStore) -> None:
    """Sum partial gradients over each parameter's replica group inside the
    tensor-parallel group (the first half of every step's synchronisation),
    in ``gradient_wire``: under bfloat16 the sums arrive rounded to
    bfloat16 once and are kept in the float32 buffer."""
    store.settle()
    wire = gradient_wire(store)
    for comm, flat_slice in store.grad_groups:
        store.flat_grad[flat_slice] = comm.allreduce(store.flat_grad[flat_slice], wire=wire)


def sync_gradients(store: ParamStore, dp: Comm) -> None:
    """Sum partial gradients over each parameter's replica group inside the
    tensor-parallel group, then over data-parallel replicas (one flat
    all-reduce, in ``gradient_wire`` too). The loss is already normalised
    by the global token count, so these are sums, not means."""
    sync_replica_groups(store)
    if dp.size > 1:
        store.flat_grad[...] = dp.allreduce(store.flat_grad, wire=gradient_wire(store))


def global_grad_norm(store: ParamStore, tp: Comm, stages: Comm = None) -> float:
    """L2 norm of the logical gradient: each block counted once however many
    tensor-parallel ranks replicate it (gradients are identical across dp
    after sync_gradients). One dot product per run of the flat buffer that
    shares a replica count, summed on the device; the only copy to the host
    is the final number. With pipeline stages (``stages``, the pipeline's
    communicator) each stage holds its own layers, so the sums are added
    over the stages too (the tied wte counts half on each of its two)."""
    store.settle()
    total = tp.allreduce(weighted_squares(store.backend.xp, store.flat_grad, store.replica_runs))
    if stages is not None and stages.size > 1:
        total = stages.allreduce(total)
    return math.sqrt(float(total[0]))


def weighted_squares(xp, grad, replica_runs):
    """(1,) float64 on the device: the sum over (replicas, run) of
    |grad[run]|^2 / replicas, one dot product per run, so a block that
    ``replicas`` tensor-parallel ranks hold counts once when summed over
    them (``global_grad_norm``, and ``training.step.ShardedStep`` on its chunk)."""
    local = xp.zeros(1, dtype=xp.float64)                # (1,)
    for replicas, run in replica_runs:
        g = grad[run]                                    # (n,)
        local += xp.dot(g, g).astype(xp.float64) / replicas
    return local
