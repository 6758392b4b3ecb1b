"""The traffic of context parallelism's attention, one micro-batch per
layer: the ring's K/V shifts (``parallel.context``) and Ulysses'
all-to-alls (``parallel.ulysses``), with the (sequences, heads) of one
rank's attention that both move. ``costmodel.step_traffic`` adds them per
micro-batch; ``costcontext`` compares the kinds at a scale."""

from __future__ import annotations

from .costbase import Problem, Traffic
from .costmla import op_head_dim


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
    times. One message per shift. Per layer this stage runs (``p.layers``:
    all of them without a pipeline). The K/V rows are the cp rank's T/cp
    positions also under --sequence-parallel (qkv holds the tp group's
    gathered rows). Under the hybrid the ring has C = cp / U ranks and
    each holds its group's T U/cp positions of h_local / U: the same pair."""
    t, w, C = Traffic(), p.widths, p.cp // p.ulysses
    if C == 1:
        return t
    seqs, heads = attention_split(p)
    kv = 2 * seqs * p.local_seq * heads * op_head_dim(p.cfg)     # MLA: k and v at qk
    forwards = 2 if p.recompute == "blocks" else 1
    t._add("cp", C, kv, 1, (forwards + 1) * (C - 1) * p.blocks, w.act)
    t._add("cp", C, kv, 1, C * p.blocks, w.stat)
    return t


def ulysses_traffic(p: Problem) -> Traffic:
    """One micro-batch of Ulysses (parallel.ulysses), per layer, on axis
    "ulysses" (U ranks): forward sends U-1 of its U head groups of the
    packed q, k, v (3 x seqs x T/cp x h_local) and of the output y (1 x)
    back, one message a peer each (twice under --recompute blocks);
    backward the same for dy and dq, dk, dv, all in the activations'
    format. Llama's kv heads travel repeated for their query heads (the
    packed form the op is given)."""
    t, w, U = Traffic(), p.widths, p.ulysses
    if U == 1:
        return t
    seqs, heads = attention_split(p)
    slab = seqs * p.local_seq * (heads // U) * op_head_dim(p.cfg)      # one head group of one width's rows
    forwards = 2 if p.recompute == "blocks" else 1
    for width, times in ((3, forwards + 1), (1, forwards + 1)):    # qkv / dqkv, y / dy
        t._add("ulysses", U, (U - 1) * width * slab, U - 1, times * p.blocks, w.act)
    return t
