"""A mixture of experts in the cost model: the rows each MoE layer moves
and runs on one rank (``Rows``), the activations it keeps for backward,
its FLOPs and the all-to-all's traffic (``ep_traffic``; the rest of a
mixture's traffic: ``costexpertcomm``).

Why rows: a dense MLP's activations follow from the batch alone, an
expert's from the tokens the router sends it, so the memory of a mixture
is a function of the routing. Three routings are priced:

* measured (``Problem.routing``: per micro-batch, one ``Rows`` per MoE
  layer): what a step recorded (``RouterLedger.routes``, and each
  expert's rows as the layout's ``expert_rows`` answered); the tests hold
  the measured saved activations and traffic equal to the model for it;
* dropless, expected (``expected_rows``): balanced routing, K n / E rows
  of each of this rank's n tokens to every expert, so a rank sends n K
  rows and its E/ep experts run on n K in all;
* capacity (``capacity_rows``): the exact bound. An expert computes at
  most C = ceil(F K N / E) of the micro-batch's N tokens, and in one ep
  group at most the group's ep n tokens (a token chooses an expert once),
  so a rank's experts run on at most E/ep min(C, ep n) rows, and a rank
  sends at most min(n K, E min(C, n)).

What a MoE layer keeps (``moe.MoE.forward``'s ``saved``), per rank with n
token rows of canonical width c: its input (n c), the router's tape in
the compute format (``router_elems``: Mixtral's probabilities (n E), the
chosen weights (n K), their sum (n, its renormalisation) and the
log-sum-exp (n); DeepSeek-V3's sigmoid scores, weights and their sum,
and the sequence-wise loss's normalised scores); the expert outputs brought back (sent rows x c); and for the R
rows its experts run on, what the layout's two linears and SwiGLU keep of
an MLP on R rows (1-D, 2-D, 2.5-D: the c_fc input R c, [gate | up],
sigmoid and silu 4 R F_l, the c_proj input R F_l; 3-D: the gathered
inputs and, per expert, the gathered weights, as ``costmemory`` counts
the dense MLP's).
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from ..ops.moe import capacity
from .costbase import Problem, Traffic
from .costfp8 import keeps_local_input


@dataclass(frozen=True)
class Rows:
    """One MoE layer's rows on one rank in one forward pass."""

    sent_to: tuple    # (ep,) kept (token, expert) rows this rank sends to each ep rank (itself included)
    received: tuple   # (ep,) rows it receives from each ep rank (its experts' rows, source by source)
    experts: tuple    # rows of every batch its local experts' linears run on (padded as the layout asks):
                      # one batch per expert where every expert runs (2-D, 2.5-D, 3-D), else up to two, its
                      # own rows and the others' (model/moe_experts.py), an empty one skipped

    @property
    def sent(self) -> int:
        return sum(self.sent_to)

    @property
    def run(self) -> int:
        return sum(self.experts)

    @classmethod
    def even(cls, p: Problem, sent: int, run: int) -> "Rows":
        """``sent`` rows spread evenly over the ep ranks (and received so),
        ``run`` over the local experts: on serial and 1-D each expert's
        own rows (1/ep of them) and the others' in two batches."""
        g, local = p.ep, p.cfg.n_experts // p.ep
        if p.layout not in ("serial", "1d"):
            return cls((sent // g,) * g, (sent // g,) * g, (run // local,) * local)
        own = run // g // local
        batches = [b for b in (own, run // local - own) if b]
        return cls((sent // g,) * g, (sent // g,) * g, tuple(b for _ in range(local) for b in batches))


def grid(p: Problem) -> tuple:
    """(n token rows, canonical width c, the split of F, q of the cube or 1)
    of one rank, as ``costmemory.chunk_terms`` sizes the dense block."""
    h = p.cfg.n_embd
    if p.layout in ("serial", "1d"):
        return p.local_batch * p.local_seq, h, (p.tp if p.layout == "1d" else 1), 1
    if p.layout in ("2d", "2.5d"):
        q = round((p.tp // p.depth) ** 0.5)
        return p.local_batch // (p.depth * q) * p.local_seq, h // q, q, 1
    q = round(p.tp ** (1 / 3))
    return p.local_batch // (q * q) * p.local_seq, h // q, q, q


def micro_tokens(p: Problem) -> int:
    """N: the micro-batch's tokens over every replica (the capacity's)."""
    return p.batch // p.grad_accum * p.seq_len


def expected_rows(p: Problem) -> Rows:
    """Dropless dispatch under balanced routing: n K rows sent and run
    (with a capacity, no more than its bound)."""
    n, K = grid(p)[0], p.cfg.top_k
    if p.cfg.capacity_factor:
        bound = capacity_rows(p)
        return Rows.even(p, min(n * K, bound.sent), min(n * K, bound.run))
    return Rows.even(p, n * K, n * K)


def capacity_rows(p: Problem) -> Rows:
    """The most rows a capacity lets one rank send and run (module docstring)."""
    cfg = p.cfg
    n, E, K = grid(p)[0], cfg.n_experts, cfg.top_k
    C = capacity(cfg.capacity_factor, K, micro_tokens(p), E)
    return Rows.even(p, min(n * K, E * min(C, n)), E // p.ep * min(C, p.ep * n))


def layer_rows(p: Problem, count: int, micro: int = 0, first: int = 0) -> list:
    """The ``Rows`` of ``count`` MoE layers in micro-batch ``micro``, from
    the ``first``-th of this stage's layers (a pipeline chunk's, in the
    stage's layer order): ``p.routing`` (measured: per micro-batch, one
    tuple of the stage's layers), else the expected rows of dropless
    dispatch or the bound of a capacity."""
    if p.routing is not None:
        rows = p.routing[micro % len(p.routing)]
        from .costparams import moe_layers

        assert len(rows) == moe_layers(p), f"routing of {len(rows)} layers for {moe_layers(p)} MoE layers"
        return list(rows[first:first + count])
    one = capacity_rows(p) if p.cfg.capacity_factor else expected_rows(p)
    return [one] * count


def layer_parts(p: Problem, rows: Rows) -> dict:
    """{part: (kind, elements)} one MoE layer keeps for backward on one
    rank (module docstring), by what holds it."""
    cfg, regather = p.cfg, p.recompute == "gathers"
    n, c, split, q = grid(p)
    E, K, F = cfg.n_experts, cfg.top_k, cfg.moe_ffn
    R, F_l = rows.run, F // split
    # the outputs brought back, in the sent order; where every expert runs on all its rows at once (2-D,
    # 2.5-D, 3-D) and none left the rank, they are a view of those experts' whole output (received rows)
    away = rows.sent - rows.sent_to[p.ep_rank]
    back = sum(rows.received) if p.layout not in ("serial", "1d") and not away else rows.sent
    parts = {"router": ("stat", router_elems(p, n)),
             "input": ("act", n * c),
             "outputs back": ("act", back * c)}
    if q == 1:                                                       # c_fc's input: the rows received (1-D under
        parts["rows in"] = ("act", R * c // split if regather and p.layout == "1d" else R * c)   # gathers: a row
                                                                     # shard; SUMMA keeps its local X anyway)
        parts["swiglu"] = ("act", 4 * F_l * R + R * F_l)            # [gate | up], sigmoid, silu; c_proj's input
    else:                                                            # the cube: gathered X (and W, per expert)
        (h, two_f), (f, h_out) = (cfg.n_embd, 2 * F), (F, cfg.n_embd)
        local_x = regather or keeps_local_input(p)                  # --fp8 tiles or rows: as under gathers
        x_fc, x_proj = (R * h // q, R * f // q) if local_x else (q * R * h // q, q * R * f // q)
        parts["rows in"] = ("act", x_fc)
        parts["swiglu"] = ("act", 4 * F_l * R + x_proj)
        if not local_x:
            parts["weights gathered"] = ("act", E // p.ep * ((h // q) * (two_f // q) + (f // q) * (h_out // q)))
    return parts


def router_elems(p: Problem, n: int) -> int:
    """What one MoE layer's router keeps for backward on n token rows, in
    the compute format (``routers``' tapes). Softmax (Mixtral's): the
    probabilities (n E), the chosen weights (n K), the log-sum-exp (n) and,
    under norm_topk, their sum (n). Sigmoid (DeepSeek-V3's): the scores
    (n E), the weights (n K), under norm_topk their sum (n); with the
    sequence-wise auxiliary loss (training only: it needs the ledger) the
    scores normalised over all experts (n E), their sums (n) and each of
    the rank's sequences' choice fractions f (E per sequence of this
    rank's n / T_l)."""
    cfg = p.cfg
    E, K = cfg.n_experts, cfg.top_k
    topk_sum = n if cfg.norm_topk else 0
    if cfg.router != "sigmoid":
        return n * (E + K + 1) + topk_sum
    seq_aux = n * (E + 1) + n // p.local_seq * E if cfg.seq_aux_loss_coef else 0
    return n * (E + K) + topk_sum + seq_aux


def layer_terms(p: Problem, rows: Rows) -> dict:
    """{"act", "stat", "grad": elements} one MoE layer keeps for backward."""
    out = {"act": 0, "stat": 0, "grad": 0}
    for kind, n in layer_parts(p, rows).values():
        out[kind] += n
    return out


def chunk_moe_terms(p: Problem, count: int, micro: int = 0, first: int = 0) -> tuple:
    """({kind: elements} ``count`` MoE layers keep in micro-batch ``micro``
    (from the stage's ``first``-th, ``layer_rows``), summed; {kind:
    elements} of the layer whose rerun holds the most, for --recompute
    blocks)."""
    per = [layer_terms(p, r) for r in layer_rows(p, count, micro, first)]
    total = {k: sum(t[k] for t in per) for k in ("act", "stat", "grad")}
    most = max(per, key=lambda t: sum(t.values()), default={"act": 0, "stat": 0, "grad": 0})
    return total, most


def moe_linear_flops(p: Problem, N: int) -> int:
    """Forward FLOPs of one MoE layer for N tokens of a replica, summed over
    its tensor-parallel ranks as ``costflops`` sums the dense linears: the
    router (N h E per rank on 1-D, which computes it whole on every tp
    rank; split over the hidden columns elsewhere) and the experts' two
    linears on the K N rows balanced routing sends them."""
    cfg = p.cfg
    router = 2 * N * cfg.n_embd * cfg.n_experts * (p.tp if p.layout == "1d" else 1)
    return router + cfg.top_k * 2 * N * 3 * cfg.n_embd * cfg.moe_ffn


def ep_traffic(routes, g: int, rank: int, n_experts: int, row: int, width: int, forwards: int = 1,
               norm: bool = True) -> Traffic:
    """Traffic on axis "ep" of one step: ``routes`` lists (rows sent to,
    rows received from) each ep rank, (g,) each, one pair per MoE layer
    and micro-batch; ``rank`` this rank's ep rank, ``row`` the elements of
    a row (the hidden size), ``width`` the activations' bytes, ``forwards``
    forward passes per layer (2 under --recompute blocks), ``norm`` whether
    the step took the gradient norm."""
    t = Traffic()
    if g == 1:
        return t
    if norm:
        t.allreduce("ep", g, 1, width=8)
    for sent, received in routes:
        others = [j for j in range(g) if j != rank]
        t._add("ep", g, (g - 1) * (n_experts // g), g - 1, forwards, 8)             # the counts
        out = Fraction(sum(int(sent[j]) for j in others) * row)
        back = Fraction(sum(int(received[j]) for j in others) * row)
        t._add("ep", g, out, sum(1 for j in others if sent[j]), forwards + 1, width)       # rows, dy out
        t._add("ep", g, back, sum(1 for j in others if received[j]), forwards + 1, width)  # outputs, dx back
    return t
