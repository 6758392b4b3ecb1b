"""The traffic ``--fp8`` adds to a step: the amax all-reduces of the
tensor-scaled recipes and rowwise's row amaxes (``parallel/fp8.py``),
and the second gathers of 3-D's tile and row recipes.

Each linear is priced for the rows it runs on (``linear_fp8``): the
stage's sharded linears (``fp8_traffic``, per micro-batch: attention,
a dense or shared-expert MLP, an MTP depth's block), MLA's REPLICATED
down-projections (``replicated_fp8``) and a mixture's experts, on every
batch of rows their linears ran on (``expert_fp8``, which
``costexpertcomm.expert_linears`` adds per batch: at --ep 1).

A tensor scale belongs to the logical tensor, so each quantization of
x, W or dy under tensorwise or delayed all-reduces (max) one float32 amax
over the pipeline stage's ranks (tp x dp x cp; axis "fp8"). How many a
linear makes per batch of rows is fixed by its layout's code:

* serial, 1-D (``DenseLinear``, ``SeqLinear``): forward x and W, dgrad
  dy and W, wgrad x and dy: 6;
* 2-D, 2.5-D (``SummaLinear``): one quantization serves every GEMM
  (a tensor scale has no orientation): forward x and W, backward dy and
  the W it broadcasts again: 4;
* 3-D (``CubeLinear``): forward x and W, backward dy: 3, and W once more
  under ``--recompute gathers`` (it gathers W again): 4;
* MLA's ``ReplicatedLinear`` quantizes each GEMM's operands as it uses
  them on every layout: 6;

and ``--recompute blocks`` reruns each block's forward (2 more a linear).
The tile recipes (blockwise, MXFP8) reduce nothing; on 3-D their
backward gathers X and W again and dY twice (``cube_tile_gathers``), as
rowwise's does, whose row amaxes ride the layouts' own axes
(``row_amaxes``; a replicated linear's: ``replicated_fp8``).

Memory (``costmemory`` asks here): what a recipe changes in what a layout
keeps for backward (``keeps_local_input``, ``quantized_copy_kept``) and
delayed's amax histories (``history_elems``).
"""

from __future__ import annotations

from dataclasses import replace

from .costbase import Problem, Traffic
from .costmla import replicated_outputs
from .costparams import dense_linears, head_split, stage_layers, stage_linears

TENSOR_SCALED = ("tensorwise", "delayed")
PER_LINEAR = {"serial": 6, "1d": 6, "2d": 4, "2.5d": 4, "3d": 3}    # quantizations per linear, micro-batch
REPLICATED_PER_LINEAR = 6         # ReplicatedLinear: each GEMM's two operands, on every layout


def keeps_local_input(p: Problem) -> bool:
    """Whether a 3-D linear keeps its local X raw for backward, as under
    --recompute gathers: a tile or row recipe quantizes each GEMM's
    operands along its own contraction, so backward gathers its own
    quantizations of X and W again (``CubeLinear``) and forward keeps
    neither gathered panel."""
    return p.layout == "3d" and bool(p.fp8) and p.fp8 not in TENSOR_SCALED


def quantized_copy_kept(p: Problem) -> bool:
    """Whether a grid layout's linear keeps the quantized copy of its input
    (a new array) where it would keep the input itself: under a tensor
    scale one quantization serves all three GEMMs, so 2-D and 2.5-D
    (``SummaLinear``) and 3-D under --recompute gathers (``CubeLinear``)
    save it, and the attention output c_proj reads is then held twice (the
    op's and c_proj's copy). The other inputs are no other op's kept
    arrays, so their copies replace them one for one."""
    if p.fp8 not in TENSOR_SCALED:
        return False
    return p.layout in ("2d", "2.5d") or (p.layout == "3d" and p.recompute == "gathers")


def history_elems(p: Problem, length: int) -> int:
    """``delayed``'s amax histories on one rank (``Fp8Scaling.history``):
    float64, --fp8-amax-history of them per linear of the stage and
    operand (x, W, dy), ``length`` (--fp8-amax-history) each; none for the other recipes. Kept beside the model
    and in every checkpoint (``state.fp8``)."""
    if p.fp8 != "delayed":
        return 0
    return stage_linear_count(p) * 3 * length


def stage_linear_count(p: Problem) -> int:
    """The quantized linears of this rank's stage: each block's sharded
    ones (a mixture's attention and shared experts), MLA's two REPLICATED
    down-projections, and a mixture's experts this rank holds (E / ep)."""
    cfg, count = p.cfg, 0
    for i in stage_layers(p):
        count += len(dense_linears(cfg, 1, i)) + (len(replicated_outputs(cfg)) if cfg.mla else 0)
        count += 2 * (cfg.n_experts // p.ep) if cfg.is_moe(i) else 0
    return count


def per_linear(p: Problem) -> int:
    """Tensor quantizations (one amax all-reduce each) of one of the
    layout's linears on one batch of rows (the module docstring)."""
    per = PER_LINEAR[p.layout] + (p.layout == "3d" and p.recompute == "gathers")
    return per + (2 if p.recompute == "blocks" else 0)


def fp8_traffic(p: Problem) -> Traffic:
    """One micro-batch's FP8 traffic on this rank: every sharded linear of
    the stage's blocks (a mixture's experts apart: ``expert_fp8``) on the
    rank's rows, and MLA's replicated ones."""
    t = Traffic()
    local = replace(p, seq_len=p.local_seq, cp=1)                 # on this rank's positions
    n = dense_rows(local)
    for h_in, h_out, position in stage_linears(local, head_split(p)):
        t.add(linear_fp8(p, n, h_in, h_out, position))
    t.add(replicated_fp8(p))
    return t


def dense_rows(p: Problem) -> int:
    """Token rows a sharded linear's x holds on this rank (``p`` at its
    positions): the gathered sequences on serial and 1-D (under
    --sequence-parallel too), the grid's or the cube's share of them."""
    n = p.local_batch * p.seq_len
    if p.layout in ("2d", "2.5d"):
        return n // (p.depth * grid_side(p))
    return n // grid_side(p) ** 2 if p.layout == "3d" else n


def grid_side(p: Problem) -> int:
    """q: the side of the 2-D / 2.5-D grid or of the cube (1 on serial and 1-D)."""
    if p.layout in ("2d", "2.5d"):
        return round((p.tp // p.depth) ** 0.5)
    return round(p.tp ** (1 / 3)) if p.layout == "3d" else 1


def expert_fp8(p: Problem, rows: int) -> Traffic:
    """One expert's c_fc (h -> 2F, COLUMN) and c_proj (F -> h, ROW) on one
    batch of ``rows`` rows of this rank (``costexperts.Rows.experts``; an
    empty batch too where every expert runs, ``fp8_every``): the layout's
    own linears, priced as a block's are."""
    t, h, F = Traffic(), p.cfg.n_embd, p.cfg.moe_ffn
    t.add(linear_fp8(p, rows, h, 2 * F, "column"))
    t.add(linear_fp8(p, rows, F, h, "row"))
    return t


def linear_fp8(p: Problem, n: int, h_in: int, h_out: int, position: str) -> Traffic:
    """One linear of the layout (``position`` COLUMN or ROW, ``h_out`` as
    the layout's head split holds it in all) on ``n`` token rows of this
    rank, one forward (two under --recompute blocks) and its backward:
    the tensor amaxes, rowwise's row amaxes, 3-D's second gathers under a
    tile or row recipe."""
    t, replicas = Traffic(), p.dp * p.cp            # the ranks holding other tokens
    if p.fp8 in TENSOR_SCALED:
        t.allreduce("fp8", p.tp * replicas, 1, times=per_linear(p), width=4)
    elif p.fp8 == "rowwise":
        t.add(row_amaxes(p, n, h_in, h_out, position, replicas))
    if keeps_local_input(p):
        t.add(cube_tile_gathers(p, n, h_in, h_out, position))
    return t


def row_amaxes(p: Problem, n: int, h_in: int, h_out: int, position: str, replicas: int) -> Traffic:
    """rowwise's amax all-reduces of one linear on ``n`` rows (float32,
    one per row of an operand whose row is split): forward's x and W^T
    (again under --recompute blocks), dgrad's dy and W, each over the
    ranks holding the rest of its row along the contraction, and wgrad's
    x^T and dy^T, whose rows run along the tokens, over the ranks holding
    the other tokens of their columns (axis "fp8": the replicas, and on
    2-D, 2.5-D and 3-D the grid's ranks with the same columns). Which
    group holds the rest of each row is the layouts' ``Splits``:

    * 1-D: a COLUMN linear's W and dy columns over tp, a ROW one's x
      columns and W rows (the same under --sequence-parallel, whose
      linears see the gathered sequence);
    * 2-D, 2.5-D: x's, dy's and W's columns over the grid row, W's rows
      over its column;
    * 3-D (a, b = j, k for a COLUMN linear, k, j for a ROW one): x's
      columns over b, W's rows over the plane of b and i, dy's and W's
      columns over a."""
    t = Traffic()
    forwards = 2 if p.recompute == "blocks" else 1

    def reduce(axis, g, rows, times=1):
        if g > 1:
            t.allreduce(axis, g, rows, times=times, width=4)

    q = grid_side(p)
    if p.layout in ("serial", "1d"):
        g = p.tp
        if position == "column":
            reduce("tp", g, n)                                   # dgrad: dy's rows
            reduce("tp", g, h_in)                                # dgrad: W's rows
            reduce("fp8", replicas, h_in)                        # wgrad: x^T's rows
            reduce("fp8", replicas, h_out // g)                  # wgrad: dy^T's rows
        else:
            reduce("tp", g, n, times=forwards)                   # forward: x's rows
            reduce("tp", g, h_out, times=forwards)               # forward: W^T's rows
            reduce("fp8", replicas, h_in // g)
            reduce("fp8", replicas, h_out)
    elif p.layout in ("2d", "2.5d"):
        tokens = p.depth * q * replicas                          # a grid column's ranks, every replica
        reduce("row", q, n, times=forwards)
        reduce("col", q, h_out // q, times=forwards)
        reduce("row", q, n)
        reduce("row", q, h_in // q)
        reduce("fp8", tokens, h_in // q)
        reduce("fp8", tokens, h_out // q)
    else:
        tokens = q * q * replicas                                # a plane of the cube, every replica
        a, b, plane = ("j", "k", "ik") if position == "column" else ("k", "j", "ij")
        reduce(b, q, n, times=forwards)
        reduce(plane, q * q, h_out // q, times=forwards)
        reduce(a, q, n)
        reduce(a, q, h_in // (q * q))
        reduce("fp8", tokens, h_in // q)
        reduce("fp8", tokens, h_out // q)
    return t


def cube_tile_gathers(p: Problem, n: int, h_in: int, h_out: int, position: str) -> Traffic:
    """3-D under a tile or row recipe (``CubeLinear``, oriented), one
    linear on ``n`` rows: each GEMM gathers its own quantization, so
    backward gathers X over a and W over i again (wgrad's tiles run along
    the tokens, dgrad's along K_out; already so under --recompute
    gathers, which the layout's traffic prices), and dY twice over b
    (dgrad's and wgrad's)."""
    t, w, q = Traffic(), p.widths, grid_side(p)
    again = int(p.recompute != "gathers")
    a, b = ("j", "k") if position == "column" else ("k", "j")
    t.allgather(a, q, n * h_in // q, times=again, width=w.act)                          # X over a
    t.allgather("i", q, (h_in // (q * q)) * (h_out // q), times=again, width=w.act)     # W over i
    t.allgather(b, q, n * h_out // q, width=w.act)                                      # wgrad's dY over b
    return t


def replicated_fp8(p: Problem) -> Traffic:
    """MLA's REPLICATED down-projections (q_down if a q latent, kv_down)
    in one micro-batch, on every block of the stage (``ReplicatedLinear``:
    the whole W on every rank, this rank's canonical rows of x times its
    columns' rows of W). A tensor scale: 6 quantizations each (8 under
    --recompute blocks) over the stage. rowwise: W's rows and dy's are
    whole on every rank, so only x's rows along its columns (forward,
    over the hidden split: 2-D, 2.5-D's grid row, 3-D's k) and wgrad's
    x^T and dy^T rows along the tokens (over the ranks with the rest of
    the tokens at those columns: the layout's token group, and under
    --sequence-parallel, whose canonical rows are T/tp, the stage)."""
    t, cfg = Traffic(), p.cfg
    if not cfg.mla or p.fp8 not in TENSOR_SCALED + ("rowwise",):
        return t
    forwards = 2 if p.recompute == "blocks" else 1
    outs, L = replicated_outputs(cfg), len(stage_layers(p))
    stage = p.tp * p.dp * p.cp
    if p.fp8 in TENSOR_SCALED:
        t.allreduce("fp8", stage, 1, times=(REPLICATED_PER_LINEAR + 2 * (forwards - 1)) * len(outs) * L, width=4)
        return t
    local = replace(p, seq_len=p.local_seq, cp=1)
    q, replicas = grid_side(p), p.dp * p.cp
    n = dense_rows(local)                                               # canonical rows, as x's
    if p.layout == "1d" and p.sequence_parallel:
        n, tokens = n // p.tp, stage
    else:
        tokens = {"2d": p.depth * q, "2.5d": p.depth * q, "3d": q * q}.get(p.layout, 1) * replicas
    hidden = {"2d": "row", "2.5d": "row", "3d": "k"}.get(p.layout)
    for r in outs:
        if hidden and q > 1:
            t.allreduce(hidden, q, n, times=forwards * L, width=4)          # forward: x's rows
        for rows in (cfg.n_embd // q, r):                                   # wgrad: x^T's, dy^T's rows
            if tokens > 1:
                t.allreduce("fp8", tokens, rows, times=L, width=4)
    return t
