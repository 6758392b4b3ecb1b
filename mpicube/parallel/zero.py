"""``--zero 1``: the optimizer state sharded over the data-parallel replicas
(stage 1 of ZeRO, Rajbhandari et al. 2020); the partitions of ``--zero 2``
and ``--zero 3`` (gradients, then the parameters too, sharded per layer:
``Segments`` here, the buffers and their streaming in ``parallel.fsdp``).

Why: every data-parallel replica of a tensor-parallel position holds the
same parameters, computes the same update and, with ``--zero 0``, keeps
the same AdamW moments (and, under mixed precision, the same float32
master weights): 8 to 12 bytes per local parameter, repeated dp times.
Here replica r keeps only chunk r of them and updates only that chunk.

Partition: the rank's flat buffer (``ParamStore``, P elements) is padded
with zeros to P_pad = dp * C and cut into dp contiguous chunks of C; replica
r owns ``[r C, (r + 1) C)``. Chunks cut through tensors; nothing outside
the step needs to know, because the step hands back complete parameters.

One step, per rank (``training.step.ShardedStep``; the same calls as ``ReplicatedStep``)::

    sync:      partial gradients summed over the tensor-parallel replica
               groups (as --zero 0), then reduce-scattered over dp: the
               rank's chunk of flat_grad holds the summed gradient, the
               rest of flat_grad is stale
    grad_norm: each rank's chunk, blocks replicated inside the tensor-
               parallel group weighted by 1/replicas, summed by one
               all-reduce over the world (every chunk of every position
               exactly once)
    step:      AdamW on the chunk (moments of C elements), then the
               parameters all-gathered over dp: the updated master chunk
               into the full buffer, or under mixed precision its 16-bit
               rounding into the full working copy (half the bytes; the
               master itself stays sharded)

Communication over dp is (dp-1)/dp P_pad gradient elements reduce-scattered
plus (dp-1) C gathered, where --zero 0 all-reduces 2 (dp-1)/dp P: the same
elements when P_pad = P, fewer bytes under mixed precision (the gathered
parameters are 16-bit words; so, under bfloat16, are the gradients both
steps sum, ``precision.gradient_wire``, and then the elements are equal
whatever P: comm_wire's all-reduce pads to dp C too).

Checkpoints keep format version 1 (full logical tensors): the sharded state
is gathered for a save and scattered (each replica keeps its chunk) on a
load, see ``ParamStore.full_master`` / ``writing_master`` and
``AdamW.full_moments`` / ``writing_moments``.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.errors import ConfigError

CHOICES = (0, 1, 2, 3)
SHARDS = {1: "the optimizer state", 2: "the optimizer state and gradients",
          3: "the optimizer state, gradients and parameters"}


def validate(zero: int, dp: int, pp: int = 1, cp: int = 1) -> None:
    """ConfigError for a --zero setting that cannot apply (pure: every rank
    runs it before any collective): sharding needs data-parallel replicas.
    Every --zero composes with --pp and --cp (``pp``, ``cp``: kept so the
    plan's call names every axis; the gradient synchronisation,
    ``parallel.gradients.GradientSync``, adds the ring's and the tied
    pair's sums to the per-layer reduce-scatters)."""
    if zero not in CHOICES:
        raise ConfigError(f"--zero must be 0, 1, 2 or 3, got {zero}")
    if zero and dp < 2:
        raise ConfigError(f"--zero {zero} shards {SHARDS[zero]} over data-parallel replicas and needs "
                          f"--dp 2 or more (got --dp {dp})")


@dataclass(frozen=True)
class Partition:
    """A flat buffer of ``size`` elements in ``parts`` equal contiguous
    chunks (the last padded with zeros); this replica owns chunk ``rank``.
    With one part the rank owns the unpadded whole."""

    size: int        # P: elements the parameters occupy
    parts: int = 1   # dp when sharded, else 1
    rank: int = 0

    @property
    def sharded(self) -> bool:
        return self.parts > 1

    @property
    def padded(self) -> int:
        """P_pad: the buffer length, a multiple of ``parts``."""
        return -(-self.size // self.parts) * self.parts

    @property
    def chunk(self) -> int:
        """C = P_pad / parts: elements each replica owns."""
        return self.padded // self.parts

    @property
    def own(self) -> slice:
        """This replica's chunk of the padded buffer."""
        return slice(self.rank * self.chunk, (self.rank + 1) * self.chunk)

    def local(self, slices) -> list:
        """``slices`` of the whole buffer cut to the owned chunk, in the
        chunk's own coordinates (empty intersections dropped)."""
        own, out = self.own, []
        for s in slices:
            lo, hi = max(s.start, own.start), min(s.stop, own.stop)
            if lo < hi:
                out.append(slice(lo - own.start, hi - own.start))
        return out

    def windows(self) -> list:
        """[(start, stop, shift)]: the owned range of the whole buffer, and
        what to subtract from a position in it to address the chunk."""
        own = self.own
        return [(own.start, own.stop, own.start)]

    def assemble(self, xp, gathered):
        """(P_pad,) the full buffer from the chunks gathered over dp in rank
        order: here they already are it (``Segments.assemble`` reorders)."""
        return gathered

    def take(self, xp, full):
        """(C,) this replica's chunk of a full (P_pad,) buffer."""
        return full[self.own]


class ExpertPartition:
    """``--zero 1`` with ``--ep``: the buffer's dense part (D elements,
    padded to dp C_d) is cut over dp, its experts (X elements, kept last,
    padded to edp C_x) over the expert-data group (the dp/ep replicas that
    hold the same experts, whose gradients alone are summed): a replica
    owns chunk r of the dense part and chunk s of its experts (r, s its
    dp and edp ranks), the (C,) chunk buffer being the two side by side
    (C = C_d + C_x). ``Partition``'s questions answered for two windows;
    ``gather`` and ``scatter`` run the collectives (over dp and edp)."""

    sharded = True

    def __init__(self, dense: int, experts: int, dp, edp):
        self.dp, self.edp = dp, edp
        self.dense = Partition(dense, dp.size, dp.rank)          # over all replicas
        self.experts = Partition(experts, edp.size, edp.rank)    # over the expert-data group
        self.size = dense + experts
        self.padded = self.dense.padded + self.experts.padded   # P_pad: experts start at the dense part's end
        self.chunk = self.dense.chunk + self.experts.chunk      # C = C_d + C_x
        self.expert_at = self.dense.chunk                       # where the experts' part of the chunk starts

    @property
    def own(self) -> slice:
        """What the optimizer updates: the whole (C,) chunk buffer."""
        return slice(0, self.chunk)

    def windows(self) -> list:
        """[(start, stop, shift)]: the owned dense and expert ranges of the
        whole buffer, and what to subtract to address the (C,) chunk buffer."""
        d, x, lo = self.dense.own, self.experts.own, self.dense.padded
        return [(d.start, d.stop, d.start), (lo + x.start, lo + x.stop, lo + x.start - self.dense.chunk)]

    def local(self, slices) -> list:
        """``slices`` of the full buffer cut to the owned chunks, in the
        chunk buffer's coordinates (empty intersections dropped)."""
        out = []
        for s in slices:
            for start, stop, shift in self.windows():
                lo, hi = max(s.start, start), min(s.stop, stop)
                if lo < hi:
                    out.append(slice(lo - shift, hi - shift))
        return out

    def take(self, xp, full):
        """(C,) this replica's chunks of a full (P_pad,) buffer."""
        return xp.concatenate([full[start:stop] for start, stop, _ in self.windows()])

    def gather(self, xp, chunk):
        """(P_pad,) the full buffer from every replica's (C,) ``chunk``: the
        dense chunks all-gathered over dp, the expert chunks over edp
        (collective over dp)."""
        cd = self.dense.chunk
        return xp.concatenate([self.dp.allgather(chunk[:cd]), self.edp.allgather(chunk[cd:])])

    def scatter(self, full, out, wire=None) -> None:
        """``out`` (C,) = this replica's chunk of ``full`` (P_pad,) summed:
        the dense part reduce-scattered over dp, the experts over edp."""
        lo, cd = self.dense.padded, self.dense.chunk
        out[:cd] = self.dp.reduce_scatter(full[:lo], wire=wire)
        out[cd:] = self.edp.reduce_scatter(full[lo:], wire=wire)


def sizes(size: int, dp: int, zero: int) -> tuple:
    """(P_pad, C) for a rank's P parameters under --zero 0 or 1: what the
    cost model predicts (2 and 3: ``segment_sizes``)."""
    p = Partition(size, dp if zero else 1)
    return p.padded, p.chunk


# --- --zero 2 and 3: one partition per layer ------------------------------------
#
# Why per layer: a layer's gradient is reduce-scattered as soon as its
# backward ends, and under --zero 3 its parameters are all-gathered just
# before it runs, so each layer's tensors must form one contiguous bucket
# that a single collective moves. The rank's flat buffer is therefore laid
# out segment by segment: "outside" (wte, wpe, ln_f: what runs before and
# after the blocks), then h.0, h.1, ... (a pipeline stage's store holds only
# its own blocks and ends and gets only their segments; there wte is a
# segment of its own, "wte", see ``segment_of``). Each segment of S elements
# is padded to dp C_s and cut into dp chunks of C_s; replica r owns chunk r
# of every segment, and its optimizer works on their concatenation (C =
# sum of C_s elements, in segment order).
#
# With --ep (experts summed over the expert-data group, not all of dp) a
# block's experts are a segment of their own, "h.{i}.experts", right after
# the block's dense one in the full buffer and cut over edp instead of dp;
# the chunk buffer holds every dense chunk first and every expert chunk
# after them ([C_d | C_x], as ``ExpertPartition``), so the sums that cover
# the dense part only (the cp ring's, under ep folded into dp x cp) and
# the gathers of each kind each see one contiguous run.

OUTSIDE = "outside"
TIED = "wte"
EXPERTS = ".experts"     # "h.{i}" + EXPERTS: block i's experts under --ep (cut over the expert-data group)


def segment_of(name: str, split_tied: bool = False) -> str:
    """The layer a parameter belongs to: "h.{i}" for a block's tensors,
    ``OUTSIDE`` for the embeddings and the final LayerNorm. With
    ``split_tied`` (pipeline stages: stage 0 and stage P-1 each hold a copy
    of the tied wte) wte is a segment of its own, ``TIED``: the two copies
    are then cut into the same dp chunks on both stages, so the pair's sum
    is one all-reduce of the chunk (C_wte elements), after the
    reduce-scatters, instead of a sum of the whole wte gradient (which the
    two stages finish at different times of the schedule)."""
    if name.startswith("h."):
        return ".".join(name.split(".")[:2])
    if split_tied and name == "wte":
        return TIED
    return OUTSIDE


def segment_key(segment: str) -> tuple:
    """Buffer order of segments: outside first, the tied wte (if split),
    then the blocks in order."""
    if segment in (OUTSIDE, TIED):
        return (0, int(segment == TIED))
    return (1, int(segment.split(".")[1]))


def is_end(segment: str) -> bool:
    """Whether ``segment`` is run by a model's ends (embeddings, head), not
    by a block: gathered once per step and kept, each in a slot of its own."""
    return segment in (OUTSIDE, TIED)


@dataclass(frozen=True)
class Segment:
    """One layer's bucket of the flat buffer and this replica's chunk of it."""

    name: str
    lo: int          # first element in the full (padded) buffer
    size: int        # S: elements its parameters occupy
    chunk: int       # C_s = ceil(S / dp)
    at: int          # where this replica's chunk starts in the rank's (C,) chunk buffer
    parts: int
    rank: int
    expert: bool = False     # an expert segment (--ep): cut over the expert-data group

    @property
    def padded(self) -> int:
        return self.chunk * self.parts

    @property
    def full(self) -> slice:
        """The segment in the full buffer (padding included)."""
        return slice(self.lo, self.lo + self.padded)

    @property
    def own(self) -> slice:
        """This replica's chunk of the segment, in the full buffer."""
        return slice(self.lo + self.rank * self.chunk, self.lo + (self.rank + 1) * self.chunk)

    @property
    def mine(self) -> slice:
        """The same chunk in the rank's (C,) chunk buffer."""
        return slice(self.at, self.at + self.chunk)


class Segments:
    """The partition of --zero 2 and 3: ``Partition``'s questions answered
    for a buffer cut segment by segment (``sizes``: (segment name, S) or
    (segment name, S, expert) in buffer order; expert segments are cut
    into ``expert_parts`` chunks of which this rank owns ``expert_rank``)."""

    sharded = True

    def __init__(self, sizes, parts: int, rank: int = 0, expert_parts: int = 1, expert_rank: int = 0):
        self.parts, self.rank, self.list = parts, rank, []
        sizes = [(name, size, bool(rest and rest[0])) for name, size, *rest in sizes]
        self.expert_at = sum(-(-size // parts) for _, size, expert in sizes if not expert)   # C_d
        lo, at = 0, {False: 0, True: self.expert_at}       # dense chunks first in the chunk buffer, then experts'
        for name, size, expert in sizes:
            n, r = (expert_parts, expert_rank) if expert else (parts, rank)
            chunk = -(-size // n)
            self.list.append(Segment(name, lo, size, chunk, at[expert], n, r, expert))
            lo, at[expert] = lo + chunk * n, at[expert] + chunk
        self.by_name = {s.name: s for s in self.list}
        self.padded, self.chunk = lo, at[True]    # P_pad = sum parts C_s, C = sum C_s
        self.size = sum(s.size for s in self.list)

    @property
    def own(self) -> slice:
        """What the optimizer updates: the whole (C,) chunk buffer."""
        return slice(0, self.chunk)

    def local(self, slices) -> list:
        """``slices`` of the full buffer cut to the owned chunks, in the
        (C,) chunk buffer's coordinates (empty intersections dropped)."""
        out = []
        for s in slices:
            for seg in self.list:
                own = seg.own
                lo, hi = max(s.start, own.start), min(s.stop, own.stop)
                if lo < hi:
                    out.append(slice(lo - own.start + seg.at, hi - own.start + seg.at))
        return out

    def sites(self) -> dict:
        """{site: [(segment, where it starts in the site's slot)]}: each
        block "h.{i}" (or end segment) and its segments in buffer order,
        its experts' (--ep) after its dense one; a slot holds them all."""
        out = {}
        for seg in self.list:
            held = out.setdefault(seg.name.removesuffix(EXPERTS), [])
            held.append((seg, sum(other.padded for other, _ in held)))
        return out

    def windows(self) -> list:
        """[(start, stop, shift)] per segment: the owned chunk's range of the
        whole buffer, and what to subtract to address the (C,) chunk buffer."""
        return [(seg.own.start, seg.own.stop, seg.own.start - seg.at) for seg in self.list]

    def assemble(self, xp, gathered, experts=None):
        """(P_pad,) the full buffer from the chunk buffers' dense parts
        gathered over dp in rank order, ``gathered`` (dp C_d,), and (with
        expert segments) their expert parts gathered over the expert-data
        group, ``experts`` (edp C_x,)."""
        cd = self.expert_at
        rows = {False: gathered.reshape(self.parts, cd)}                  # (dp, C_d)
        if experts is not None:
            rows[True] = experts.reshape(-1, self.chunk - cd)              # (edp, C_x)
        return xp.concatenate([rows[seg.expert][:, seg.at - cd * seg.expert:][:, :seg.chunk].reshape(-1)
                               for seg in self.list])

    def take(self, xp, full):
        """(C,) this replica's chunks of a full (P_pad,) buffer."""
        out = xp.zeros(self.chunk, dtype=full.dtype)                       # (C,)
        for seg in self.list:
            out[seg.mine] = full[seg.own]
        return out


def segment_sizes(named_sizes, dp: int, zero: int, split_tied: bool = False) -> list:
    """[(segment name, S, C_s)] in buffer order for a rank's parameters
    ``named_sizes`` ((name, local elements) pairs): what the store builds
    and the cost model predicts (``split_tied``: as ``segment_of``)."""
    totals = {}
    for name, n in named_sizes:
        seg = segment_of(name, split_tied)
        totals[seg] = totals.get(seg, 0) + n
    parts = dp if zero >= 2 else 1
    return [(seg, totals[seg], -(-totals[seg] // parts)) for seg in sorted(totals, key=segment_key)]
