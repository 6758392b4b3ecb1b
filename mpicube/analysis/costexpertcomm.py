"""A mixture's traffic beyond the dense part of a block: what
``model.moe.MoE``, its ``RouterLedger`` and the experts' linears move on
one rank in one step, for the rows ``costexperts.layer_rows`` gives (the
routing each layer recorded, in the tests; balanced, or a capacity's
bound, in ``info``). ``costmodel.step_traffic`` adds it.

Per MoE layer and forward pass (twice per layer under --recompute
blocks, whose rerun repeats the forward):

* the router's logits summed over the hidden group (2-D, 2.5-D: the grid
  row; 3-D: k), an all-gather of every rank's (n, E) partial product in
  the compute format (``MoE._hidden_sum``); backward gathers the routing
  weights' (n, K) gradient partials the same way;
* DeepSeek-V3's sequence-wise auxiliary loss under --cp: each of the
  rank's n / T_l sequences' choice counts and normalised score sums (2 E
  each, the compute format) all-reduced over the ring
  (``routers.SigmoidRouter._seq_aux``);
* under a capacity, the drop order's counts (``RouterLedger.offsets``):
  one all-gather of E float64 over the tp ranks with the replica's other
  sequences (2-D, 2.5-D: column x depth; 3-D: the (i, j) plane) and one
  over dp; under --cp first one all-gather of the ring's n K choices
  (float64) over cp (``ring_places``);
* the all-to-all over ep (``ep_traffic``, below the counts and rows);
* the cube's count of each local expert's rows, all-gathered over j
  (E/ep int64, ``CubeLayout.expert_rows``);
* 1-D under --sequence-parallel: the whole sequences gathered over tp
  (forward x, backward dy), the output and input gradient reduce-scattered
  (the experts' linears give partial sums), the routing weights' gradient
  partials gathered;
* each expert's two linears, on the rows it runs on, as the layout's
  linears move an MLP's activations: 1-D sums c_proj's output (forward)
  and c_fc's input gradient (backward) over tp (not under
  --sequence-parallel), and under --recompute gathers gathers c_fc's
  input rows again from their shards in backward; SUMMA broadcasts and
  reduces X and W panels along the row and column; the cube gathers and
  reduce-scatters over i, j, k; under --fp8 their quantizers' amaxes
  come on top (``costfp8.expert_fp8``); once per batch (``Rows.experts``: where
  every expert runs, one batch each, empty ones too, as their
  collectives span ranks that may hold rows; on serial and 1-D its own
  rows and the others' apart, computed while the others travel).

Per micro-batch: the ledger's (L, 2 E + 2) statistics all-reduced in the
compute format over the same tp ranks, the ring and dp
(``RouterLedger.finish``, before any backward); under a pipeline over the
world (``RouterLedger.start``; tests/pipeline_check.py compares it).
"""

from __future__ import annotations

from collections import Counter

from .costbase import Problem, Traffic
from .costexperts import ep_traffic, grid, layer_rows
from .costfp8 import expert_fp8
from .costparams import moe_layers


def token_axis(p: Problem) -> tuple:
    """(axis, size) of the tp ranks with the replica's other sequences
    (``Layout.token_comm``), or None on serial and 1-D."""
    if p.layout in ("2d", "2.5d"):
        q = round((p.tp // p.depth) ** 0.5)
        return "col_depth", p.depth * q
    if p.layout == "3d":
        q = round(p.tp ** (1 / 3))
        return "ij", q * q
    return None


def hidden_axis(p: Problem) -> tuple:
    """(axis, size) of the ranks splitting a token's hidden columns
    (``Layout.hidden_comm``), or None."""
    if p.layout in ("2d", "2.5d"):
        return "row", round((p.tp // p.depth) ** 0.5)
    if p.layout == "3d":
        return "k", round(p.tp ** (1 / 3))
    return None


def moe_traffic(p: Problem, norm: bool = True) -> Traffic:
    """Every MoE layer's traffic of one step on this rank (module
    docstring), its all-to-all included; ``norm``: the gradient norm's
    float64 sum over ep (without --zero)."""
    t, cfg, w = Traffic(), p.cfg, p.widths
    n, c, _, _ = grid(p)
    E, K, L = cfg.n_experts, cfg.top_k, moe_layers(p)      # the stage's blocks with a mixture
    forwards = 2 if p.recompute == "blocks" else 1
    hidden, tokens = hidden_axis(p), token_axis(p)
    sequence = p.layout == "1d" and p.sequence_parallel and p.tp > 1
    seq_aux_ring = cfg.router == "sigmoid" and cfg.seq_aux_loss_coef and p.cp > 1
    routes, batches = [], Counter()   # the experts' batches by their rows: each size's linears priced once
    for m in range(p.grad_accum):
        rows = layer_rows(p, L, m)
        routes += [(r.sent_to, r.received) for r in rows]
        for r in rows:
            if hidden:
                t.allgather(hidden[0], hidden[1], n * E, times=forwards, width=w.stat)   # logits
                t.allgather(hidden[0], hidden[1], n * K, width=w.stat)                  # d weights
            if seq_aux_ring:         # a sequence's choice counts and score sums over its chunks
                t.allreduce("cp", p.cp, 2 * (n // p.local_seq) * E, times=forwards, width=w.stat)
            if cfg.capacity_factor:
                if p.cp > 1:
                    t.allgather("cp", p.cp, n * K, times=forwards, width=8)
                for axis, g in ([tokens] if tokens else []) + [("dp", p.dp)]:
                    t.allgather(axis, g, E, times=forwards, width=8)
            if p.layout == "3d":
                q = round(p.tp ** (1 / 3))
                t.allgather("j", q, E // p.ep, times=forwards, width=8)
            if sequence:             # whole sequences gathered in, partial sums reduce-scattered out
                t.allgather("tp", p.tp, n // p.tp * c, times=forwards + 1, width=w.act)    # x; backward dy
                t.reduce_scatter("tp", p.tp, n * c, times=forwards + 1, width=w.red)       # y; backward dx
                t.allgather("tp", p.tp, n * K, width=w.stat)                               # d weights
            batches.update(r.experts)
        if p.pp > 1:                 # every stage's rows (zeros for the others' layers) over the world
            t.allreduce("world", p.tp * p.dp * p.pp * p.cp, cfg.n_blocks * (2 * E + 2), width=w.stat)   # MTP's blocks too
            continue
        for axis, g in ([tokens] if tokens else []) + [("cp", p.cp), ("dp", p.dp)]:
            t.allreduce(axis, g, L * (2 * E + 2), width=w.stat)
    for size, count in batches.items():
        t.add(expert_linears(p, size, forwards), count)
    t.add(ep_traffic(routes, p.ep, p.ep_rank, E, c, w.act, forwards=forwards, norm=norm))
    return t


def expert_linears(p: Problem, rows: int, forwards: int) -> Traffic:
    """One expert's c_fc (h -> 2F) and c_proj (F -> h) on ``rows`` rows of
    this rank, forward ``forwards`` times and backward once, as the
    layout's linears move an MLP's (``costmodel``'s per-linear terms)."""
    t, cfg, w = Traffic(), p.cfg, p.widths
    h, F = cfg.n_embd, cfg.moe_ffn
    if p.layout == "1d":
        if not p.sequence_parallel:      # (under it, partial sums: the mixture's one reduce-scatter)
            t.sum("tp", p.tp, rows * h, times=forwards + 1, width=w.red)  # c_proj's Y; c_fc's dX
        if p.recompute == "gathers":     # c_fc's input kept as a row shard, gathered again in backward
            t.allgather("tp", p.tp, rows * h // p.tp, width=w.act)
    elif p.layout in ("2d", "2.5d"):
        q = round((p.tp // p.depth) ** 0.5)
        for h_in, h_out in ((h, 2 * F), (F, h)):
            x_panel, w_panel = rows * h_in // q, (h_in // q) * (h_out // q)
            t.bcast("row", q, x_panel, times=(forwards + 1) * q, width=w.act)
            t.reduce_onto("row", q, x_panel, times=q, width=w.red)
            t.bcast("col", q, w_panel, times=(forwards + 1) * q, width=w.act)
            t.reduce_onto("col", q, w_panel, times=q, width=w.red)
    elif p.layout == "3d":
        q = round(p.tp ** (1 / 3))
        gathers = 2 if p.recompute == "gathers" else 1
        for (h_in, h_out), (a, b) in zip(((h, 2 * F), (F, h)), (("j", "k"), ("k", "j"))):
            t.allgather(a, q, rows * h_in // q, times=forwards * gathers, width=w.act)
            t.allgather("i", q, (h_in // (q * q)) * (h_out // q), times=forwards * gathers, width=w.act)
            t.reduce_scatter(b, q, rows * q * h_out // q, times=forwards, width=w.red)
            t.allgather(b, q, rows * h_out // q, width=w.act)
            t.reduce_scatter(a, q, rows * q * h_in // q, width=w.red)
            t.reduce_scatter("i", q, (h_in // q) * (h_out // q), width=w.red)
    if p.fp8:                            # --fp8: its quantizers' amaxes (and 3-D's second gathers)
        t.add(expert_fp8(p, rows))
    return t
