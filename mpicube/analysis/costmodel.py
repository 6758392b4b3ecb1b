"""Analytic communication per rank per training step (memory:
``costmemory``, FLOPs: ``costflops``, the pipeline's point-to-point
traffic and bubble: ``costpipe``; the ``Problem`` they share is in
``costbase``). Under a pipeline every figure is one stage's
(``Problem.stage``): its layers, and the lookup or the head where it has
them.

Each layout's function walks the same collective sequence its code issues
(layouts/*.py), with the ring conventions of ``mpicube.parallel.comm``, and returns
the elements and messages per axis. Tests check that these predictions
equal the measured counters exactly, so this file and the layouts cannot
drift apart silently. The formulas of docs/design.md section 4 fall out as the
linear-layer part of ``cube``.

Bytes follow from what each collective carries (``Widths``): activations,
weight copies and the panels layouts gather or broadcast travel in the
storage format (2 bytes under mixed precision), and so do the sums of
activations, activation gradients and weight-gradient partials (16-bit
words added in float32 at the receiver, ``mpicube.parallel.comm_wire``). The small
statistics (LayerNorm's per-row sums, the cross-entropy's max, sum and
target logit) are reduced in the compute format (float32), and the
gradient norm and the loss as one float64 each. The summed gradients of
replicated parameters (replica groups, data parallelism) travel at
``Widths.gsum`` (``precision.gradient_wire_name``): 2 bytes under
bfloat16 (comm_wire's all-reduce, priced by ``Traffic.sum``, and its
reduce-scatter under --zero 1), the master format otherwise (float16's
loss-scaled gradients would overflow a 16-bit sum). bfloat16 therefore
moves half of float32's bytes but for those statistics and scalars, with
data parallelism too (1-D p = 2 x dp = 2, the ``make train`` model:
2.39 MB per rank and step against 4.78 MB; float16 3.45 MB).

Recompute modes (``Problem.recompute``, layouts/base.py):

* "gathers" adds the second gathering of every panel a layout let go of
  after forward (3-D: X and W of each linear, the LM head's input and wte
  panel; 2-D/2.5-D: the wte panel; 1-D: the row-sharded inputs of the
  column-parallel linears and of the LM head) and drops them from the saved
  activations. The panels gathered again in backward are transient, like
  the gathered dY of every backward today, and are not counted as memory.
* "blocks" adds every collective of each block's forward a second time
  (1-D also the all-gather of the row-sharded block input); the saved
  activations are each block's input plus what lies outside the blocks,
  and ``activation_terms`` adds the working set of one rerun block (its
  caches and dropout masks, measured as ``GPT.recompute_peak_*``), since
  backward holds that on top.

``Problem.zero = 1`` (mpicube.parallel.zero, with dp > 1): the buffers are padded to
P_pad = dp C; the dp all-reduce becomes a reduce-scatter of the padded
gradient (at ``Widths.gsum``) and an all-gather of the updated chunk
(storage format), the gradient norm is all-reduced over the world, and AdamW keeps
2 C moments. Under mixed precision the float32 master is the chunk only
and is counted with the parameters (C master + P_pad working copy), as the
master is counted there with --zero 0.

``Problem.zero`` = 2 or 3 (mpicube.parallel.fsdp): the buffer is cut per layer
(``zero.segment_sizes``), and every micro-batch sums each layer's replica
groups and reduce-scatters its padded segment over dp (``segmented_traffic``);
--zero 3 all-gathers the outside segment once per step and the blocks as
their two alternating slots need them: L in the step's first forward,
L - 2 in every later pass (the last two blocks are still in their slots at
each turn; all L stay when L <= 2; a pipeline stage's passes walk one
chunk each, in its schedule's order, and are replayed: ``block_gathers``);
--zero 2 all-gathers the chunk after the step as --zero 1 does. With
--cp the chunk (C) is all-reduced over the ring once per step, and with
stages the tied wte (a segment of its own there) its chunk over the pair.
Memory: ``costmemory.segmented_memory``.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

from ..parallel import fsdp, zero
from ..parallel.schedules import VEE_SCHEDULES, build_schedule
from ..core.config import ModelConfig
from .costbase import STORAGE_BYTES, Problem, Traffic, Widths   # noqa: F401 (their home for every caller)
from .costfp8 import fp8_traffic
from .costpipe import pipeline_traffic
from .costcp import ring_traffic, ulysses_traffic
from .costmla import latent_traffic, oned_linear_sums, oned_sequence_sums
from .costmtp import ends, projection_traffic
from .costmuon import muon_traffic
from .costparams import (_group_size, block_linears, dense_linears, expert_elems,  # noqa: F401 (re-exported)
                         grad_runs, head_split, kv_param_sizes, local_param_sizes, on_stage, segments_of, site_of,
                         segment_name, stage_linears)


def _layernorm(t: Traffic, axis, g, rows, count, width, rms: bool = False):  # statistics: width is Widths.stat
    """Forward: mean and variance all-reduces; backward: one of two sums.
    RMSNorm (``rms``): the mean square forward, one sum backward."""
    if rms:
        t.allreduce(axis, g, rows, times=2 * count, width=width)
        return
    t.allreduce(axis, g, rows, times=2 * count, width=width)
    t.allreduce(axis, g, 2 * rows, times=count, width=width)


def _norm_stats_again(cfg: ModelConfig) -> int:
    """All-reduces of per-row statistics one rerun block's two norms make
    (--recompute blocks): two each for LayerNorm, one for RMSNorm."""
    return 2 if cfg.llama else 2 * 2


def _embedding_uses(p: Problem) -> tuple:
    """(gathers, gradient reductions) of the embedding panels a stage
    holds: the tied wte serves the lookup and the head with one panel;
    an untied model's lookup (wte) and head (lm_head) have one each, and
    so do the two ends of zbv's V on stage 0 (two chunks: a panel each);
    MTP depths: ``costmtp`` (each lookup gathers the wte panel afresh)."""
    embed, head = int(p.has_embed), int(p.has_head)
    one_model = p.pp == 1 or p.pp_schedule not in VEE_SCHEDULES
    n = int(embed or head) if p.cfg.tied and one_model else embed + head
    own = int(p.mtp > 0 and not p.cfg.tied and not (embed and one_model))   # the depths' wte panel on the head's chunk
    again = p.mtp if p.recompute == "gathers" and not p.cfg.tied else 0   # each depth's head: lm_head let go
    return n + p.mtp + again, n + own


def _cross_entropy(t: Traffic, axis, g, rows, width, times: int = 1):
    t.allreduce(axis, g, rows, times=3 * times, width=width)   # max, sum of exp, target logit (per head)


def serial_traffic(p: Problem) -> Traffic:
    return Traffic()


def oned_traffic(p: Problem) -> Traffic:
    """1-D: each block's sharded linears (``stage_linears``: a ROW sums its
    output, a COLUMN its input gradient; ``costmla.oned_linear_sums``),
    the lookup's and the LM head's sums, the cross-entropy's statistics;
    --sequence-parallel: ``oned_sequence_traffic``."""
    t, g, w = Traffic(), p.tp, p.widths
    act = p.local_batch * p.seq_len * p.cfg.n_embd       # a replicated activation
    L, (lookups, head) = p.blocks, ends(p)
    _cross_entropy(t, "tp", g, p.local_batch * p.seq_len, w.stat, times=head)
    if p.sequence_parallel:
        t.add(oned_sequence_traffic(p, act))
        return t
    t.add(oned_linear_sums(p, stage_linears(p)))          # 2 forward (row-split), 2 backward a dense block
    t.sum("tp", g, act, times=lookups + head, width=w.red)   # embedding lookups, LM heads' backward
    if p.recompute == "gathers":                          # the LM head's input from its row shards
        t.allgather("tp", g, act // g, times=head, width=w.act)
    if p.recompute == "blocks":                           # block inputs from row shards (forwards again: above)
        t.allgather("tp", g, act // g, times=L, width=w.act)
    return t


def oned_sequence_traffic(p: Problem, act: int) -> Traffic:
    """1-D under --sequence-parallel (layouts/seqpar.py): every all-reduce
    of ``act`` as its two halves along T, an all-gather of the T/tp shard
    and a reduce-scatter (``costmla.oned_sequence_sums`` for the blocks'
    linears); --recompute gathers gathers the column-parallel and head
    inputs again, --recompute blocks reruns each block's forward (its
    input is already a shard: nothing to restore)."""
    t, g, w = Traffic(), p.tp, p.widths
    embed, head = ends(p)
    t.add(oned_sequence_sums(p, stage_linears(p)))
    again = head if p.recompute == "gathers" else 0
    t.allgather("tp", g, act // g, times=head + embed + again, width=w.act)   # head input, lookup backward dY
    t.reduce_scatter("tp", g, act, times=embed + head, width=w.red)          # lookup output, head backward dX
    return t


def tesseract_traffic(p: Problem) -> Traffic:
    t, cfg, d, w = Traffic(), p.cfg, p.depth, p.widths
    q = round((p.tp // d) ** 0.5)
    n = p.local_batch * p.seq_len // (d * q)              # activation rows per rank
    V = -(-cfg.vocab_size // q) * q
    forwards = 2 if p.recompute == "blocks" else 1            # blocks: each block's forward again
    L, (_, head) = p.blocks, ends(p)
    for h_in, h_out, _ in stage_linears(p, q):
        x_panel, w_panel = n * h_in // q, (h_in // q) * (h_out // q)
        t.bcast("row", q, x_panel, times=(forwards + 1) * q, width=w.act)   # forward, and again for dW
        t.reduce_onto("row", q, x_panel, times=q, width=w.red)  # dX
        t.bcast("col", q, w_panel, times=(forwards + 1) * q, width=w.act)   # forward, and again for dX
        t.reduce_onto("col", q, w_panel, times=q, width=w.red)  # dW
    _layernorm(t, "row", q, n, 2 * L + head + 2 * p.mtp, w.stat, rms=cfg.llama)   # MTP: enorm, hnorm too
    if forwards == 2:
        t.allreduce("row", q, n, times=_norm_stats_again(cfg) * L, width=w.stat)   # ln_1, ln_2 statistics again
    # A stage holding wte gathers it at its first use (an untied head its lm_head too);
    # gathers: the head's again for its backward (once: MTP's heads run backward on the panel the last gathered).
    panels, grads = _embedding_uses(p)
    gathers = panels + (min(head, 1) if p.recompute == "gathers" else 0)
    t.allgather("col", q, (V // q) * (cfg.n_embd // q), times=gathers, width=w.act)   # wte[:, block c]
    t.reduce_scatter("row", q, n * V, times=head, width=w.red)    # LM head forward
    t.allgather("row", q, n * V // q, times=head, width=w.act)    # LM head backward
    t.reduce_scatter("col", q, V * (cfg.n_embd // q), times=grads, width=w.red)    # wte (lm_head) gradient
    _cross_entropy(t, "row", q, n, w.stat, times=head)
    return t


def cube_traffic(p: Problem) -> Traffic:
    t, cfg, w = Traffic(), p.cfg, p.widths
    q = round(p.tp ** (1 / 3))
    n = p.local_batch * p.seq_len // (q * q)              # canonical rows per rank
    h = cfg.n_embd
    V = -(-cfg.vocab_size // q) * q
    gathers = 2 if p.recompute == "gathers" else 1     # gathers: X and W again in backward
    forwards = 2 if p.recompute == "blocks" else 1     # blocks: each block's forward again
    L, (embed, head) = p.blocks, ends(p)
    for h_in, h_out, position in stage_linears(p, q):
        a, b = ("j", "k") if position == "column" else ("k", "j")
        t.allgather(a, q, n * h_in // q, times=forwards * gathers, width=w.act)                        # X over a
        t.allgather("i", q, (h_in // (q * q)) * (h_out // q), times=forwards * gathers, width=w.act)   # W over i
        t.reduce_scatter(b, q, n * q * h_out // q, times=forwards, width=w.red)               # Y over b
        t.allgather(b, q, n * h_out // q, width=w.act)                        # dY over b
        t.reduce_scatter(a, q, n * q * h_in // q, width=w.red)                # dX over a
        t.reduce_scatter("i", q, (h_in // q) * (h_out // q), width=w.red)     # dW over i
    _layernorm(t, "k", q, n, 2 * L + head + 2 * p.mtp, w.stat, rms=cfg.llama)    # MTP: enorm, hnorm too
    if forwards == 2:
        t.allreduce("k", q, n, times=_norm_stats_again(cfg) * L, width=w.stat)      # ln_1, ln_2 statistics again
    wte, grads = _embedding_uses(p)                    # a stage gathers each panel at its first use
    t.allgather("i", q, (V // q) * (h // (q * q)), times=wte + head * (gathers - 1), width=w.act)   # wte over i
    t.reduce_scatter("j", q, n * q * h // q, times=embed, width=w.red)         # lookup
    t.allgather("j", q, n * h // q, times=head * gathers, width=w.act)   # head: X over j
    t.reduce_scatter("k", q, n * q * V // q, times=head, width=w.red)         # head: logits over k
    t.allgather("k", q, n * V // q, times=head, width=w.act)                  # head backward: dlogits
    t.reduce_scatter("j", q, n * q * h // q, times=head, width=w.red)         # head backward: dX
    t.allgather("j", q, n * h // q, times=embed, width=w.act)                  # lookup backward: dX
    t.reduce_scatter("i", q, (V // q) * (h // q), times=grads, width=w.red)    # wte (lm_head) gradient
    _cross_entropy(t, "j", q, n, w.stat, times=head)
    return t


TRAFFIC = {"serial": serial_traffic, "1d": oned_traffic, "2d": tesseract_traffic,
           "2.5d": tesseract_traffic, "3d": cube_traffic}


def step_traffic(p: Problem) -> Traffic:
    """Everything one training step moves: the layout's forward/backward
    once per micro-batch (at the micro-batch's sizes), then once per step
    the gradient all-reduces over replica groups and over dp (at the
    ``Widths.gsum`` wire) and the gradient norm; the reported loss once per
    micro-batch (each forward returns its share, GPT.forward). Under
    --zero 1 the dp all-reduce is a reduce-scatter of the padded gradient
    and an all-gather of the updated chunk (in the storage format), and the
    norm is summed over the world.

    Under a pipeline (pp > 1) the figures are this stage's: its layers'
    collectives, its point-to-point traffic (``costpipe.pipeline_traffic``,
    axis "pp"), the sum of the tied wte's gradient over the first and last
    stage (axis "tied", at the gsum wire), and the gradient norm all-reduced
    over "pp" after "tp" (one float64 each). Under --zero 2 and 3 the ring's
    and the pair's sums move the owned chunks (C, C_wte) instead."""
    t = Traffic()
    local = replace(p, seq_len=p.local_seq, cp=1)                  # on this rank's positions
    t.add(TRAFFIC[p.layout](local), p.grad_accum)
    t.add(latent_traffic(local), p.grad_accum)                      # MLA's latents and shared key
    t.add(projection_traffic(local), p.grad_accum)                  # MTP depths' projections
    t.add(pipeline_traffic(p))
    if p.fp8:                        # --fp8: the tensor scales' amax all-reduces (costfp8)
        t.add(fp8_traffic(p), p.grad_accum)
    sizes = local_param_sizes(p)
    params = sum(n for n, _ in sizes.values())
    w = p.widths
    # --zero 2/3 sum the cp ring and the tied pair on the owned chunks (parallel.gradients.GradientSync)
    segments = segments_of(p, sizes) if p.segmented else None
    experts = expert_elems(p, sizes)  # --ep > 1: a mixture's experts, summed over the expert-data group
    if p.cp > 1:
        t.add(ring_traffic(p), p.grad_accum)
        t.add(ulysses_traffic(p), p.grad_accum)
        summed = sum(c for _, _, c, _, x in segments if not x) if segments else params - experts
        t.sum("cp", p.cp, summed, width=w.gsum)                # the weights' gradients over the ring
    group_runs = grad_runs(p, sizes)
    if p.tied_pair and (p.has_embed or p.has_head):   # wte's two copies, before the optimizer
        tied = next(c for seg, _, c, _, _ in segments if seg == zero.TIED) if segments else sizes["wte"][0]
        t.sum("tied", 2, tied, width=w.gsum)
    if p.segmented:                  # replica groups and dp summed per layer and micro-batch instead
        segmented_traffic(p, t, sizes)
    elif p.sharded:
        _group_sums(p, t, group_runs)
        _kv_sums(p, t, kv_param_sizes(p))
        for axis, g, n in (("dp", p.dp, params - experts), ("edp", p.edp, experts))[:2 if experts else 1]:
            padded, chunk = zero.sizes(n, g, p.zero)
            t.reduce_scatter(axis, g, padded, width=w.gsum)    # (16-bit words counted as MPI's)
            t.allgather(axis, g, chunk, width=w.act)           # parameters after the step
        folded = 2 if experts and p.cp > 1 else 1            # --ep under --cp: [dense, experts] squares
        t.allreduce("world", p.tp * p.dp * p.pp * p.cp, folded, width=w.scalar)   # gradient norm
    else:
        _group_sums(p, t, group_runs)
        _kv_sums(p, t, kv_param_sizes(p))
        t.sum("dp", p.dp, params - experts, width=w.gsum)
        if experts:
            t.sum("edp", p.edp, experts, width=w.gsum)
        t.allreduce("tp", p.tp, 1, width=w.scalar)             # gradient norm
        t.allreduce("pp", p.pp, 1, width=w.scalar)             # ... and over the stages
    if p.cfg.moe:                    # the router, its ledger, the all-to-all and the experts' linears
        from .costexpertcomm import moe_traffic

        t.add(moe_traffic(p, norm=not p.sharded))
    if p.optimizer == "muon":
        t.add(muon_traffic(p, sizes, segments))
    # reported loss (the main share and each MTP depth's): per micro-batch; a pipeline sums its last
    # stage's shares once per step
    t.allreduce("world", p.tp * p.dp * p.pp * p.cp, 1 + p.cfg.mtp_depth, times=p.grad_accum if p.pp == 1 else 1,
                width=w.scalar)
    return t


def _group_sums(p: Problem, t: Traffic, group_runs: list) -> None:
    """Once per step, each replica group's gradients summed (one all-reduce per run, ``grad_runs``)."""
    for axis, n in group_runs:
        t.sum(axis, _group_size(p, axis), n, width=p.widths.gsum)


def _kv_sums(p: Problem, t: Traffic, kv_sizes: dict, times: int = 1) -> None:
    """The shared kv columns of ``kv_sizes`` summed over their sharers, all
    of them in one all-reduce (``gradients.sync_shared``)."""
    if kv_sizes:
        share = next(iter(kv_sizes.values()))[1]
        t.sum("kv", share, sum(n for n, _ in kv_sizes.values()), times=times, width=p.widths.gsum)


def segmented_traffic(p: Problem, t: Traffic, sizes: dict) -> None:
    """--zero 2 and 3 (module docstring): per micro-batch and layer, the
    replica-group sums and the reduce-scatter; the gathers; the norm. With
    --ep a block's experts are a segment of their own, reduce-scattered and
    gathered over the expert-data group (axis edp, ``fsdp.SegmentedStore``)."""
    w = p.widths
    segments = segments_of(p, sizes)
    axis_of = {False: ("dp", p.shard_dp), True: ("edp", p.edp)}   # --hsdp: the shard group, axis "dp" too
    blocks = [s for s in segments if not zero.is_end(site_of(s[0]))]
    if p.zero == 3 and blocks:
        times = block_gathers(p, sorted({site_of(s[0]) for s in blocks}, key=zero.segment_key))
        for seg, _, chunk, parts, x in blocks:           # a block's pieces, as often as the block is gathered
            t.allgather(axis_of[x][0], parts, chunk, times=times[site_of(seg)], width=w.act)
    by_segment = defaultdict(lambda: defaultdict(int))   # {segment: {axis: elements}} of the summed tensors
    for name, (n, axis) in sizes.items():
        if axis is not None:
            by_segment[segment_name(p, name)][axis] += n
    for site in dict.fromkeys(site_of(s[0]) for s in segments):
        pieces = [s for s in segments if site_of(s[0]) == site]
        runs, end = [], None                     # (axis, elements) runs of the site's slot, merged when adjacent
        for seg, size, chunk, parts, x in pieces:
            groups = by_segment.get(seg, {})
            for k, axis in enumerate(sorted(groups)):
                if runs and runs[-1][0] == axis and k == 0 and end:
                    runs[-1] = (axis, runs[-1][1] + groups[axis])
                else:
                    runs.append((axis, groups[axis]))
            end = size == parts * chunk          # the next piece starts right after this one's last element
        for axis, n in runs:
            t.sum(axis, _group_size(p, axis), n, times=p.grad_accum, width=w.gsum)
        _kv_sums(p, t, {name: v for name, v in kv_param_sizes(p).items()
                        if zero.segment_of(name, p.pp > 1) == site}, times=p.grad_accum)
        for seg, _, chunk, parts, x in pieces:
            t.reduce_scatter(axis_of[x][0], parts, parts * chunk, times=p.grad_accum, width=w.gsum)
            if p.zero == 3 and zero.is_end(site):
                t.allgather(axis_of[x][0], parts, chunk, width=w.act)    # once per step: it stays gathered
    if p.zero == 2:                              # parameters after the step: dense chunks over dp, experts' over edp
        for x in (False, True):
            mine = [c for _, _, c, _, e in segments if e == x]
            if mine:
                t.allgather(axis_of[x][0], axis_of[x][1], sum(mine), width=w.act)
    if p.hsdp > 1:                               # --hsdp: the summed chunk all-reduced over the R replicas
        t.sum("hsdp", p.hsdp, sum(c for _, _, c, _, _ in segments), width=w.gsum)
    folded = 2 if any(s[4] for s in segments) and p.cp > 1 else 1     # --ep under --cp: [dense, experts]
    t.allreduce("world", p.tp * p.dp * p.pp * p.cp, folded, width=w.scalar)   # gradient norm


def block_gathers(p: Problem, blocks: list) -> dict:
    """{block segment: its all-gathers per step} under --zero 3 on this
    rank's store of ``blocks`` (segment names), per block because blocks
    need not be alike (DeepSeek-V3's first dense ones): without stages
    every pass walks all of them, forward then backward per micro-batch
    (in all ``fsdp.block_gathers``); a pipeline stage walks one chunk per
    forward or backward in its schedule's order; both replayed by
    ``fsdp.gathers_by_block``."""
    if p.pp == 1:
        passes = [blocks, blocks[::-1]] * p.grad_accum
    else:
        split, passes = p.chunk_layers, []
        for a in build_schedule(p.pp_schedule, p.pp, p.grad_accum, p.virtual_stages)[p.stage]:
            if a.op in ("forward", "backward"):
                walk = [f"h.{i}" for i in split[a.chunk * p.pp + p.stage]]
                passes.append(walk if a.op == "forward" else walk[::-1])
    return fsdp.gathers_by_block(passes, blocks)
