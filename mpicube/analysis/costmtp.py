"""DeepSeek-V3's multi-token prediction depths (``--mtp-depth D``,
``model.mtp``) in the cost model: what the stage with the head runs for
them beyond the main model, per micro-batch.

Each depth k is, on the stage with the head (a pipeline's last, a V's
first):

* a lookup of its tokens in wte and, after its block, a loss through the
  LM head: the layouts' own lookup and head collectives once more per
  depth (``ends``). The wte panel is the chunk's, and on 2-D, 2.5-D and
  3-D every lookup gathers it afresh (``costmodel._embedding_uses``); a
  last stage without the lookup holds a copy of wte for them, summed
  with stage 0's over the tied pair (``Problem.tied_pair``);
* three RMSNorms (enorm, hnorm, its output norm): on the layouts that
  split the hidden size, their statistics are all-reduced as every norm's
  (``costmodel``'s norm counts);
* the projection W (2C, C) of the REPLICATED kind, run as two
  ``ReplicatedLinear`` over its embedding and hidden row blocks: where
  the hidden size is split (2-D, 2.5-D over the grid row, 3-D over k)
  each partial product (n, C) is all-reduced at the activations' sum wire
  (``projection_traffic``), and in backward the gradient of every output
  column (n, C) is all-reduced once (in the compute format);
* one transformer block, counted with the stage's blocks
  (``Problem.blocks``, ``costparams.stage_layers``): its linears, MLA's
  latents, the cp ring or Ulysses, a rerun under --recompute blocks, a
  segment gathered under --zero 3.

What a depth keeps for backward: ``depth_terms``; its FLOPs:
``depth_flops``. The reported loss carries 1 + D shares.
"""

from __future__ import annotations

from .costbase import Problem, Traffic
from .costmla import _geometry


def ends(p: Problem) -> tuple:
    """(lookups, heads) one micro-batch runs on this stage: the main
    model's where the stage has them, and one of each per MTP depth on the
    stage with the head."""
    return int(p.has_embed) + p.mtp, int(p.has_head) + p.mtp


def projection_traffic(p: Problem) -> Traffic:
    """One micro-batch of the MTP depths' projections on this stage, at
    this rank's positions (module docstring): on a layout splitting the
    hidden size over q ranks, two partial products of (n, C) summed in
    forward, the (n, C) output gradient summed in backward, per depth."""
    t = Traffic()
    if not p.mtp or p.layout in ("serial", "1d"):
        return t
    n, q, hidden = _geometry(p)
    act = n * p.cfg.n_embd                                    # every output column of this rank's rows
    t.sum(hidden, q, act, times=2 * p.mtp, width=p.widths.red)        # [e | g] @ W: two row blocks' partials
    t.allreduce(hidden, q, act, times=p.mtp, width=p.widths.stat)      # dy whole on every rank of the group
    return t


def depth_terms(p: Problem, n: int, nc: int, cc: int, q: int, V: int, shard: int) -> tuple:
    """(act, stat) elements one MTP depth keeps for backward outside its
    block on one rank (``model.mtp.DepthTape``), with ``costmemory``'s
    sizes: n intermediate rows, nc canonical rows of cc columns, the
    cube's side q (1 elsewhere), V the rank's vocabulary block, 1-D's row
    shard. Its lookup keeps token ids only; each of its three norms its
    normalised rows and 1/rms; the projection's two inputs (the normed
    embedding and hidden state, as the norms gave them); the loss head its
    input, logits and softmax, as the main head's, and the rows' 0/1 mask
    of positions with a target (compute format, one per row)."""
    regather = p.recompute == "gathers"
    act = 3 * nc * cc + 2 * nc * cc + 2 * n * V
    if p.layout == "3d":
        act += n * p.cfg.n_embd // q if regather else q * n * p.cfg.n_embd // q      # the head's input
    else:
        act += n * cc // shard if regather else n * cc
    return act, 3 * nc + n
