"""Analytic memory per rank per training step: parameters, gradients,
optimizer state and the activations kept for backward.

The companion of ``costmodel`` (communication and FLOPs), over the same
``Problem``; the conventions for ``--recompute`` and ``--zero 1`` are in
its docstring. The activation terms mirror what ``GPT.saved_elements``,
``GPT.saved_bytes`` and ``GPT.recompute_peak_*`` measure, and the tests
hold the two equal.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..parallel import zero
from .costmodel import Problem, block_linears, local_param_sizes


@dataclass
class Memory:
    """Elements held per rank, by category (``step_memory``), or their
    bytes (``step_memory_bytes``)."""

    params: int
    grads: int
    optimizer: int
    activations: int

    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations


def activation_elems(p: Problem, dropout: bool = False) -> int:
    """Elements kept for backward after one forward pass (what
    ``GPT.saved_elements`` measures)."""
    return sum(activation_terms(p, dropout).values())


def activation_bytes(p: Problem, dropout: bool = False) -> int:
    """Bytes of ``activation_elems`` (what ``GPT.saved_bytes`` measures):
    activations in the storage format, LayerNorm's per-row statistics in the
    compute format, the gradient panels of the tied embedding in the master
    format."""
    w = p.widths
    width = {"act": w.act, "stat": w.stat, "grad": w.grad}
    return sum(n * width[kind] for kind, n in activation_terms(p, dropout).items())


def activation_terms(p: Problem, dropout: bool = False) -> dict:
    """{"act", "stat", "grad": elements} kept for backward: LayerNorm
    outputs and statistics, linear inputs (gathered in 3-D), q/k/v,
    attention output and log-sum-exp, GELU input and tanh, logits and softmax,
    gathered embedding panels and their gradients, masks. Under
    --recompute blocks: the block inputs, what lies outside the blocks, and
    one rerun block's working set on top (``kept_and_rerun_terms``)."""
    kept, rerun = kept_and_rerun_terms(p, dropout)
    return {kind: kept[kind] + rerun[kind] for kind in kept}


def kept_and_rerun_terms(p: Problem, dropout: bool = False) -> tuple:
    """({kind: elements} kept right after forward (``GPT.saved_elements``),
    {kind: elements} of one block's caches after its rerun under
    --recompute blocks (``GPT.recompute_peak_elements``), zero otherwise)."""
    cfg, T, L, h, mode = p.cfg, p.local_seq, p.cfg.n_layer, p.cfg.n_embd, p.recompute   # T: this rank's positions
    if p.layout in ("serial", "1d"):
        q, split_rows, split_cols, heads = 1, 1, 1, (p.tp if p.layout == "1d" else 1)
        V = -(-cfg.vocab_size // heads) * heads // heads
        mid_cols = h // heads
    elif p.layout in ("2d", "2.5d"):
        q = round((p.tp // p.depth) ** 0.5)
        split_rows, split_cols, heads = p.depth * q, q, q
        V = -(-cfg.vocab_size // q)
        mid_cols = h // q
    else:
        q = round(p.tp ** (1 / 3))
        split_rows, split_cols, heads = q * q, q, q
        V = -(-cfg.vocab_size // q)
        mid_cols = h // q
    seqs = p.local_batch // split_rows
    n = seqs * T                       # token rows per rank, canonical and intermediate alike
    cc = h // split_cols               # canonical width
    lse = n * (cfg.n_head // heads)    # blockwise attention's per-row log-sum-exp, in the compute format
    # 1-D keeps a replicated activation it can gather again as a row shard of 1/p.
    shard = p.tp if p.layout == "1d" else 1
    # On a grid of one rank (q = 1) a "gathered" weight is the parameter itself, not a copy.
    gathered = q > 1
    regather = mode == "gathers"

    # one block: LN xhat (x2), qkv and the scaled copy of q, GELU input and tanh; blockwise
    # attention keeps no probabilities (ops.attention_blocks), only lse and its output
    block = 2 * n * cc + n * 4 * mid_cols + 2 * n * 4 * mid_cols
    if p.layout == "3d" and not regather and gathered:
        block += n * mid_cols          # the attention output: c_proj keeps its gathered input instead
    if p.layout == "3d":
        for h_in, h_out, _ in block_linears(cfg):
            block += n * h_in // q if regather else q * n * h_in // q         # local or gathered X
            block += 0 if regather else gathered * (h_in // q) * (h_out // q)   # gathered W
    else:
        first_inputs = 2 * n * cc // shard if regather else 2 * n * cc     # c_attn, c_fc
        block += first_inputs + n * mid_cols + n * 4 * mid_cols            # c_proj, mlp.c_proj
    if dropout:
        block += 2 * n * cc            # residual masks; attention's are drawn block by block, never kept
    # outside the blocks: ln_f xhat, logits and softmax, head input, wte panels, embedding mask
    outside, grad = n * cc + 2 * n * V, 0
    if p.layout == "3d":
        outside += n * h // q if regather else q * n * h // q                 # head input
        outside += 0 if regather else gathered * V * (h // q)                 # wte panel
        grad += V * (h // q)                                                  # its gradient
    else:
        outside += n * cc // shard if regather else n * cc                   # head input
        if p.layout in ("2d", "2.5d"):
            outside += 0 if regather else gathered * (V * q) * (h // q)      # wte[:, block c]
            grad += (V * q) * (h // q)                                        # its gradient
    if dropout:
        outside += n * cc
    if mode == "blocks":
        kept = {"act": L * n * cc // shard + outside, "stat": n, "grad": grad}
        return kept, {"act": block, "stat": 2 * n + lse, "grad": 0}
    kept = {"act": L * block + outside, "stat": (2 * L + 1) * n + L * lse, "grad": grad}   # rstd of LNs, lse
    return kept, {"act": 0, "stat": 0, "grad": 0}


def step_memory(p: Problem, dropout: bool = False) -> Memory:
    """Elements per rank. Under --zero 1 the buffers are padded to P_pad (a
    multiple of dp) and AdamW keeps 2 C moments (C = P_pad / dp)."""
    params = sum(n for n, _ in local_param_sizes(p).values())
    if p.sharded:
        padded, chunk = zero.sizes(params, p.dp, p.zero)
        return Memory(padded, padded, 2 * chunk, activation_elems(p, dropout))
    return Memory(params, params, 2 * params, activation_elems(p, dropout))



def step_memory_bytes(p: Problem, dropout: bool = False) -> Memory:
    """``step_memory`` in bytes: under mixed precision the parameters are a
    float32 master plus a 16-bit working copy, gradients and Adam moments
    float32, activations mostly 16-bit."""
    w, elems = p.widths, step_memory(p, dropout)
    if p.sharded:   # the full buffer is the 16-bit working copy, the float32 master only the chunk
        chunk = elems.optimizer // 2
        params = elems.params * w.act + (chunk * w.grad if w.act != w.grad else 0)
        return Memory(params, elems.grads * w.grad, elems.optimizer * w.grad, activation_bytes(p, dropout))
    params = elems.params
    working = params * w.act if w.act != w.grad else 0
    return Memory(params * w.grad + working, params * w.grad, 2 * params * w.grad, activation_bytes(p, dropout))
