"""The values the cost model works over: the ``Problem`` one rank sees,
the byte ``Widths`` of each kind of data, and ``Traffic``, the elements,
bytes and messages per axis. Shared by ``costmodel`` (collectives),
``costpipe`` (the pipeline's point-to-point traffic), ``costmemory`` and
``costflops``; ``costmodel`` re-exports them, their usual import."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from fractions import Fraction

from ..core.config import ModelConfig
from ..device.precision import gradient_wire_name
from ..parallel.comm_counters import Totals
from ..parallel.schedules import VEE_SCHEDULES, chunk_place, layer_split, model_chunk


@dataclass(frozen=True)
class Widths:
    """Bytes per element of each kind of data a step moves or keeps."""

    act: int     # activations, the weights' working copy, gathered and broadcast panels
    red: int     # the wire of sums of activations, their gradients, weight-gradient partials
    grad: int    # gradients, master weights, Adam moments
    stat: int    # per-row statistics, kept and reduced in the compute format
    gsum: int    # the wire of the replica-group and dp gradient sums (precision.gradient_wire_name)
    scalar: int = 8   # the gradient norm and the loss (float64)

    @classmethod
    def of(cls, dtype: str) -> "Widths":
        storage = STORAGE_BYTES[dtype]
        wide = max(4, storage)          # 16-bit formats compute and keep gradients in float32
        gsum = STORAGE_BYTES[gradient_wire_name(dtype)]
        return cls(act=storage, red=storage, grad=wide, stat=wide, gsum=gsum)


STORAGE_BYTES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2}


@dataclass
class Traffic(Totals):
    """Elements, bytes and messages per axis for one rank and one step."""

    elems: dict = field(default_factory=lambda: defaultdict(Fraction))
    msgs: dict = field(default_factory=lambda: defaultdict(int))
    bytes: dict = field(default_factory=lambda: defaultdict(Fraction))

    def _add(self, axis, g, elems, msgs, times, width):
        if g > 1 and times:
            self.elems[axis] += Fraction(elems) * times
            self.bytes[axis] += Fraction(elems) * times * width
            self.msgs[axis] += msgs * times

    def allreduce(self, axis, g, n, times=1, width=4):
        self._add(axis, g, Fraction(2 * (g - 1), g) * n, 2 * (g - 1), times, width)

    def allgather(self, axis, g, n_local, times=1, width=4):
        self._add(axis, g, (g - 1) * n_local, g - 1, times, width)

    def reduce_scatter(self, axis, g, n_in, times=1, width=4):
        self._add(axis, g, Fraction(g - 1, g) * n_in, g - 1, times, width)

    # Widths of 2 bytes are the 16-bit wire (every wide format is 4 or 8).
    def sum(self, axis, g, n, times=1, width=4):
        """An all-reduce of n elements that travels in ``width`` bytes: MPI's
        ring figures in a wide format, or in 16 bits ``comm_wire``'s
        all-to-all + all-gather of ceil(n/g) elements per rank each."""
        if width == 2:
            self._add(axis, g, 2 * (g - 1) * -(-n // g), 2 * (g - 1), times, width)
        else:
            self.allreduce(axis, g, n, times, width)

    def reduce_onto(self, axis, g, n, times=1, width=4):
        """A reduce of n elements onto a root that travels in ``width``
        bytes: MPI's (n, g-1) in a wide format, or in 16 bits
        ``comm_wire``'s all-to-all + gather of ceil(n/g) elements each."""
        if width == 2:
            self._add(axis, g, 2 * (g - 1) * -(-n // g), 2 * (g - 1), times, width)
        else:
            self.reduce(axis, g, n, times, width)

    def bcast(self, axis, g, n, times=1, width=4):
        self._add(axis, g, n, g - 1, times, width)

    reduce = bcast

    def add(self, other: "Traffic", times: int = 1) -> None:
        """Add ``times`` repetitions of ``other`` (micro-batches)."""
        for axis in other.elems:
            self.elems[axis] += other.elems[axis] * times
            self.bytes[axis] += other.bytes[axis] * times
            self.msgs[axis] += other.msgs[axis] * times


@dataclass
class Problem:
    """The sizes one step works on, as one rank sees them."""

    cfg: ModelConfig
    layout: str
    tp: int
    dp: int
    depth: int
    batch: int          # global sequences per step
    seq_len: int
    dtype: str = "float32"   # storage format: float64, float32, float16 or bfloat16
    recompute: str = "none"  # none, gathers or blocks (layouts/base.py RECOMPUTE_MODES)
    zero: int = 0            # 1: optimizer state (and a 16-bit run's master) sharded over dp (mpicube.parallel.zero)
    grad_accum: int = 1      # micro-batches per step (mpicube.training.accum)
    pp: int = 1              # pipeline stages (mpicube.parallel.schedules); world = dp x pp x tp
    pp_schedule: str = "1f1b"   # gpipe, 1f1b, interleaved, zb-h1, zbv or dualpipev (schedules.ALL_SCHEDULES)
    virtual_stages: int = 1  # chunks per stage under interleaved
    stage: int = 0           # the stage this rank runs (0..pp-1); every per-rank figure is for it
    sequence_parallel: bool = False   # 1-D: canonical activations a T/tp shard (parallel/layouts/seqpar.py)
    cp: int = 1              # context-parallel ranks: each holds seq_len / cp positions (parallel.context)
    ulysses: int = 1         # of them, the Ulysses group size U (parallel.ulysses; the ring runs over cp / U)
    optimizer: str = "adamw"  # adamw, sgd or muon (training.muon gathers the hidden matrices)
    hsdp: int = 1            # --hsdp R: ZeRO-3 over dp/R-way shard groups, their chunks all-reduced over R
    ep: int = 1              # expert-parallel ranks (a mixture: E/ep experts a rank, parallel.experts)
    ep_rank: int = 0         # this rank's among them (which of a measured routing's peers is itself)
    routing: tuple = None    # a mixture's measured rows: per micro-batch, per MoE layer (costexperts.Rows)
    fp8: str = ""            # --fp8's recipe name ("" off): its amax all-reduces (costfp8)

    @property
    def local_seq(self) -> int:
        """Positions of each sequence on one rank: 2 chunks of seq_len / 2cp."""
        return self.seq_len // self.cp

    @property
    def stage_chunks(self) -> list:
        """Model chunks on this stage: stage + v * pp for v < virtual_stages
        (stage and 2 pp - 1 - stage in zbv's V: ``schedules.model_chunk``)."""
        return [model_chunk(self.pp_schedule, self.stage, v, self.pp) for v in range(self.virtual_stages)]

    @property
    def chunk_layers(self) -> list:
        """The layer ranges of every model chunk (``layer_split``)."""
        return layer_split(self.cfg.n_layer, self.pp * self.virtual_stages)

    @property
    def layers(self) -> int:
        """The main model's transformer blocks on this stage (n_layer without a pipeline)."""
        split = self.chunk_layers
        return sum(len(split[k]) for k in self.stage_chunks)

    @property
    def mtp(self) -> int:
        """Multi-token prediction depths this stage runs: all of them on the
        stage with the head (model/mtp.py), none elsewhere."""
        return self.cfg.mtp_depth if self.has_head else 0

    @property
    def blocks(self) -> int:
        """Transformer blocks this stage runs: its layers and each MTP depth's block."""
        return self.layers + self.mtp

    @property
    def has_embed(self) -> bool:      # chunk 0: the lookup of wte and wpe
        return self.stage == 0

    @property
    def has_head(self) -> bool:       # the last chunk: ln_f and the LM head (tied wte); stage 0 in a V
        return self.stage == chunk_place(self.pp_schedule, self.pp * self.virtual_stages - 1, self.pp)[0]

    @property
    def tied_pair(self) -> bool:
        """Whether wte is held on two stages and summed over the pair: tied to
        the head, or looked up by the MTP depths on the last stage (not in
        a V, whose ends share stage 0)."""
        return self.pp > 1 and (self.cfg.tied or self.cfg.mtp_depth > 0) and self.pp_schedule not in VEE_SCHEDULES

    @property
    def local_batch(self):
        """Sequences per replica in one forward pass: the micro-batch, which
        sizes every activation and activation-borne collective."""
        return self.batch // self.dp // self.grad_accum

    @property
    def widths(self) -> Widths:
        return Widths.of(self.dtype)

    @property
    def sharded(self) -> bool:
        """Whether the optimizer state is sharded (--zero 1, 2 or 3 with dp > 1)."""
        return bool(self.zero) and self.dp > 1

    @property
    def edp(self) -> int:
        """Ranks holding the same experts (the expert-data group, dp cp / ep)."""
        return self.dp * self.cp // self.ep

    @property
    def shard_dp(self) -> int:
        """The replicas ZeRO cuts the state over: dp, or dp / R under --hsdp R."""
        return self.dp // self.hsdp

    @property
    def segmented(self) -> bool:
        """Whether gradients (and under 3 weights) are sharded per layer (--zero 2, 3)."""
        return self.zero >= 2 and self.dp > 1
