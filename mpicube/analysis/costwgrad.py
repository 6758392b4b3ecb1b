"""What a zero-bubble schedule's weight phases hold: between a chunk's B
(input gradient) and its W (weight gradient) the stage keeps, for every
linear of the chunk's blocks, the operands its dW GEMM needs, as
``parallel.wgrad`` files them: the linear's input X and its output
gradient dY. The rest of the tape (norm statistics, attention's q/k/v,
the activation's inputs, masks) is let go at B. ``costpipe.peak_over_schedule``
adds these terms at each ``backward_input`` and takes them off at its
``backward_weight``; tests/pipeline_check.py holds the peak equal to what
the executor measures.

Per linear (h_in, h_out) of ``costparams.block_linears``, n token rows
of the layout (``costmemory.chunk_terms``' n):

* serial, 1-D (and its sequence-parallel form), 2-D, 2.5-D: X is the
  input the forward saved (whole again in backward where --recompute
  gathers kept a shard), n x h_in over the head split for the row
  linears, n x the canonical width for the column ones; dY of a column
  linear is n x h_out over the head split, of a row linear the canonical
  block (under --sequence-parallel the gathered whole).
* 3-D: the gathered X (q n x h_in/q), the gathered dY (q n x h_out/q) and
  the rank's own dY (n x h_out/q, for the bias).

A mixture's experts: every batch of M rows an expert runs
(``costexperts.Rows.experts``: on serial and 1-D its own rows and the
others', up to two; on the 2-D grids all its rows at once, padded) files
c_fc's input (M x the canonical width, whole again under --recompute
gathers) and its SwiGLU's gradient (M x 2F over the head split), c_proj's
input (M x F over the split) and its output gradient (M x the canonical
width): R (2 c + 3 F_l) over the layer's R run rows, at the rows the
stage measured (``p.routing``) or expects. 3-D's gathered expert panels
are not priced yet.
"""

from __future__ import annotations

from .costbase import Problem
from .costexperts import layer_rows
from .costparams import dense_linears


def weight_phase_terms(p: Problem, L: int, micro: int = 0, first: int = 0) -> dict:
    """{"act", "stat", "grad": elements} micro-batch ``micro``'s weight
    phase holds on a chunk of ``L`` blocks, the ``first``-th of the
    stage's layers onwards (module docstring)."""
    cfg, T, h = p.cfg, p.local_seq, p.cfg.n_embd
    if p.layout in ("serial", "1d"):
        heads, split_rows, cc = (p.tp if p.layout == "1d" else 1), 1, h
    elif p.layout in ("2d", "2.5d"):
        q = round((p.tp // p.depth) ** 0.5)
        heads, split_rows, cc = q, p.depth * q, h // q
    else:
        q = round(p.tp ** (1 / 3))
        heads, split_rows, cc = q, q * q, h // q
    n = p.local_batch // split_rows * T
    per_block = 0
    for h_in, h_out, position in dense_linears(cfg, heads):
        if p.layout == "3d":
            per_block += heads * n * h_in // heads + heads * n * h_out // heads + n * h_out // heads
        elif position == "column":
            per_block += n * cc + n * h_out // heads
        else:
            per_block += n * h_in // heads + n * cc
    experts = 0
    if cfg.moe and p.layout != "3d":
        experts = sum(rows.run * (2 * cc + 3 * (cfg.ffn // heads)) for rows in layer_rows(p, L, micro, first))
    return {"act": L * per_block + experts, "stat": 0, "grad": 0}
