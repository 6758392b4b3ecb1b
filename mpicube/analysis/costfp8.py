"""The traffic ``--fp8`` adds to a step: the amax all-reduces of the
tensor-scaled recipes (``parallel/fp8.py``).

A tensor scale belongs to the logical tensor, so each quantization of
x, W or dy under tensorwise or delayed all-reduces (max) one float32 amax
over the pipeline stage's ranks (tp x dp x cp; axis "fp8"). How many a
linear makes per micro-batch is fixed by its layout's code:

* serial, 1-D (``DenseLinear``, ``SeqLinear``): forward x and W, dgrad
  dy and W, wgrad x and dy: 6;
* 2-D, 2.5-D (``SummaLinear``): one quantization serves every GEMM
  (a tensor scale has no orientation): forward x and W, backward dy and
  the W it broadcasts again: 4;
* 3-D (``CubeLinear``): forward x and W, backward dy: 3, and W once more
  under ``--recompute gathers`` (it gathers W again): 4;

and ``--recompute blocks`` reruns each block's forward (2 more a linear).
Priced for the dense blocks (GPT-2, Llama). The tile recipes (blockwise,
MXFP8) reduce nothing; on 3-D their backward gathers X and W again and
dY twice (``cube_tile_gathers``), as rowwise's does, whose row amaxes
ride the layouts' own axes (``row_amaxes``). Not priced yet (``priced``):
rowwise under --sequence-parallel, a mixture's experts under FP8 and
MLA's REPLICATED linears under a tensor or row scale.

Memory (``costmemory`` asks here): what a recipe changes in what a layout
keeps for backward (``keeps_local_input``, ``quantized_copy_kept``) and
delayed's amax histories (``history_elems``).
"""

from __future__ import annotations

from dataclasses import replace

from .costbase import Problem, Traffic
from .costmla import replicated_outputs
from .costparams import block_linears, dense_linears, stage_layers, stage_linears

TENSOR_SCALED = ("tensorwise", "delayed")
PRICED = TENSOR_SCALED + ("blockwise", "mxfp8", "rowwise")    # recipes fp8_traffic prices (``priced``)
PER_LINEAR = {"serial": 6, "1d": 6, "2d": 4, "2.5d": 4, "3d": 3}    # quantizations per linear, micro-batch


def priced(p: Problem) -> bool:
    """Whether ``fp8_traffic`` prices the FP8 run ``p`` (see the module docstring)."""
    return priced_recipe(p.fp8, p.cfg, p.sequence_parallel, p.ep)


def priced_recipe(recipe: str, cfg, sequence_parallel: bool = False, ep: int = 1) -> bool:
    """``priced`` from the recipe's name, the model, --sequence-parallel
    and --ep (an expert's amaxes over its holders under --ep > 1: not priced)."""
    if ep > 1:
        return False
    if recipe not in PRICED or cfg.moe:
        return False
    if recipe == "rowwise":
        return not cfg.mla and not sequence_parallel
    return not (cfg.mla and recipe in TENSOR_SCALED)


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


def quantizations(p: Problem) -> int:
    """Tensor quantizations (one amax all-reduce each) of one micro-batch on this rank's stage."""
    per = PER_LINEAR[p.layout] + (p.layout == "3d" and p.recompute == "gathers")
    per += 2 if p.recompute == "blocks" else 0
    layers = sum(len(p.chunk_layers[k]) for k in p.stage_chunks)
    return layers * len(block_linears(p.cfg)) * per


def fp8_traffic(p: Problem) -> Traffic:
    """One micro-batch's amax all-reduces (one float32 each over the
    stage), and on 3-D under a tile recipe the gathers backward adds."""
    t = Traffic()
    if p.fp8 in TENSOR_SCALED:
        t.allreduce("fp8", p.tp * p.dp * p.cp, 1, times=quantizations(p), width=4)
    if keeps_local_input(p):
        t.add(cube_tile_gathers(replace(p, seq_len=p.local_seq, cp=1)))
    if p.fp8 == "rowwise":
        t.add(row_amaxes(p))
    return t


def row_amaxes(p: Problem) -> Traffic:
    """rowwise's amax all-reduces in one micro-batch (float32, one per row
    of an operand whose row is split): per linear, forward's x and W^T
    (again under --recompute blocks), dgrad's dy and W, each over the
    ranks holding the rest of its row along the contraction, and wgrad's
    x^T and dy^T, whose rows run along the tokens, over the ranks holding
    the other tokens of their columns (axis "fp8": the replicas, and on
    2-D, 2.5-D and 3-D the grid's ranks with the same columns). Which
    group holds the rest of each row is the layouts' ``Splits``:

    * 1-D: a COLUMN linear's W and dy columns over tp, a ROW one's x
      columns and W rows;
    * 2-D, 2.5-D: x's, dy's and W's columns over the grid row, W's rows
      over its column;
    * 3-D (a, b = j, k for a COLUMN linear, k, j for a ROW one): x's
      columns over b, W's rows over the plane of b and i, dy's and W's
      columns over a."""
    t = Traffic()
    local = replace(p, seq_len=p.local_seq, cp=1)
    forwards = 2 if p.recompute == "blocks" else 1
    replicas = p.dp * p.cp

    def reduce(axis, g, rows, times=1):
        if g > 1:
            t.allreduce(axis, g, rows, times=times, width=4)

    if p.layout in ("serial", "1d"):
        n, g = local.local_batch * local.seq_len, p.tp
        for h_in, h_out, position in stage_linears(local):
            if position == "column":
                reduce("tp", g, n)                               # dgrad: dy's rows
                reduce("tp", g, h_in)                            # dgrad: W's rows
                reduce("fp8", replicas, h_in)                    # wgrad: x^T's rows
                reduce("fp8", replicas, h_out // g)              # wgrad: dy^T's rows
            else:
                reduce("tp", g, n, times=forwards)               # forward: x's rows
                reduce("tp", g, h_out, times=forwards)           # forward: W^T's rows
                reduce("fp8", replicas, h_in // g)
                reduce("fp8", replicas, h_out)
    elif p.layout in ("2d", "2.5d"):
        q = round((p.tp // p.depth) ** 0.5)
        n = local.local_batch * local.seq_len // (p.depth * q)
        tokens = p.depth * q * replicas                          # a grid column's ranks, every replica
        for h_in, h_out, _ in stage_linears(local, q):
            reduce("row", q, n, times=forwards)
            reduce("col", q, h_out // q, times=forwards)
            reduce("row", q, n)
            reduce("row", q, h_in // q)
            reduce("fp8", tokens, h_in // q)
            reduce("fp8", tokens, h_out // q)
    else:
        q = round(p.tp ** (1 / 3))
        n = local.local_batch * local.seq_len // (q * q)
        tokens = q * q * replicas                                # a plane of the cube, every replica
        for h_in, h_out, position in stage_linears(local, q):
            a, b, plane = ("j", "k", "ik") if position == "column" else ("k", "j", "ij")
            reduce(b, q, n, times=forwards)
            reduce(plane, q * q, h_out // q, times=forwards)
            reduce(a, q, n)
            reduce(a, q, h_in // (q * q))
            reduce("fp8", tokens, h_in // q)
            reduce("fp8", tokens, h_out // q)
    return t


def cube_tile_gathers(p: Problem) -> Traffic:
    """3-D under a tile or row recipe (``CubeLinear``, oriented): each GEMM
    gathers its own quantization, so backward gathers X over a and W over
    i again (wgrad's tiles run along the tokens, dgrad's along K_out;
    already so under --recompute gathers, which the layout's traffic
    prices), and dY twice over b (dgrad's and wgrad's). ``p`` on this
    rank's positions."""
    t, w = Traffic(), p.widths
    q = round(p.tp ** (1 / 3))
    n = p.local_batch * p.seq_len // (q * q)              # canonical rows per rank
    again = p.recompute != "gathers"
    for h_in, h_out, position in stage_linears(p, q):
        a, b = ("j", "k") if position == "column" else ("k", "j")
        t.allgather(a, q, n * h_in // q, times=int(again), width=w.act)                   # X over a
        t.allgather("i", q, (h_in // (q * q)) * (h_out // q), times=int(again), width=w.act)   # W over i
        t.allgather(b, q, n * h_out // q, width=w.act)                                    # wgrad's dY over b
    return t
