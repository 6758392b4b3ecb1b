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
dY twice (``cube_tile_gathers``). Not priced yet: rowwise's row amaxes
(they ride the layouts' own axes), a mixture's experts under FP8 and
MLA's REPLICATED linears under a tensor scale.

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
PRICED = TENSOR_SCALED + ("blockwise", "mxfp8")    # recipes whose traffic fp8_traffic prices exactly
PER_LINEAR = {"serial": 6, "1d": 6, "2d": 4, "2.5d": 4, "3d": 3}    # quantizations per linear, micro-batch


def priced(p: Problem) -> bool:
    """Whether ``fp8_traffic`` prices the FP8 run ``p`` (see the module docstring)."""
    return p.fp8 in PRICED and not p.cfg.moe and not (p.cfg.mla and p.fp8 in TENSOR_SCALED)


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
    return t


def cube_tile_gathers(p: Problem) -> Traffic:
    """3-D under a tile recipe (``CubeLinear``, oriented): each GEMM
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
