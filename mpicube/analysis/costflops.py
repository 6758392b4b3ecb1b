"""Analytic FLOPs per rank per training step, over ``costmodel``'s
``Problem`` (communication there, memory in ``costmemory``)."""

from __future__ import annotations

from fractions import Fraction

from ..parallel.context import ring_scores
from .costexperts import moe_linear_flops
from .costmla import qk, replicated_flops_share, replicated_outputs
from .costmodel import Problem, head_split
from .costparams import dense_linears, moe_layers, stage_linears


def step_flops(p: Problem) -> Fraction:
    """GEMM and attention FLOPs per rank per step, from the sizes alone (a
    prediction, not measured: nothing counts FLOPs at run time). Forward
    2 m n k per GEMM (the four linears of every block, the LM head over the
    layout's padded vocabulary), backward twice the forward, and under
    --recompute blocks every block's forward once more. Attention is
    blockwise (ops.attention_blocks): its two products run only on the
    blocks at or below the diagonal (``ring_scores``: about half of T^2
    at long T), and backward makes five products of that size (the scores
    again, dV, dP, dQ, dK). Every layout splits each of these evenly over
    its tensor-parallel ranks, and context parallelism over its cp ranks,
    so one rank does 1/(tp cp) of its replica's work; under a pipeline, of
    its stage's layers (and the head on the last). A mixture's experts
    are priced for balanced routing (``costexperts.moe_linear_flops``).
    MTP depths (on the stage with the head): a block each among the
    stage's, a head each, and the 2C x C projection (REPLICATED: whole on
    every 1-D rank, as MLA's latents)."""
    cfg, L, h, T = p.cfg, p.blocks, p.cfg.n_embd, p.seq_len
    N = p.local_batch * T                                            # tokens per replica and micro-batch
    # per block on average: the sharded linears (kv copies too; a dense block's MLP, a DeepSeekMoE
    # block's shared experts), MLA's REPLICATED projections (whole on every 1-D rank), the router
    # and each token's K experts under balanced routing in the blocks with a mixture
    linears = Fraction(sum(2 * N * h_in * h_out for h_in, h_out, _ in stage_linears(p, head_split(p))), max(L, 1))
    if cfg.mla:
        linears += 2 * N * h * sum(replicated_outputs(cfg)) * p.tp * replicated_flops_share(p)
    if cfg.moe:
        linears += Fraction(moe_layers(p) * moe_linear_flops(p, N), max(L, 1))
    width = cfg.n_head * qk(cfg) if cfg.mla else h   # MLA: both products at qk (the op pads v to it)
    attention = 2 * 2 * p.local_batch * ring_scores(T, p.cp) * width   # q k^T and probs v on the computed blocks
    head = 2 * N * h * _padded_vocab(p) * (1 + p.mtp) if p.has_head else 0
    head += 2 * N * 2 * h * h * p.mtp * p.tp * replicated_flops_share(p)     # MTP projections
    forwards = 2 if p.recompute == "blocks" else 1
    work = 3 * (L * linears + head) + (forwards - 1) * L * linears + L * Fraction(2 * forwards + 5, 2) * attention
    return Fraction(p.grad_accum * work, p.tp * p.cp)                 # N micro-batches


def chunk_phase_flops(p: Problem, chunk: int) -> dict:
    """{"forward", "backward_input", "backward_weight": FLOPs} one rank
    spends on model chunk ``chunk`` for one micro-batch, the terms of
    ``step_flops`` split as a zero-bubble schedule splits the work: F the
    forward (and the head on the last chunk); B, the input gradient, each
    linear's dX GEMM, all of attention's backward (it has no weights), the
    head's two products (its gradient stays in B, ``parallel.wgrad``) and
    under --recompute blocks the rerun forward; W each linear's dW GEMM. A
    whole backward is B + W. Over a stage's chunks and the micro-batches
    the three add up to ``step_flops`` (tests/test_costpipe.py)."""
    cfg, h, T = p.cfg, p.cfg.n_embd, p.seq_len
    N = p.local_batch * T                                            # tokens per replica and micro-batch
    layers = p.chunk_layers[chunk]
    linears = Fraction(sum(2 * N * h_in * h_out for i in layers for h_in, h_out, _ in
                           dense_linears(cfg, head_split(p), i)))
    if cfg.mla:
        linears += len(layers) * 2 * N * h * sum(replicated_outputs(cfg)) * p.tp * replicated_flops_share(p)
    if cfg.moe:
        linears += sum(cfg.is_moe(i) for i in layers) * moe_linear_flops(p, N)
    width = cfg.n_head * qk(cfg) if cfg.mla else h
    attention = len(layers) * 2 * 2 * p.local_batch * ring_scores(T, p.cp) * width
    head = 2 * N * h * _padded_vocab(p) if chunk == p.pp * p.virtual_stages - 1 else 0
    rerun = linears + attention if p.recompute == "blocks" else 0
    split = p.tp * p.cp
    return {"forward": Fraction(linears + attention + head, split),
            "backward_input": Fraction(linears + Fraction(5, 2) * attention + 2 * head + rerun, split),
            "backward_weight": Fraction(linears, split)}


def _padded_vocab(p: Problem) -> int:
    """The vocabulary the layout's LM head multiplies by (padded to its split)."""
    if p.layout == "serial":
        split = 1
    elif p.layout == "1d":
        split = p.tp
    elif p.layout in ("2d", "2.5d"):
        split = round((p.tp // p.depth) ** 0.5)
    else:
        split = round(p.tp ** (1 / 3))
    return -(-p.cfg.vocab_size // split) * split
