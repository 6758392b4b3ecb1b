"""The memory-bound work of each pipeline phase: the bytes the elementwise
passes between the GEMMs read and write, per model chunk and micro-batch,
counted from the model's shapes (``costbubble`` prices them at a memory
rate beside the FLOPs at a GEMM rate).

Why: a FLOP count sees the GEMMs and attention's products only. The norms,
the activation, attention's softmax passes, dropout, the residual adds,
the biases and the cross-entropy over the vocabulary run at memory speed,
and nearly all of it lands in F and B: the weight phase W is the linears'
dW GEMMs, their bias sums and the gradients' accumulation. So W is a
smaller share of the backward, and the head's stage a longer one, than
the FLOPs say.

A pass counts the elements it reads plus those it writes, once each, as
the code makes it (the CPU build's fused kernels where they run:
LayerNorm's three passes and its backward's two, GELU's two passes around
NumPy's tanh, the blockwise attention's online-softmax passes; NumPy's own
passes for RMSNorm, SwiGLU and the cross-entropy). A GEMM's own operands
and output are the FLOPs' part, not counted here. Per token of one
micro-batch (elements, times the working format's width):

=================  =====================================  ======================
pass               forward (F)                            backward (B)
=================  =====================================  ======================
norm (each)        LayerNorm 5 C, RMSNorm 5 C             LayerNorm 8 C, RMSNorm 13 C
biases             2 x each linear's output               (W: 1 x, the column sums)
dW accumulation    -                                      (W: 3 per weight element, grad +=
                                                          the product, after the step's first
                                                          micro-batch, which writes it)
residual adds      2 x 3 C                                2 x 3 C
GELU on 4C / SwiGLU 7 x 4C / 14 F                         4 x 4C / 23 F
attention          q scaled 2 C, y normalised 2 C,        D = rowdot(dy, y) 2 C, dq scaled
                   rotary 2 (q + k) (Llama),              2 C, rotary 2 (q + k);
                   per score 5 (max, exp, row sum)        per score 7 (shift, exp, dS)
dropout (p > 0)    per mask 6 (draw, scale, apply);       3 per mask a residual, 11 per
                   two residual masks, one on the scores  score (the mask redrawn, p and dP)
embeddings         lookup + positions 5 C (Llama's        wte's scatter-add 3 C, wpe's
                   lookup alone 2 C)                      sums 2 C (Llama 3 C)
cross-entropy      10 V (copy, max, shift, exp, sum,      2 V (probabilities x scale)
                   divide)
=================  =====================================  ======================

(C the hidden size, F Llama's MLP width, V the padded vocabulary; scores
per sequence and head: ``parallel.context.ring_scores``, whole blocks at
and below the diagonal.) Under --recompute blocks, B makes the blocks'
forward passes again. The split over ranks follows the FLOPs' (tp cp),
except that under 1-D tensor parallelism without --sequence-parallel the
canonical region (norms, residuals, embeddings) is whole on every tp rank.
A mixture's experts and MLA's latents are priced as the dense MLP and
attention of the same widths (an approximation: their routing and
latent passes are not counted).
"""

from __future__ import annotations

from fractions import Fraction

from ..parallel.context import ring_scores
from .costbase import Problem
from .costflops import _padded_vocab
from .costmodel import head_split
from .costparams import dense_linears

NORM = {False: (5, 8), True: (5, 13)}          # (F, B) elements per hidden element: LayerNorm, RMSNorm
ACTIVATION = {False: (7, 4), True: (14, 23)}   # per activation output element: GELU, SwiGLU
SCORE = (5, 7)                                 # per score element: online max + exp + row sum; shift + exp + dS
DROPOUT_SCORE = (6, 11)                        # per score element when dropout is on
DROPOUT_MASK = (6, 3)                          # per canonical element, each residual mask
CROSS_ENTROPY = (10, 2)                        # per logit
EMBED = {False: (5, 5), True: (2, 3)}          # per embedding element: lookup (+ positions); the sums


def chunk_phase_elements(p: Problem, chunk: int, dropout: float = 0.0) -> dict:
    """{"forward", "backward_input", "backward_weight": elements} the
    elementwise passes of model chunk ``chunk`` read and write on one rank
    for one micro-batch (the module docstring's table)."""
    cfg, T = p.cfg, p.seq_len
    llama = cfg.llama
    tokens = p.local_batch * T                                       # per replica and micro-batch
    split = p.tp * p.cp
    canonical_split = p.cp if p.layout == "1d" and not p.sequence_parallel else split
    C, hd = cfg.n_embd, cfg.head_dim
    q_width, kv_width = cfg.n_head * hd, cfg.kv_heads * hd
    qkv = q_width + 2 * kv_width
    hidden = cfg.ffn if llama else 4 * C                              # the activation's output width
    fc_out = 2 * hidden if llama else hidden
    scores = p.local_batch * cfg.n_head * ring_scores(T, p.cp)       # per replica and micro-batch
    on = dropout > 0
    f = b = w = Fraction(0)
    layers = len(p.chunk_layers[chunk])
    norm_f, norm_b = NORM[llama]
    act_f, act_b = ACTIVATION[llama]
    # per token, canonical region of one block: two norms, two residual adds, two residual dropouts
    block_canon_f = 2 * norm_f * C + 2 * 3 * C + (2 * DROPOUT_MASK[0] * C if on else 0)
    block_canon_b = 2 * norm_b * C + 2 * 3 * C + (2 * DROPOUT_MASK[1] * C if on else 0)
    # per token, the tp-split region of one block: attention's row passes, rotary, the activation, biases
    rotary = 2 * (q_width + kv_width) if llama else 0
    block_mid_f = 2 * q_width + 2 * q_width + rotary + act_f * hidden
    block_mid_b = 2 * q_width + 2 * q_width + rotary + act_b * hidden
    biases = 0 if llama else qkv + C + fc_out + C                     # the four linears' outputs
    block_mid_f += 2 * biases
    f += layers * tokens * Fraction(block_canon_f, canonical_split)
    b += layers * tokens * Fraction(block_canon_b, canonical_split)
    mid_f = layers * (tokens * block_mid_f + scores * (SCORE[0] + (DROPOUT_SCORE[0] if on else 0)))
    mid_b = layers * (tokens * block_mid_b + scores * (SCORE[1] + (DROPOUT_SCORE[1] if on else 0)))
    f += Fraction(mid_f, split)
    b += Fraction(mid_b, split)
    if p.recompute == "blocks":                                      # B reruns the blocks' forward first
        b += f
    w += Fraction(layers * tokens * biases, split)                    # the bias sums travel with dW
    weights = sum(h_in * h_out for i in p.chunk_layers[chunk] for h_in, h_out, _ in
                  dense_linears(cfg, head_split(p), i))                # the chunk's linears, whole
    w += Fraction(3 * weights * (p.grad_accum - 1), p.tp * p.grad_accum)   # grad += X^T dY, on this rank's shard
    if chunk == 0:                                                   # the lookup of wte (and wpe)
        embed_f, embed_b = EMBED[llama]
        f += Fraction(tokens * (embed_f * C + (DROPOUT_MASK[0] * C if on else 0)), canonical_split)
        b += Fraction(tokens * (embed_b * C + (DROPOUT_MASK[1] * C if on else 0)), canonical_split)
    if chunk == p.pp * p.virtual_stages - 1:                         # ln_f and the loss over the vocabulary
        f += Fraction(tokens * norm_f * C, canonical_split)
        b += Fraction(tokens * norm_b * C, canonical_split)
        f += Fraction(tokens * CROSS_ENTROPY[0] * _padded_vocab(p), split)
        b += Fraction(tokens * CROSS_ENTROPY[1] * _padded_vocab(p), split)
    return {"forward": f, "backward_input": b, "backward_weight": w}


def chunk_phase_bytes(p: Problem, chunk: int, dropout: float = 0.0) -> dict:
    """``chunk_phase_elements`` in bytes of the working format."""
    return {op: n * p.widths.act for op, n in chunk_phase_elements(p, chunk, dropout).items()}
