"""Analytic communication and FLOPs per rank per training step (memory:
``costmemory``, which shares the ``Problem`` and parameter sizes here).

Each layout's function walks the same collective sequence its code issues
(layouts/*.py), with the ring conventions of ``mpicube.parallel.comm``, and returns
the elements and messages per axis. Tests check that these predictions
equal the measured counters exactly, so this file and the layouts cannot
drift apart silently. The formulas of DESIGN.md section 4 fall out as the
linear-layer part of ``cube``.

Bytes follow from what each collective carries (``Widths``): activations,
weight copies and the panels layouts gather or broadcast travel in the
storage format (2 bytes under mixed precision), and so do the sums of
activations, activation gradients and weight-gradient partials (16-bit
words added in float32 at the receiver, ``mpicube.parallel.comm_wire``). The small
statistics (LayerNorm's per-row sums, the cross-entropy's max, sum and
target logit) are reduced in the compute format (float32), and the
gradient norm and the loss as one float64 each. The summed gradients of
replicated parameters (replica groups, data parallelism) travel at
``Widths.gsum`` (``precision.gradient_wire_name``): 2 bytes under
bfloat16 (comm_wire's all-reduce, priced by ``Traffic.sum``, and its
reduce-scatter under --zero 1), the master format otherwise (float16's
loss-scaled gradients would overflow a 16-bit sum). bfloat16 therefore
moves half of float32's bytes but for those statistics and scalars, with
data parallelism too (1-D p = 2 x dp = 2, the ``make train`` model:
2.39 MB per rank and step against 4.78 MB; float16 3.45 MB).

Recompute modes (``Problem.recompute``, layouts/base.py):

* "gathers" adds the second gathering of every panel a layout let go of
  after forward (3-D: X and W of each linear, the LM head's input and wte
  panel; 2-D/2.5-D: the wte panel; 1-D: the row-sharded inputs of the
  column-parallel linears and of the LM head) and drops them from the saved
  activations. The panels gathered again in backward are transient, like
  the gathered dY of every backward today, and are not counted as memory.
* "blocks" adds every collective of each block's forward a second time
  (1-D also the all-gather of the row-sharded block input); the saved
  activations are each block's input plus what lies outside the blocks,
  and ``activation_terms`` adds the working set of one rerun block (its
  caches and dropout masks, measured as ``GPT.recompute_peak_*``), since
  backward holds that on top.

``Problem.zero = 1`` (mpicube.parallel.zero, with dp > 1): the buffers are padded to
P_pad = dp C; the dp all-reduce becomes a reduce-scatter of the padded
gradient (at ``Widths.gsum``) and an all-gather of the updated chunk
(storage format), the gradient norm is all-reduced over the world, and AdamW keeps
2 C moments. Under mixed precision the float32 master is the chunk only
and is counted with the parameters (C master + P_pad working copy), as the
master is counted there with --zero 0.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field, replace
from fractions import Fraction

from ..parallel import zero
from ..parallel.context import ring_scores
from ..core.config import ModelConfig
from ..model.gpt import gpt_params
from ..device.precision import gradient_wire_name


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
class Traffic:
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

    def total_elems(self) -> Fraction:
        return sum(self.elems.values(), Fraction(0))

    def total_bytes(self) -> Fraction:
        return sum(self.bytes.values(), Fraction(0))

    def total_msgs(self) -> int:
        return sum(self.msgs.values())


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
    cp: int = 1              # context-parallel ranks: each holds seq_len / cp positions (parallel.context)

    @property
    def local_seq(self) -> int:
        """Positions of each sequence on one rank: 2 chunks of seq_len / 2cp."""
        return self.seq_len // self.cp

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
        """Whether the optimizer state is sharded (--zero 1 with dp > 1)."""
        return bool(self.zero) and self.dp > 1


def block_linears(cfg: ModelConfig):
    """(h_in, h_out, position) of every linear of one block."""
    h = cfg.n_embd
    return [(h, 3 * h, "first"), (h, h, "second"), (h, 4 * h, "first"), (4 * h, h, "second")]


def _layernorm(t: Traffic, axis, g, rows, count, width):  # statistics: width is Widths.stat
    """Forward: mean and variance all-reduces; backward: one of two sums."""
    t.allreduce(axis, g, rows, times=2 * count, width=width)
    t.allreduce(axis, g, 2 * rows, times=count, width=width)


def _cross_entropy(t: Traffic, axis, g, rows, width):
    t.allreduce(axis, g, rows, times=3, width=width)   # max, sum of exp, target logit


def serial_traffic(p: Problem) -> Traffic:
    return Traffic()


def oned_traffic(p: Problem) -> Traffic:
    t, g, w = Traffic(), p.tp, p.widths
    act = p.local_batch * p.seq_len * p.cfg.n_embd       # a replicated activation
    t.sum("tp", g, act, times=4 * p.cfg.n_layer, width=w.red)   # 2 forward (row-split), 2 backward
    t.sum("tp", g, act, times=2, width=w.red)             # embedding lookup, LM head backward
    _cross_entropy(t, "tp", g, p.local_batch * p.seq_len, w.stat)
    if p.recompute == "gathers":                          # c_attn, c_fc and LM head inputs from row shards
        t.allgather("tp", g, act // g, times=2 * p.cfg.n_layer + 1, width=w.act)
    if p.recompute == "blocks":                           # block inputs from row shards, forwards again
        t.allgather("tp", g, act // g, times=p.cfg.n_layer, width=w.act)
        t.sum("tp", g, act, times=2 * p.cfg.n_layer, width=w.red)
    return t


def tesseract_traffic(p: Problem) -> Traffic:
    t, cfg, d, w = Traffic(), p.cfg, p.depth, p.widths
    q = round((p.tp // d) ** 0.5)
    n = p.local_batch * p.seq_len // (d * q)              # activation rows per rank
    V = -(-cfg.vocab_size // q) * q
    forwards = 2 if p.recompute == "blocks" else 1            # blocks: each block's forward again
    for h_in, h_out, _ in block_linears(cfg) * cfg.n_layer:
        x_panel, w_panel = n * h_in // q, (h_in // q) * (h_out // q)
        t.bcast("row", q, x_panel, times=(forwards + 1) * q, width=w.act)   # forward, and again for dW
        t.reduce_onto("row", q, x_panel, times=q, width=w.red)  # dX
        t.bcast("col", q, w_panel, times=(forwards + 1) * q, width=w.act)   # forward, and again for dX
        t.reduce_onto("col", q, w_panel, times=q, width=w.red)  # dW
    _layernorm(t, "row", q, n, 2 * cfg.n_layer + 1, w.stat)
    if forwards == 2:
        t.allreduce("row", q, n, times=2 * 2 * cfg.n_layer, width=w.stat)   # ln_1, ln_2 statistics again
    gathers = 2 if p.recompute == "gathers" else 1            # gathers: wte panel again for the head backward
    t.allgather("col", q, (V // q) * (cfg.n_embd // q), times=gathers, width=w.act)   # wte[:, block c]
    t.reduce_scatter("row", q, n * V, width=w.red)                # LM head forward
    t.allgather("row", q, n * V // q, width=w.act)                # LM head backward
    t.reduce_scatter("col", q, V * (cfg.n_embd // q), width=w.red)    # wte gradient
    _cross_entropy(t, "row", q, n, w.stat)
    return t


def cube_traffic(p: Problem) -> Traffic:
    t, cfg, w = Traffic(), p.cfg, p.widths
    q = round(p.tp ** (1 / 3))
    n = p.local_batch * p.seq_len // (q * q)              # canonical rows per rank
    h = cfg.n_embd
    V = -(-cfg.vocab_size // q) * q
    gathers = 2 if p.recompute == "gathers" else 1     # gathers: X and W again in backward
    forwards = 2 if p.recompute == "blocks" else 1     # blocks: each block's forward again
    for h_in, h_out, position in block_linears(cfg) * cfg.n_layer:
        a, b = ("j", "k") if position == "first" else ("k", "j")
        t.allgather(a, q, n * h_in // q, times=forwards * gathers, width=w.act)                        # X over a
        t.allgather("i", q, (h_in // (q * q)) * (h_out // q), times=forwards * gathers, width=w.act)   # W over i
        t.reduce_scatter(b, q, n * q * h_out // q, times=forwards, width=w.red)               # Y over b
        t.allgather(b, q, n * h_out // q, width=w.act)                        # dY over b
        t.reduce_scatter(a, q, n * q * h_in // q, width=w.red)                # dX over a
        t.reduce_scatter("i", q, (h_in // q) * (h_out // q), width=w.red)     # dW over i
    _layernorm(t, "k", q, n, 2 * cfg.n_layer + 1, w.stat)
    if forwards == 2:
        t.allreduce("k", q, n, times=2 * 2 * cfg.n_layer, width=w.stat)      # ln_1, ln_2 statistics again
    t.allgather("i", q, (V // q) * (h // (q * q)), times=gathers, width=w.act)   # wte over i
    t.reduce_scatter("j", q, n * q * h // q, width=w.red)         # lookup
    t.allgather("j", q, n * h // q, times=gathers, width=w.act)   # head: X over j
    t.reduce_scatter("k", q, n * q * V // q, width=w.red)         # head: logits over k
    t.allgather("k", q, n * V // q, width=w.act)                  # head backward: dlogits
    t.reduce_scatter("j", q, n * q * h // q, width=w.red)         # head backward: dX
    t.allgather("j", q, n * h // q, width=w.act)                  # lookup backward: dX
    t.reduce_scatter("i", q, (V // q) * (h // q), width=w.red)    # wte gradient
    _cross_entropy(t, "j", q, n, w.stat)
    return t


TRAFFIC = {"serial": serial_traffic, "1d": oned_traffic, "2d": tesseract_traffic,
           "2.5d": tesseract_traffic, "3d": cube_traffic}


def local_param_sizes(p: Problem) -> dict:
    """{name: (local elements, gradient axis or None)} for one rank, from the
    sharding rules of each layout (closed forms, not the layout code)."""
    cfg, out = p.cfg, {}
    for decl in gpt_params(cfg):
        out[decl.name] = _local_size(p, decl)
    return out


def _local_size(p: Problem, decl):
    role, shape, cfg = decl.role, decl.shape, p.cfg
    numel = 1
    for n in shape:
        numel *= n
    if p.layout == "serial":
        return numel, None
    if p.layout == "1d":
        g = p.tp
        if role == "wte":
            return -(-cfg.vocab_size // g) * cfg.n_embd, None
        if role in ("w_first", "b_first", "w_second"):
            return numel // g, None
        return numel, None
    if p.layout in ("2d", "2.5d"):
        d = p.depth
        q = round((p.tp // d) ** 0.5)
        on_depth = "depth" if d > 1 else None
        if role == "wte":
            return -(-cfg.vocab_size // q) * cfg.n_embd // q, on_depth
        if role in ("w_first", "w_second"):
            return numel // (q * q), on_depth
        return numel // q, "col_depth"     # wpe, norm, biases: hidden block c
    q = round(p.tp ** (1 / 3))
    if role == "wte":
        return -(-cfg.vocab_size // q) * cfg.n_embd // (q * q), None
    if role in ("w_first", "w_second"):
        return numel // (q ** 3), None
    if role == "b_first":
        return numel // q, "ik"
    return numel // q, "ij"                # wpe, norm, b_second


def step_traffic(p: Problem) -> Traffic:
    """Everything one training step moves: the layout's forward/backward
    once per micro-batch (at the micro-batch's sizes), then once per step
    the gradient all-reduces over replica groups and over dp (at the
    ``Widths.gsum`` wire) and the gradient norm; the reported loss once per
    micro-batch (each forward returns its share, GPT.forward). Under
    --zero 1 the dp all-reduce is a reduce-scatter of the padded gradient
    and an all-gather of the updated chunk (in the storage format), and the
    norm is summed over the world."""
    t = Traffic()
    t.add(TRAFFIC[p.layout](replace(p, seq_len=p.local_seq, cp=1)), p.grad_accum)   # on this rank's positions
    if p.cp > 1:
        t.add(ring_traffic(p), p.grad_accum)
        t.sum("cp", p.cp, sum(n for n, _ in local_param_sizes(p).values()), width=p.widths.gsum)   # weights' sum
    sizes = local_param_sizes(p)
    group_sizes = defaultdict(int)
    for n, axis in sizes.values():
        if axis is not None:
            group_sizes[axis] += n
    w = p.widths
    for axis, n in group_sizes.items():
        t.sum(axis, _group_size(p, axis), n, width=w.gsum)
    params = sum(n for n, _ in sizes.values())
    if p.sharded:
        padded, chunk = zero.sizes(params, p.dp, p.zero)
        t.reduce_scatter("dp", p.dp, padded, width=w.gsum)     # (16-bit words counted as MPI's)
        t.allgather("dp", p.dp, chunk, width=w.act)            # parameters after the step
        t.allreduce("world", p.tp * p.dp * p.cp, 1, width=w.scalar)   # gradient norm
    else:
        t.sum("dp", p.dp, params, width=w.gsum)
        t.allreduce("tp", p.tp, 1, width=w.scalar)             # gradient norm
    t.allreduce("world", p.tp * p.dp * p.cp, 1, times=p.grad_accum, width=w.scalar)   # loss, per micro-batch
    return t


def attention_split(p: Problem) -> tuple:
    """(sequences, heads) of one rank's attention: the rows and heads of
    the layout's intermediate activation (between paired linears)."""
    if p.layout in ("serial", "1d"):
        return p.local_batch, p.cfg.n_head // (p.tp if p.layout == "1d" else 1)
    q = round((p.tp // p.depth) ** 0.5) if p.layout in ("2d", "2.5d") else round(p.tp ** (1 / 3))
    rows = p.depth * q if p.layout in ("2d", "2.5d") else q * q
    return p.local_batch // rows, p.cfg.n_head // q


def ring_traffic(p: Problem) -> Traffic:
    """One micro-batch of ring attention (parallel.context), per layer: the
    K/V pair of this rank's chunks (2 x seqs x T/cp x h_local elements)
    shifted C-1 times in forward (twice under --recompute blocks), and in
    backward C-1 times more, with the dK/dV pair in the compute format C
    times. One message per shift."""
    t, w, C = Traffic(), p.widths, p.cp
    seqs, heads = attention_split(p)
    kv = 2 * seqs * p.local_seq * heads * p.cfg.head_dim
    forwards = 2 if p.recompute == "blocks" else 1
    t._add("cp", C, kv, 1, (forwards + 1) * (C - 1) * p.cfg.n_layer, w.act)
    t._add("cp", C, kv, 1, C * p.cfg.n_layer, w.stat)
    return t


def step_flops(p: Problem) -> Fraction:
    """GEMM and attention FLOPs per rank per step, from the sizes alone (a
    prediction, not measured: nothing counts FLOPs at run time). Forward
    2 m n k per GEMM (the four linears of every block, the LM head over the
    layout's padded vocabulary), backward twice the forward, and under
    --recompute blocks every block's forward once more. Attention is
    blockwise (ops.attention_blocks): its two products run only on the
    blocks at or below the diagonal (``ring_scores``: about half of T^2
    at long T), and backward makes five products of that size (the scores
    again, dV, dP, dQ, dK). Every layout splits each of these evenly over
    its tensor-parallel ranks, and context parallelism over its cp ranks,
    so one rank does 1/(tp cp) of its replica's work."""
    cfg, L, h, T = p.cfg, p.cfg.n_layer, p.cfg.n_embd, p.seq_len
    N = p.local_batch * T                                            # tokens per replica and micro-batch
    linears = sum(2 * N * h_in * h_out for h_in, h_out, _ in block_linears(cfg))
    attention = 2 * 2 * p.local_batch * ring_scores(T, p.cp) * h     # q k^T and probs v on the computed blocks
    head = 2 * N * h * _padded_vocab(p)
    forwards = 2 if p.recompute == "blocks" else 1
    work = 3 * (L * linears + head) + (forwards - 1) * L * linears + L * Fraction(2 * forwards + 5, 2) * attention
    return Fraction(p.grad_accum * work, p.tp * p.cp)                 # N micro-batches


def _padded_vocab(p: Problem) -> int:
    """The vocabulary the layout's LM head multiplies by (padded to its split)."""
    if p.layout == "serial":
        split = 1
    elif p.layout == "1d":
        split = p.tp
    elif p.layout in ("2d", "2.5d"):
        split = round((p.tp // p.depth) ** 0.5)
    else:
        split = round(p.tp ** (1 / 3))
    return -(-p.cfg.vocab_size // split) * split


def _group_size(p: Problem, axis: str) -> int:
    if axis == "depth":
        return p.depth
    if axis == "col_depth":
        return p.tp // round((p.tp // p.depth) ** 0.5)
    q = round(p.tp ** (1 / 3))
    return q * q                               # ij, ik planes of the cube
