"""Gradient sums and the gradient norm over the parameter store.

Every step sums each rank's partial gradients over every axis that splits
the work but not the parameters: inside the tensor-parallel group over the
ranks that replicate a block (a bias replicated over the 3-D cube's (i, k)
plane, every 1-D LayerNorm, a REPLICATED linear's whole weight wherever the
tp ranks hold different canonical blocks), over the ranks that share a replicated kv head
(grouped-query attention's k and v columns when the head split exceeds the
kv heads, ``params.SharedColumns``), over the context-parallel ring (each cp rank
saw other positions), over the tied wte's pair of pipeline stages (the
lookup on stage 0, the head on stage P-1) and over the data-parallel
replicas. ``GradientSync`` is that one synchronisation, built once from
the store and the axes. The norm counts each logical element once however
many ranks hold it. These are collectives over a ``ParamStore``, so they
live in the parallel layer; the step objects of ``training.step`` call them.
"""

from __future__ import annotations

import math

from ..device import precision
from .comm import Comm
from .grid import tied_pair
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
    sync_shared(store, [s for s in store.specs if s.shared is not None], wire)


def sync_shared(store: ParamStore, specs: list, wire) -> None:
    """Sum the shared columns (``params.SharedColumns``) of ``specs``'
    gradients over the ranks that share them: all of them packed into one
    buffer and summed by one all-reduce per communicator (every layer's
    k and v columns at once; --zero 2/3 call it per layer). The columns are
    a strided view of each block, hence the copy in and out."""
    by_comm = {}
    for spec in specs:
        by_comm.setdefault(id(spec.shared.comm), (spec.shared.comm, []))[1].append(
            store.grad[spec.name][..., spec.shared.cols])                       # (rows, w) strided views
    xp = store.backend.xp
    for comm, views in by_comm.values():
        packed = comm.allreduce(xp.concatenate([v.reshape(-1) for v in views]), wire=wire)  # (sum rows w,)
        at = 0
        for v in views:
            v[...] = packed[at:at + v.size].reshape(v.shape)
            at += v.size


def sync_gradients(store: ParamStore, dp: Comm) -> None:
    """Sum partial gradients over each parameter's replica group inside the
    tensor-parallel group, then over data-parallel replicas (one flat
    all-reduce, in ``gradient_wire`` too). The loss is already normalised
    by the global token count, so these are sums, not means."""
    sync_replica_groups(store)
    if dp.size > 1:
        store.flat_grad[...] = dp.allreduce(store.flat_grad, wire=gradient_wire(store))


class GradientSync:
    """The step's one gradient synchronisation: every sum the plan's axes
    need, in one place, whatever the --zero setting (``__call__``, once per
    step after the last backward). All are sums of linear contributions, so
    their order is free; each runs where it moves the fewest elements:

    ===============  =================================  ==================================
    sum over         --zero 0 / 1 (whole gradient)      --zero 2 / 3 (per-layer chunks)
    ===============  =================================  ==================================
    replica groups   all-reduce of each group's run     per layer and micro-batch, in
                                                        backward (``fsdp.reduce_slot``)
    replicated       a replica group: the whole tp      as the replica groups
    linears          group on 2-D, 2.5-D, 3-D and 1-D
                     --sequence-parallel; none on
                     serial and 1-D (whole on each)
    tied wte pair    all-reduce of grad["wte"]          all-reduce of the wte chunk (C_wte)
    cp ring          all-reduce of the buffer (P)       all-reduce of the chunk (C)
    dp               all-reduce (0), reduce-scatter     per layer and micro-batch, in
                     into the owned chunk (1)           backward (reduce-scatter)
    ===============  =================================  ==================================

    Why the cp and pair sums come after the reduce-scatters under --zero 2
    and 3: the cp ranks of one dp replica own the same chunk of every
    segment, and so do the two stages of the pair (wte is a segment of its
    own there, ``zero.segment_of``), so summing the chunk once per step
    moves C elements where summing each slot before its reduce-scatter
    would move dp C per layer and micro-batch; the pair's two copies are
    also complete at different points of the schedule, so only the step's
    end sees both. Collective over ``axes.pp`` when built (the pair's
    communicator); every rank calls it."""

    def __init__(self, store: ParamStore, axes):
        self.store, self.axes = store, axes
        # stages 0 and P-1 when both hold the tied wte (None on the others, without stages, or untied);
        # tied_pair splits axes.pp, so every rank calls it, holder of wte or not
        pair = tied_pair(axes)
        self.tied = pair if any(spec.tied_pair for spec in store.specs) else None
        self.wire = gradient_wire(store)
        ep = getattr(axes, "ep", None)
        self.folded = ep is not None and ep.size > 1 and axes.cp.size > 1 and store.expert_run is not None

    def __call__(self) -> None:
        store, wire, ring, dp = self.store, self.wire, self.axes.cp, self.axes.dp   # ring: not `cp` (CuPy's name)
        if store.streams_gradients:      # replica groups and dp: done per layer during backward
            store.wait_gradients()
            tied = store.tied_chunk()    # (C_wte,) when this stage holds a copy of wte
            if self.tied is not None and tied is not None:
                tied[...] = self.tied.allreduce(tied, wire=wire)
            if ring.size > 1:    # --ep under --cp: the experts' chunks (last, [C_d, C)) are edp's, summed
                dense = slice(0, store.expert_run.start) if self.folded else slice(0, store.flat_grad.size)
                store.flat_grad[dense] = ring.allreduce(store.flat_grad[dense], wire=wire)   # (C,) or (C_d,)
            replicas = getattr(self.axes, "dp_replica", None)    # --hsdp: the same chunk on R replicas
            if replicas is not None and replicas.size > 1:
                store.flat_grad[...] = replicas.allreduce(store.flat_grad, wire=wire)          # (C,)
            return
        sync_replica_groups(store)
        if self.tied is not None:
            store.grad["wte"][...] = self.tied.allreduce(store.grad["wte"], wire=wire)
        if ring.size > 1:
            # --ep under --cp: the ring's ranks hold different experts (ep folded into dp x cp), whose
            # gradients the expert-data group sums below; the ring sums the dense part only
            dense = slice(0, store.expert_run.start) if self.folded else slice(0, store.flat_grad.size)
            store.flat_grad[dense] = ring.allreduce(store.flat_grad[dense], wire=wire)   # (P_pad,) or dense
        if dp.size == 1:
            return
        if store.partition.sharded:      # --zero 1: the owned chunk of the summed buffer (--ep: experts over edp)
            store.scatter_gradients(wire)                                                  # (C,) of (P_pad,)
        elif store.expert_run is not None and self.axes.ep is not None and self.axes.ep.size > 1:
            experts = store.expert_run  # --ep: experts over their dp/ep holders, everything else over dp
            dense = slice(0, experts.start)
            store.flat_grad[dense] = dp.allreduce(store.flat_grad[dense], wire=wire)
            store.flat_grad[experts] = self.axes.edp.allreduce(store.flat_grad[experts], wire=wire)
        else:
            store.flat_grad[...] = dp.allreduce(store.flat_grad, wire=wire)


def global_grad_norm(store: ParamStore, tp: Comm, stages: Comm = None, ep: Comm = None) -> float:
    """L2 norm of the logical gradient: each block counted once however many
    tensor-parallel ranks replicate it (gradients are identical across dp
    after sync_gradients). One dot product per run of the flat buffer that
    shares a replica count, summed on the device; the only copy to the host
    is the final number. With pipeline stages (``stages``, the pipeline's
    communicator) each stage holds its own layers, so the sums are added
    over the stages too (the tied wte counts half on each of its two)."""
    store.settle()
    xp = store.backend.xp
    local = weighted_squares(xp, store.flat_grad, store.replica_runs) + SharedSquares(store)(xp, store.flat_grad)
    if ep is not None and ep.size > 1 and store.expert_run is not None:
        # --ep: the ep group's ranks hold different experts; each expert counted once (and, like any
        # block, once over the tensor-parallel ranks that replicate it: 2.5-D's depth)
        mine = weighted_squares(xp, store.flat_grad, expert_runs(store))               # (1,)
        local = local - mine + ep.allreduce(mine)
    total = tp.allreduce(local)
    if stages is not None and stages.size > 1:
        total = stages.allreduce(total)
    return math.sqrt(float(total[0]))


def expert_runs(store: ParamStore) -> list:
    """The (replicas, slice) runs of ``store.replica_runs`` cut to the
    experts' part of the buffer (``store.expert_run``)."""
    lo, hi = store.expert_run.start, store.expert_run.stop
    return [(r, slice(max(lo, run.start), min(hi, run.stop))) for r, run in store.replica_runs
            if max(lo, run.start) < min(hi, run.stop)]


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


class SharedSquares:
    """The norm's correction for shared columns (``params.SharedColumns``):
    ``weighted_squares`` counts a block's elements with 1/replicas, but its
    shared columns are held by ``share`` times as many ranks, so this adds
    (1/share - 1)/replicas |g|^2 over them. Built from the store's offsets
    and, for a sharded store, the chunks this rank owns (``windows``:
    (start, stop, shift) ranges of the whole buffer and what to subtract
    to address the chunk buffer); a block's columns inside a window are at
    most one 2-D strided view and two contiguous pieces."""

    def __init__(self, store: ParamStore, windows=None):
        self.pieces = []                     # (weight, start, stop, rows or 0, width, cols) in buffer coordinates
        for spec in store.specs:
            if spec.shared is None:
                continue
            lo, hi = store.offsets[spec.name]
            width = spec.local_shape[-1]
            weight = (1.0 / spec.shared.share - 1.0) / spec.replicas
            for start, stop, shift in (windows if windows is not None else [(lo, hi, 0)]):
                s, e = max(start, lo), min(stop, hi)
                if s < e:
                    self.pieces += [(weight, *p) for p in strided_pieces(lo, width, spec.shared.cols, s, e, shift)]

    def __call__(self, xp, grad):
        """(1,) float64 on the device: the correction, from ``grad``."""
        total = xp.zeros(1, dtype=xp.float64)                # (1,)
        for weight, a, b, rows, width, cols in self.pieces:
            g = grad[a:b] if not rows else grad[a:b].reshape(rows, width)[:, cols]
            total += weight * xp.sum(g.astype(xp.float64) ** 2)
        return total


def strided_pieces(lo: int, width: int, cols: slice, s: int, e: int, shift: int) -> list:
    """The positions lo + r width + c (c in ``cols``, any row r) that lie
    in [s, e), as (start, stop, rows, width, cols) pieces of a buffer
    addressed at position - ``shift``: rows > 0 a (rows, width) grid's
    columns, rows 0 the contiguous [start, stop)."""
    out = []

    def partial(row, a, b):                  # the row's columns inside [a, b)
        c0, c1 = max(a, lo + row * width + cols.start), min(b, lo + row * width + cols.stop)
        if c0 < c1:
            out.append((c0 - shift, c1 - shift, 0, width, cols))

    r0, r1 = -(-(s - lo) // width), (e - lo) // width     # full rows [r0, r1)
    if r0 > r1:                                           # [s, e) inside one row
        partial(r1, s, e)
        return out
    if s < lo + r0 * width:
        partial(r0 - 1, s, lo + r0 * width)
    if r1 > r0:
        out.append((lo + r0 * width - shift, lo + r1 * width - shift, r1 - r0, width, cols))
    if e > lo + r1 * width:
        partial(r1, lo + r1 * width, e)
    return out
