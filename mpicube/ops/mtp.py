"""Multi-token prediction's local math (DeepSeek-V3 report section 2.2),
with no communication of its own.

Depth k = 1 .. D of the module chain, at position i of a sequence:

    h^k_i = Block_k( [RMSNorm_e(Emb(t_{i+k})) | RMSNorm_h(h^{k-1}_i)] @ W_k )

W_k (2C, C) is the projection (transformers' ``eh_proj``, stored
transposed), h^0 the main model's output hidden state (transformers
drafts from ``hidden_states[-1]``, which it sets to the state AFTER the
final norm; the model, not these ops, picks which state enters), Emb and
the output head shared with the main model; depth k
predicts t_{i+k+1} from norm_k(h^k_i) (``shared_head.norm``). The
concatenation order, embedding first, is that of DeepSeek-V3's released
checkpoints and of transformers' ``MtpLayer`` (the report's equation
writes the hidden state first; the weights decide).

Tokens: a window gives inputs x (B, T) and targets y (B, T), y_i =
t_{i+1}. Depth k reads the embedding of t_{i+k} = y_{i+k-1} and targets
t_{i+k+1} = y_{i+k}, which the window holds for i < T - k only: the last
k positions of each sequence are masked out of depth k's loss
(``depth_tokens``), as Megatron-core does, so depth k counts B (T - k)
tokens per batch.

Loss: L = L_main + (weight / D) sum_k L_k, each L a sum of per-token
cross-entropies divided by ITS OWN token count over the whole global
batch (every data and context rank, every micro-batch), passed in: a
count taken on one rank is the bug of Megatron #2417/#1532/#7452.

Shapes: B rows, T positions, C hidden size (local share of it under a
split hidden: ``allsum`` then sums the norms' statistics).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..device.arrays import array_module, identity
from .llama import rmsnorm_backward, rmsnorm_forward


def depth_tokens(targets, depth: int):
    """targets y (B, T) of a window -> (ids (B, T), depth_targets (B, T),
    valid (B, T) bool) for MTP depth k = ``depth`` >= 1: ids_i = y_{i+k-1}
    (the token whose embedding enters depth k), depth_targets_i = y_{i+k};
    positions i >= T - k are not valid (their ids and targets are 0)."""
    xp = array_module(targets)
    B, T = targets.shape
    ids = xp.zeros_like(targets)                                      # (B, T)
    tgt = xp.zeros_like(targets)                                      # (B, T)
    valid = xp.zeros((B, T), dtype=bool)                              # (B, T)
    if depth < T:
        ids[:, :T - depth] = targets[:, depth - 1:T - 1]
        tgt[:, :T - depth] = targets[:, depth:]
        valid[:, :T - depth] = True
    return ids, tgt, valid


@dataclass
class MtpInputTape:
    """What ``input_forward`` keeps for backward: both norms' statistics."""
    emb_norm: tuple      # RMSNorm cache of the embedding (xhat (B, T, C), rstd (B, T, 1))
    hid_norm: tuple      # RMSNorm cache of the previous depth's hidden state


def input_forward(hidden, emb, w_hnorm, w_enorm, n_hidden: int, eps: float, allsum=identity):
    """hidden h^{k-1} (B, T, C), emb Emb(t_{i+k}) (B, T, C), the norms'
    weights (C,) -> (u (B, T, 2C) = [RMSNorm_e(emb) | RMSNorm_h(hidden)],
    the projection's input, MtpInputTape)."""
    xp = array_module(hidden)
    e, e_cache = rmsnorm_forward(emb, w_enorm, n_hidden, eps, allsum)          # (B, T, C)
    h, h_cache = rmsnorm_forward(hidden, w_hnorm, n_hidden, eps, allsum)       # (B, T, C)
    return xp.concatenate([e, h], axis=-1), MtpInputTape(e_cache, h_cache)


def input_backward(du, tape: MtpInputTape, w_hnorm, w_enorm, dw_hnorm, dw_enorm, n_hidden: int, allsum=identity):
    """du (B, T, 2C) -> (dhidden (B, T, C), demb (B, T, C)); adds into the
    norms' weight gradients dw_hnorm, dw_enorm (C,)."""
    C = du.shape[-1] // 2
    demb = rmsnorm_backward(du[..., :C], tape.emb_norm, w_enorm, dw_enorm, n_hidden, allsum)   # (B, T, C)
    dhid = rmsnorm_backward(du[..., C:], tape.hid_norm, w_hnorm, dw_hnorm, n_hidden, allsum)   # (B, T, C)
    return dhid, demb


def project_forward(u, w_proj):
    """u (B, T, 2C) @ W (2C, C) -> (B, T, C): the serial projection (a layout
    shards W as its linears do)."""
    return u @ w_proj


def project_backward(dy, u, w_proj, dw_proj):
    """dy (B, T, C) -> du (B, T, 2C); adds u^T dy into dw_proj (2C, C)."""
    C2 = u.shape[-1]
    dw_proj += u.reshape(-1, C2).T @ dy.reshape(-1, dy.shape[-1])
    return dy @ w_proj.T


def combine_losses(main_sum, depth_sums, main_count, depth_counts, weight: float):
    """The training loss from per-token cross-entropy SUMS: main_sum over
    the main head's tokens, depth_sums[k-1] over depth k's valid tokens
    (this rank's or the global batch's: the counts make it global), and
    the GLOBAL token counts main_count and depth_counts[k-1] -> (loss,
    depth_losses [L_k], scales): loss = main_sum / main_count + (weight /
    D) sum_k depth_sums[k-1] / depth_counts[k-1]; scales[0] multiplies the
    main cross-entropy's backward, scales[k] depth k's (dL / d sum)."""
    D = len(depth_sums)
    main_scale = 1.0 / main_count
    depth_scales = [weight / (D * n) for n in depth_counts]
    depth_losses = [s / n for s, n in zip(depth_sums, depth_counts)]
    loss = main_sum * main_scale + sum(s * c for s, c in zip(depth_sums, depth_scales))
    return loss, depth_losses, [main_scale] + depth_scales
