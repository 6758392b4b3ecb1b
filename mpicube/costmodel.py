"""Analytic communication and memory per rank per training step.

Each layout's function walks the same collective sequence its code issues
(layouts/*.py), with the ring conventions of ``mpicube.comm``, and returns
the elements and messages per axis. Tests check that these predictions
equal the measured counters exactly, so this file and the layouts cannot
drift apart silently. The formulas of DESIGN.md section 4 fall out as the
linear-layer part of ``cube``.

Bytes follow from what each collective carries (``Widths``): activations,
weight copies and the panels layouts gather or broadcast travel in the
storage format (2 bytes under mixed precision), and so do the sums of
activations, activation gradients and weight-gradient partials (16-bit
words added in float32 at the receiver, ``mpicube.comm_wire``). The small
statistics (LayerNorm's per-row sums, the cross-entropy's max, sum and
target logit) are reduced in the compute format (float32), the summed
gradients of replicated parameters (replica groups, data parallelism) in
the master format, and the gradient norm and the loss as one float64 each.
Under mixed precision, bfloat16 therefore moves half of float32's bytes but
for those statistics and gradient sums.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from fractions import Fraction

from .config import ModelConfig
from .grid import plan
from .model import gpt_params


@dataclass(frozen=True)
class Widths:
    """Bytes per element of each kind of data a step moves or keeps."""

    act: int     # activations, the weights' working copy, gathered and broadcast panels
    red: int     # the wire of sums of activations, their gradients, weight-gradient partials
    grad: int    # gradients, master weights, Adam moments; replica and dp gradient sums
    stat: int    # per-row statistics, kept and reduced in the compute format
    scalar: int = 8   # the gradient norm and the loss (float64)

    @classmethod
    def of(cls, dtype: str) -> "Widths":
        storage = STORAGE_BYTES[dtype]
        wide = max(4, storage)          # 16-bit formats compute and keep gradients in float32
        return cls(act=storage, red=storage, grad=wide, stat=wide)


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

    @property
    def local_batch(self):
        return self.batch // self.dp

    @property
    def widths(self) -> Widths:
        return Widths.of(self.dtype)


def _linears(cfg: ModelConfig):
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
    return t


def tesseract_traffic(p: Problem) -> Traffic:
    t, cfg, d, w = Traffic(), p.cfg, p.depth, p.widths
    q = round((p.tp // d) ** 0.5)
    n = p.local_batch * p.seq_len // (d * q)              # activation rows per rank
    V = -(-cfg.vocab_size // q) * q
    for h_in, h_out, _ in _linears(cfg) * cfg.n_layer:
        x_panel, w_panel = n * h_in // q, (h_in // q) * (h_out // q)
        t.bcast("row", q, x_panel, times=2 * q, width=w.act)    # forward, and again for dW
        t.reduce_onto("row", q, x_panel, times=q, width=w.red)  # dX
        t.bcast("col", q, w_panel, times=2 * q, width=w.act)    # forward, and again for dX
        t.reduce_onto("col", q, w_panel, times=q, width=w.red)  # dW
    _layernorm(t, "row", q, n, 2 * cfg.n_layer + 1, w.stat)
    t.allgather("col", q, (V // q) * (cfg.n_embd // q), width=w.act)   # wte[:, block c]
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
    for h_in, h_out, position in _linears(cfg) * cfg.n_layer:
        a, b = ("j", "k") if position == "first" else ("k", "j")
        t.allgather(a, q, n * h_in // q, width=w.act)                         # X over a
        t.allgather("i", q, (h_in // (q * q)) * (h_out // q), width=w.act)    # W over i
        t.reduce_scatter(b, q, n * q * h_out // q, width=w.red)               # Y over b
        t.allgather(b, q, n * h_out // q, width=w.act)                        # dY over b
        t.reduce_scatter(a, q, n * q * h_in // q, width=w.red)                # dX over a
        t.reduce_scatter("i", q, (h_in // q) * (h_out // q), width=w.red)     # dW over i
    _layernorm(t, "k", q, n, 2 * cfg.n_layer + 1, w.stat)
    t.allgather("i", q, (V // q) * (h // (q * q)), width=w.act)   # wte over i
    t.reduce_scatter("j", q, n * q * h // q, width=w.red)         # lookup
    t.allgather("j", q, n * h // q, width=w.act)                  # head: X over j
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


@dataclass
class Memory:
    """Elements held per rank, by category (``step_memory``), or their
    bytes (``step_memory_bytes``)."""

    params: int
    grads: int
    optimizer: int
    activations: int

    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations


def activation_elems(p: Problem, dropout: bool = False) -> int:
    """Elements kept for backward after one forward pass (what
    ``GPT.saved_elements`` measures)."""
    return sum(activation_terms(p, dropout).values())


def activation_bytes(p: Problem, dropout: bool = False) -> int:
    """Bytes of ``activation_elems`` (what ``GPT.saved_bytes`` measures):
    activations in the storage format, LayerNorm's per-row statistics in the
    compute format, the gradient panels of the tied embedding in the master
    format."""
    w = p.widths
    width = {"act": w.act, "stat": w.stat, "grad": w.grad}
    return sum(n * width[kind] for kind, n in activation_terms(p, dropout).items())


def activation_terms(p: Problem, dropout: bool = False) -> dict:
    """{"act", "stat", "grad": elements} kept for backward: LayerNorm
    outputs and statistics, linear inputs (gathered in 3-D), q/k/v,
    attention probabilities, GELU input and tanh, logits and softmax,
    gathered embedding panels and their gradients, masks."""
    cfg, T, L, h = p.cfg, p.seq_len, p.cfg.n_layer, p.cfg.n_embd
    if p.layout in ("serial", "1d"):
        q, split_rows, split_cols, heads = 1, 1, 1, (p.tp if p.layout == "1d" else 1)
        V = -(-cfg.vocab_size // heads) * heads // heads
        mid_cols = h // heads
    elif p.layout in ("2d", "2.5d"):
        q = round((p.tp // p.depth) ** 0.5)
        split_rows, split_cols, heads = p.depth * q, q, q
        V = -(-cfg.vocab_size // q)
        mid_cols = h // q
    else:
        q = round(p.tp ** (1 / 3))
        split_rows, split_cols, heads = q * q, q, q
        V = -(-cfg.vocab_size // q)
        mid_cols = h // q
    seqs = p.local_batch // split_rows
    n = seqs * T                       # token rows per rank, canonical and intermediate alike
    cc = h // split_cols               # canonical width
    probs = seqs * (cfg.n_head // heads) * T * T
    # LN xhat (x2), qkv and the scaled copy of q, probabilities, GELU input and tanh
    act = L * (2 * n * cc + n * 4 * mid_cols + probs + 2 * n * 4 * mid_cols) + n * cc + 2 * n * V
    stat = (2 * L + 1) * n                      # LayerNorm rstd: per row, ln_1, ln_2 and ln_f
    grad = 0
    # On a grid of one rank (q = 1) a "gathered" weight is the parameter itself, not a copy.
    gathered = q > 1
    if p.layout == "3d":
        for h_in, h_out, _ in _linears(cfg):
            act += L * q * n * h_in // q                                     # gathered X
            if gathered:
                act += L * (h_in // q) * (h_out // q)                        # gathered W
        act += q * n * h // q + gathered * V * (h // q)                      # head input, wte panel
        grad += V * (h // q)                                                 # its gradient
    else:
        act += L * (2 * n * cc + n * mid_cols + n * 4 * mid_cols) + n * cc   # linear inputs, head input
        if p.layout in ("2d", "2.5d"):
            act += gathered * (V * q) * (h // q)                              # wte[:, block c]
            grad += (V * q) * (h // q)                                        # its gradient
    if dropout:
        act += L * (2 * n * cc + 2 * probs) + n * cc
    return {"act": act, "stat": stat, "grad": grad}


def step_memory(p: Problem, dropout: bool = False) -> Memory:
    params = sum(n for n, _ in local_param_sizes(p).values())
    return Memory(params, params, 2 * params, activation_elems(p, dropout))


def step_memory_bytes(p: Problem, dropout: bool = False) -> Memory:
    """``step_memory`` in bytes: under mixed precision the parameters are a
    float32 master plus a 16-bit working copy, gradients and Adam moments
    float32, activations mostly 16-bit."""
    w, params = p.widths, step_memory(p, dropout).params
    working = params * w.act if w.act != w.grad else 0
    return Memory(params * w.grad + working, params * w.grad, 2 * params * w.grad, activation_bytes(p, dropout))


def step_traffic(p: Problem) -> Traffic:
    """Everything one training step moves: the layout's forward/backward,
    the gradient all-reduces over replica groups and over dp, the gradient
    norm and the reported loss."""
    t = TRAFFIC[p.layout](p)
    sizes = local_param_sizes(p)
    group_sizes = defaultdict(int)
    for n, axis in sizes.values():
        if axis is not None:
            group_sizes[axis] += n
    w = p.widths
    for axis, n in group_sizes.items():
        t.allreduce(axis, _group_size(p, axis), n, width=w.grad)
    t.allreduce("dp", p.dp, sum(n for n, _ in sizes.values()), width=w.grad)
    t.allreduce("tp", p.tp, 1, width=w.scalar)                 # gradient norm
    t.allreduce("world", p.tp * p.dp, 1, width=w.scalar)       # reported loss
    return t


def _group_size(p: Problem, axis: str) -> int:
    if axis == "depth":
        return p.depth
    if axis == "col_depth":
        return p.tp // round((p.tp // p.depth) ** 0.5)
    q = round(p.tp ** (1 / 3))
    return q * q                               # ij, ik planes of the cube


# --- the report behind `mpicube info` ------------------------------------------
def comparison_depth(tp: int) -> int:
    """A depth for 2.5-D at this size: d = q when tp is a cube (Tesseract's
    usual choice), else the smallest d > 1 leaving a square grid."""
    from .grid import integer_root

    q = integer_root(tp, 3)
    if q and q > 1:
        return q
    for d in range(2, tp + 1):
        if tp % d == 0 and integer_root(tp // d, 2):
            return d
    return 1


def _fmt(n) -> str:
    n = float(n)
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.4g}"


def _problem(name, cfg, batch_size, world_size, dp, depth, dtype="float32"):
    """A validated Problem, or the ConfigError's message."""
    from .errors import ConfigError

    try:
        _, resolved, tp = plan(name, cfg, batch_size, world_size, dp, depth)
    except ConfigError as err:
        return str(err)
    return Problem(cfg, resolved, tp, dp, depth if resolved == "2.5d" else 1, batch_size, cfg.n_ctx, dtype)


def report(layout_name: str, cfg: ModelConfig, batch_size: int, world_size: int, dp: int = 1,
           depth: int = 1, dtype: str = "float32") -> str:
    """Sharding plan and per-rank predictions for one layout, then the four
    schemes side by side at the same world size, in bytes of ``dtype``'s
    real widths (mixed precision: 16-bit activations, panels and their sums,
    float32 statistics, gradient sums and optimizer state)."""
    chosen = _problem(layout_name, cfg, batch_size, world_size, dp, depth, dtype)
    if isinstance(chosen, str):
        from .errors import ConfigError

        raise ConfigError(chosen)
    lines = [f"layout {chosen.layout}: world {world_size} = dp {dp} x tp {chosen.tp}"
             + (f", depth {chosen.depth}" if chosen.layout == "2.5d" else ""),
             f"batch {batch_size} sequences x {cfg.n_ctx} tokens per step", "",
             "sharding plan (per rank):",
             f"  {'tensor':<28} {'global shape':>16} {'local elems':>12}  gradient summed over"]
    sizes = local_param_sizes(chosen)
    shown = {}
    for decl in gpt_params(cfg):
        key = decl.name.split(".", 2)[-1] if decl.name.startswith("h.") else decl.name
        if key in shown:
            continue
        shown[key] = True
        n, axis = sizes[decl.name]
        label = ("h.*." + key) if decl.name.startswith("h.") else key
        lines.append(f"  {label:<28} {str(decl.shape):>16} {n:>12}  {axis or '-'}")
    traffic, memory, nbytes = step_traffic(chosen), step_memory(chosen), step_memory_bytes(chosen)
    lines += ["", f"communication per rank per step ({dtype}: elements, bytes, messages):"]
    for axis in sorted(traffic.elems):
        lines.append(f"  {axis:<10} {_fmt(traffic.elems[axis]):>10} {_fmt(traffic.bytes[axis]) + 'B':>10} "
                     f"{traffic.msgs[axis]:>8}")
    lines.append(f"  {'total':<10} {_fmt(traffic.total_elems()):>10} {_fmt(traffic.total_bytes()) + 'B':>10} "
                 f"{traffic.total_msgs():>8}")
    lines += ["", f"memory per rank ({dtype}: elements, bytes):"]
    for field_name in ("params", "grads", "optimizer", "activations"):
        lines.append(f"  {field_name:<12} {_fmt(getattr(memory, field_name)):>10}  "
                     f"{_fmt(getattr(nbytes, field_name))}B")
    lines.append(f"  {'total':<12} {_fmt(memory.total()):>10}  {_fmt(nbytes.total())}B")
    lines += ["", compare(cfg, batch_size, world_size, dp, dtype)]
    return "\n".join(lines)


def compare(cfg: ModelConfig, batch_size: int, world_size: int, dp: int = 1, dtype: str = "float32") -> str:
    """1-D, 2-D, 2.5-D and 3-D at the same world size: communication and
    memory per rank in bytes of ``dtype``, and each one's ratio to 3-D."""
    tp = world_size // dp if world_size % dp == 0 else 0
    rows = []
    for name in ("1d", "2d", "2.5d", "3d"):
        depth = comparison_depth(tp) if name == "2.5d" and tp else 1
        rows.append((name, depth, _problem(name, cfg, batch_size, world_size, dp, depth, dtype)))
    base = next((p for n, _, p in rows if n == "3d" and not isinstance(p, str)), None)
    base_t = step_traffic(base).total_bytes() if base else None
    base_m = step_memory_bytes(base).total() if base else None
    lines = [f"all schemes at world {world_size} (dp {dp}), {dtype}, per rank per step:",
             f"  {'layout':<10} {'comm bytes':>11} {'messages':>9} {'memory':>10} {'comm/3d':>8} {'mem/3d':>7}"]
    for name, depth, p in rows:
        label = f"{name} d={depth}" if name == "2.5d" else name
        if isinstance(p, str):
            lines.append(f"  {label:<10} n/a: {p}")
            continue
        t, m = step_traffic(p), step_memory_bytes(p)
        ratio_t = f"{float(t.total_bytes() / base_t):.2f}x" if base_t else "-"
        ratio_m = f"{m.total() / base_m:.2f}x" if base_m else "-"
        lines.append(f"  {label:<10} {_fmt(t.total_bytes()) + 'B':>11} {t.total_msgs():>9} "
                     f"{_fmt(m.total()) + 'B':>10} {ratio_t:>8} {ratio_m:>7}")
    return "\n".join(lines)
