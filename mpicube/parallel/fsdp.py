"""``--zero 2`` and ``--zero 3``: gradients, then the parameters too, sharded
over the data-parallel replicas layer by layer (ZeRO stages 2 and 3; FSDP).

Why: under ``--zero 1`` every replica still holds its tensor-parallel
shard's whole gradient and weights. Here the buffer is cut per layer
(``zero.Segments``: "outside" = wte, wpe, ln_f, then one segment per block)
and replica r keeps chunk r of every segment: the float32 master, the
summed gradient and the AdamW moments are (C,) chunk buffers, C ~ P / dp.

``--zero 2``: the working weights stay whole (P_pad, all-gathered after each
step as under --zero 1), but a block's gradient lives in a *gradient slot*
only while its backward runs: when the block's backward ends its slot is
summed over the tensor-parallel replica groups and reduce-scattered over
dp (nonblocking: it travels while the next block's backward computes)
into the chunk gradient. Two slots alternate between blocks (block k uses
slot k mod 2), plus one for the outside segment, so no rank holds its
whole gradient.

``--zero 3``: the weights too exist only as the chunk; a block's weights
are all-gathered over dp into a *parameter slot* (again two, alternating,
plus the outside segment's) right before it runs. While block k computes,
block k+1's gather (k-1's in backward) is already on its way into the
other slot. The outside segment is gathered once after each optimizer
step and stays (the embeddings run at both ends of forward and backward).
A slot that still holds the layer it is asked for is not gathered again:
at the turn from forward to backward the last two blocks are still there.
``--recompute blocks`` reruns a block's forward right before its
backward, inside the same residency, so it costs no extra gather.

Layers never see any of this: each one holds views of its slot
(``store.work``, ``store.grad``) from construction, and the model brackets
every block with ``layers(...).enter(i)`` / ``leave(i)`` (a no-op stream
for --zero 0 and 1). A pipeline stage's store holds only its own blocks'
segments; the stream walks whatever blocks its model runs, and the end
segments (outside, and on a pipeline's stages 0 and P-1 the tied wte as a
segment of its own) only for a chunk that runs the embeddings or the head.
With ``--ep`` a block's experts are a segment of their own in the same
slots, reduce-scattered and gathered over the expert-data group (the
ranks holding the same experts) where its dense segment uses dp
(``zero.Segments``; docs/moe.md).
When each gather and reduce-scatter happens, and what those walks cost,
is ``fsdp_stream``'s (``BlockStream``, ``slot_key``, ``pass_gathers``).
Each backward of a block adds its reduce-scatter into the chunk gradient,
so micro-batches accumulate there in any order (interleaved schedules run
chunks' backwards out of order). What the other axes add, the sums over
the cp ring and over the tied pair, runs on the chunk once per step
(``gradients.GradientSync``).

Memory per rank (elements; the cost model's ``costmemory`` mirrors it):
master, gradient and moments C each (moments 2 C); --zero 2 adds the P_pad
working copy and the gradient slots (outside + two blocks'); --zero 3 the
16-bit rounding of the master chunk (mixed precision only), the parameter
slots and the gradient slots. Every one is allocated once, so the peak
is what ``buffers()`` lists. Communication per micro-batch: the replica
groups' sums and one reduce-scatter per segment; --zero 3 the gathers
above; per step the norm over the world and, --zero 2, one all-gather of
the chunk.
"""

from __future__ import annotations

from contextlib import contextmanager

from ..device import precision
from .comm import Comm
from .gradients import sync_shared
from .fsdp_stream import (BlockStream, block_gathers, gathers_by_block, pass_gathers,  # noqa: F401 (*_gathers:
                          slot_key)                                                    # the cost model's)
from .params import ParamStore
from .wgrad import WeightGrads
from .zero import EXPERTS, TIED, Segments, is_end, segment_key, segment_of


def make_store(specs, backend, seed: int, dp: Comm = None, zero: int = 0, stages: int = 1,
               edp: Comm = None) -> ParamStore:
    """The parameter store for a --zero setting: segmented for 2 and 3
    (needs dp > 1), else the flat ``ParamStore``. ``stages``: the pipeline's
    (with more than one, the tied wte is a segment of its own,
    ``zero.segment_of``); ``edp``: the expert-data group (--zero 1 shards
    the experts' state over it, ``zero.ExpertPartition``; --zero 2 and 3
    each block's expert segment)."""
    if zero >= 2 and dp is not None and dp.size > 1:
        return SegmentedStore(specs, backend, seed, dp, zero, split_tied=stages > 1, edp=edp)
    return ParamStore(specs, backend, seed, dp=dp, zero=zero, edp=edp)


class SegmentedStore(ParamStore):
    """The parameter store of --zero 2 and 3 (module docstring); answers
    every call of ``ParamStore`` with the chunk buffers, plus ``layers``."""

    streams_gradients = True

    def __init__(self, specs: list, backend, seed: int, dp: Comm, zero: int, split_tied: bool = False,
                 edp: Comm = None):
        def group_key(spec):
            return "" if spec.grad_comm is None else spec.grad_comm.axis

        # --ep: a block's experts are a segment of their own, cut over the expert-data group (zero.py)
        split = edp is not None and edp is not dp and any(s.expert for s in specs)

        def seg_of(spec):
            site = segment_of(spec.name, split_tied)
            return site + EXPERTS if split and spec.expert else site

        # segment by segment (a block's experts after its dense part); inside one, ParamStore's order
        self.specs = sorted(specs, key=lambda s: (segment_key(segment_of(s.name, split_tied)), split and s.expert,
                                                  group_key(s), not s.decl.decay))
        self.by_name = {s.name: s for s in self.specs}
        self.backend, self.dp, self.edp, self.zero = backend, dp, edp if split else dp, zero
        xp, master = backend.xp, backend.master_dtype
        sizes = {}
        for spec in self.specs:
            sizes[seg_of(spec)] = sizes.get(seg_of(spec), 0) + spec.size
        self.partition = Segments([(name, n, name.endswith(EXPERTS)) for name, n in sizes.items()],
                                  dp.size, dp.rank, self.edp.size, self.edp.rank)
        self.shard = self.partition.own                             # the whole chunk buffer
        C, P_pad = self.partition.chunk, self.partition.padded
        self._mixed = backend.dtype != master
        self._flat = None                                           # no full master anywhere
        self.master = xp.zeros(C, dtype=master)                     # (C,) master chunk
        self.flat_grad = xp.zeros(C, dtype=master)                  # (C,) summed gradient chunk
        self.grad_chunk = self.flat_grad                            # (C,) what the optimizer reads
        # a site (a block "h.{i}", or an end) and its segments: [(segment, its comm, where it starts in the slot)]
        self.pieces = {site: [(seg, self.edp if seg.expert else dp, at) for seg, at in held]
                       for site, held in self.partition.sites().items()}
        self.blocks = [site for site in self.pieces if not is_end(site)]
        self.ends = [site for site in self.pieces if is_end(site)]
        self.slot_of = {site: slot_key(site, self.blocks) for site in self.pieces}
        widths = {}
        for site, held in self.pieces.items():
            key = self.slot_of[site]
            widths[key] = max(widths.get(key, 0), sum(seg.padded for seg, _, _ in held))
        self.grad_slots = {key: xp.zeros(n, dtype=master) for key, n in widths.items()}   # (S_pad,) each
        if zero == 2:
            self.flat_work = xp.zeros(P_pad, dtype=backend.dtype)  # (P_pad,) the whole working copy
            self.work_chunk, self.param_slots = None, {}
        else:
            self.flat_work = None
            # (C,) what a gather sends: the master itself, or its 16-bit rounding
            self.work_chunk = xp.zeros(C, dtype=backend.dtype) if self._mixed else self.master
            self.param_slots = {key: xp.zeros(n, dtype=backend.dtype) for key, n in widths.items()}
        self.offsets, self.work, self.grad, self._data = {}, {}, {}, {}
        self.seg_groups = {}                    # site -> [(comm, slice of its slot)]: replica-group sums
        self.seg_shared = {}                    # site -> [spec with shared columns]: their sharers' sums
        at = {seg.name: seg.lo for seg in self.partition.list}
        for spec in self.specs:
            seg = self.partition.by_name[seg_of(spec)]
            site = segment_of(spec.name, split_tied)
            lo, base = at[seg.name], self.pieces[site][0][0].lo      # base: where the site's slot starts
            at[seg.name] += spec.size
            self.offsets[spec.name] = (lo, lo + spec.size)
            key, inner = self.slot_of[site], slice(lo - base, lo - base + spec.size)
            params = self.flat_work[lo:lo + spec.size] if zero == 2 else self.param_slots[key][inner]
            self.work[spec.name] = params.reshape(spec.local_shape)
            self.grad[spec.name] = self.grad_slots[key][inner].reshape(spec.local_shape)
            if spec.shared is not None:
                self.seg_shared.setdefault(site, []).append(spec)
            if spec.grad_comm is not None:
                groups = self.seg_groups.setdefault(site, [])
                if groups and groups[-1][0].axis == spec.grad_comm.axis and groups[-1][1].stop == inner.start:
                    groups[-1] = (groups[-1][0], slice(groups[-1][1].start, inner.stop))
                else:
                    groups.append((spec.grad_comm, inner))
        self.grad_groups = []                   # (ParamStore's, for the flat buffer: none here)
        # --ep: the experts' part of the (C,) chunk gradient (the cp ring's sum skips it), or None
        self.expert_run = slice(self.partition.expert_at, C) if split else None
        self._deferred, self._unwritten, self._eager_runs = set(), set(), None
        self.wgrads = WeightGrads()          # the linears' dW: always at once here (zero-bubble refuses --zero 2/3)
        self.decay_slices = self._runs([s for s in self.specs if s.decl.decay])
        self.replica_runs = [(r, run) for r in sorted({s.replicas for s in self.specs})
                             for run in self._runs([s for s in self.specs if s.replicas == r])]
        self._work_stale = False
        self._resident = {}                     # slot key -> segment whose parameters it holds (--zero 3)
        self._gathering = {}                    # segment -> Pending gather into its slot
        self._reducing = {}                     # slot key -> (segment, Pending reduce-scatter of its slot)
        self.initialize(seed)

    # --- the full master, for code outside the step ---------------------------
    def full_master(self):
        """(P_pad,) the full float32 master, all-gathered over dp (and edp)
        and put in segment order (collective: every rank of dp calls it)."""
        return self.gather_chunks(self.master)

    def gather_chunks(self, chunk):
        """(P_pad,) a full buffer from every replica's (C,) ``chunk`` of it:
        the dense chunks all-gathered over dp, the experts' (--ep) over edp."""
        at = self.partition.expert_at
        experts = self.edp.allgather(chunk[at:]) if self.expert_run is not None else None   # (edp C_x,)
        return self.partition.assemble(self.backend.xp, self.dp.allgather(chunk[:at]), experts)

    @contextmanager
    def writing_master(self):
        """Yields a (P_pad,) full master to fill completely; this replica
        keeps its chunks, --zero 2 rounds the working copy from the full
        values, --zero 3 its chunk (the slots gather afresh)."""
        full = self.backend.xp.zeros(self.partition.padded, dtype=self.master.dtype)   # (P_pad,) temporary
        yield full
        self.master[...] = self.partition.take(self.backend.xp, full)
        if self.zero == 2:
            self.flat_work[...] = full
        elif self._mixed:
            self.work_chunk[...] = self.master
        self._resident.clear()
        self._work_stale = False

    def buffers(self) -> list:
        return self.param_buffers() + self.grad_buffers()

    def param_buffers(self) -> list:
        """The weights this rank holds: master chunk, then the working copy
        (--zero 2) or the master's 16-bit rounding and the slots (--zero 3)."""
        out = [self.master]
        if self.flat_work is not None:
            out.append(self.flat_work)
        if self.work_chunk is not None and self.work_chunk is not self.master:
            out.append(self.work_chunk)
        return out + list(self.param_slots.values())

    def grad_buffers(self) -> list:
        """The gradients this rank holds: the summed chunk and the slots."""
        return [self.flat_grad] + list(self.grad_slots.values())

    @property
    def mixed(self) -> bool:
        return self._mixed

    def params_changed(self) -> None:
        self._work_stale = True

    def refresh_work(self) -> None:
        """After an optimizer step or a load: --zero 2 all-gathers the
        updated chunks into the working copy (collective); --zero 3 rounds
        the chunk and forgets what the slots hold (the next use gathers)."""
        if not self._work_stale:
            return
        xp = self.backend.xp
        if self.zero == 2:
            own = self.master.astype(self.backend.dtype) if self._mixed else self.master   # (C,)
            self.flat_work[...] = self.gather_chunks(own)
        else:
            if self._mixed:
                self.work_chunk[...] = self.master
            self._resident.clear()
        self._work_stale = False

    # --- gradients ------------------------------------------------------------
    def zero_grad(self) -> None:
        """Start a step: the chunk gradient reads zero (each slot is cleared
        when its layer's backward begins)."""
        self.wait_gradients()
        self.flat_grad[...] = 0

    def layers(self, direction: str, blocks: list, ends: bool = True):
        """The stream a model's forward or backward walks (``BlockStream``);
        ``ends``: whether the model runs the embeddings or the head (a
        pipeline chunk between them does not, and leaves their segments)."""
        return BlockStream(self, direction, blocks, self.ends if ends else [])

    def tied_chunk(self):
        """(C_wte,) this replica's chunk of the tied wte's gradient when wte
        is a segment of its own (pipeline stages 0 and P-1), else None: the
        pair's sum runs on it (``gradients.GradientSync``)."""
        seg = self.partition.by_name.get(TIED)
        return None if seg is None else self.flat_grad[seg.mine]

    def clear_slot(self, segment: str) -> None:
        """Before ``segment``'s backward: its gradient slot is free (the
        reduce-scatter of the block that used it before has landed) and zero."""
        key = self.slot_of[segment]
        self._land(key)
        slot = self.grad_slots[key]
        slot[...] = 0

    def reduce_slot(self, segment: str) -> None:
        """After ``segment``'s backward: sum its slot over the replica groups
        inside the tensor-parallel group (and its shared kv columns over
        their sharers), then start its reduce-scatter over dp into this
        replica's chunk (in ``gradient_wire``); with --ep its experts' part
        of the slot is reduce-scattered over the expert-data group."""
        key = self.slot_of[segment]
        slot = self.grad_slots[key]
        wire = precision.gradient_wire(self.backend.dtype)
        for comm, run in self.seg_groups.get(segment, []):
            slot[run] = comm.allreduce(slot[run], wire=wire)
        sync_shared(self, self.seg_shared.get(segment, []), wire)       # replicated kv heads' columns
        self._reducing[key] = [(seg, comm.ireduce_scatter(slot[at:at + seg.padded], wire=wire))
                               for seg, comm, at in self.pieces[segment]]

    def _land(self, key) -> None:
        for seg, pending in self._reducing.pop(key, []):
            self.flat_grad[seg.mine] += pending.wait()              # (C_s,) of the segment's sum

    def wait_gradients(self) -> None:
        """Every started reduce-scatter has landed in the chunk gradient."""
        for key in list(self._reducing):
            self._land(key)

    def settle(self) -> None:
        """The chunk gradient is complete once every reduce-scatter landed."""
        self.wait_gradients()

    # --- parameters (--zero 3) -------------------------------------------------
    def prefetch(self, segment: str) -> None:
        """Start gathering ``segment``'s parameters into its slot unless the
        slot holds them or they are on their way."""
        if self.zero != 3 or segment is None or segment in self._gathering:
            return
        self.refresh_work()
        key = self.slot_of[segment]
        if self._resident.get(key) == segment:
            return
        for other in [s for s in self._gathering if self.slot_of[s] == key]:
            for pending in self._gathering.pop(other):              # never two gathers into one slot
                pending.wait()
        self._resident.pop(key, None)
        slot = self.param_slots[key]                                # (dp C_s,) the gathered segment (+ edp C_x)
        self._gathering[segment] = [comm.iallgather(self.work_chunk[seg.mine], out=slot[at:at + seg.padded])
                                    for seg, comm, at in self.pieces[segment]]

    def fetch(self, segment: str) -> None:
        """``segment``'s parameters in its slot, now (waits for a prefetch)."""
        if self.zero != 3:
            return
        self.refresh_work()
        self.prefetch(segment)
        pending = self._gathering.pop(segment, None)
        if pending is not None:
            for gather in pending:
                gather.wait()
            self._resident[self.slot_of[segment]] = segment
