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
Priced for the dense blocks (GPT-2, Llama); a mixture's experts and
DeepSeek-V3's latent linears, and the row and tile recipes (whose
reductions ride the layouts' own axes, and whose 3-D backward gathers x
and W again), are not priced yet.
"""

from __future__ import annotations

from .costbase import Problem, Traffic
from .costparams import block_linears

TENSOR_SCALED = ("tensorwise", "delayed")
PER_LINEAR = {"serial": 6, "1d": 6, "2d": 4, "2.5d": 4, "3d": 3}    # quantizations per linear, micro-batch


def priced(p: Problem) -> bool:
    """Whether ``fp8_traffic`` prices the FP8 run ``p`` (see the module docstring)."""
    return p.fp8 in TENSOR_SCALED and not p.cfg.moe and not p.cfg.mla


def quantizations(p: Problem) -> int:
    """Tensor quantizations (one amax all-reduce each) of one micro-batch on this rank's stage."""
    per = PER_LINEAR[p.layout] + (p.layout == "3d" and p.recompute == "gathers")
    per += 2 if p.recompute == "blocks" else 0
    layers = sum(len(p.chunk_layers[k]) for k in p.stage_chunks)
    return layers * len(block_linears(p.cfg)) * per


def fp8_traffic(p: Problem) -> Traffic:
    """One micro-batch's amax all-reduces: one float32 each over the stage."""
    t = Traffic()
    if p.fp8 in TENSOR_SCALED:
        t.allreduce("fp8", p.tp * p.dp * p.cp, 1, times=quantizations(p), width=4)
    return t
