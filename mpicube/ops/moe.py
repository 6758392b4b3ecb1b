"""The mixture of experts' local ops: the router's softmax and top-k, the
weights of the chosen experts and their backward, and the dispatch order
(which token goes to which expert, and which a capacity drops). No
communication: a sum over replicas arrives as an argument (counts of the
ranks before this one, ``offset``), so the same ops serve every layout.

Numerics (docs/moe.md):

* the router's logits arrive in float32 or wider and the softmax runs in
  their format (float64 runs stay float64; transformers' Mixtral rounds to
  float32 here, which the tests widen for their 1e-9 comparison);
* top-k ties go to the lower expert index: the order is a stable sort of
  the probabilities, descending;
* Mixtral's weights are the chosen probabilities renormalised to sum to 1
  (``norm_topk``); without it (Qwen's ``norm_topk_prob`` false) they are
  the probabilities themselves;
* dispatch sorts the (token, choice) entries by expert, stably, so each
  expert's tokens come in token order; under a capacity, an expert keeps
  its first ``capacity`` choosers in the micro-batch's global token order
  (``offset`` counts the choosers on the ranks before this one) and drops
  the rest: a dropped choice contributes nothing (the token keeps its
  residual), and the kept weights are not renormalised.

Shapes: n tokens (rows), E experts, K chosen per token.
"""

from __future__ import annotations

import math

from ..device.arrays import array_module


def route(logits, top_k: int, norm_topk: bool):
    """logits (n, E) float32+ -> (probs (n, E), chosen (n, K), weights (n, K), lse (n,), saved)."""
    xp = array_module(logits)
    m = logits.max(axis=-1, keepdims=True)                            # (n, 1)
    e = xp.exp(logits - m)                                            # (n, E)
    s = e.sum(axis=-1, keepdims=True)                                 # (n, 1)
    probs = e / s                                                     # (n, E)
    lse = (m + xp.log(s))[:, 0]                                       # (n,) log-sum-exp, for the z-loss
    chosen = xp.argsort(-probs, axis=-1, kind="stable")[:, :top_k]   # (n, K): ties to the lower index
    rows = xp.arange(probs.shape[0])[:, None]                         # (n, 1)
    p_sel = probs[rows, chosen]                                       # (n, K)
    denom = p_sel.sum(axis=-1, keepdims=True) if norm_topk else None  # (n, 1)
    weights = p_sel / denom if norm_topk else p_sel                   # (n, K)
    return probs, chosen, weights, lse, (probs, chosen, weights, denom, lse)


def route_backward(dweights, saved, dprobs_all=None, dlse=None):
    """The router's logits' gradient (n, E) from dweights (n, K) (the loss
    through the chosen experts' weights), plus ``dprobs_all`` (E,), a
    gradient on every probability of every row (the load-balancing loss),
    and ``dlse`` (n,), a gradient on each row's log-sum-exp (the z-loss)."""
    xp = array_module(dweights)
    probs, chosen, weights, denom, lse = saved
    if denom is not None:                   # w_k = p_k / s, s = sum_j p_j: dp_k = (dw_k - sum_j dw_j w_j) / s
        dp_sel = (dweights - (dweights * weights).sum(axis=-1, keepdims=True)) / denom   # (n, K)
    else:
        dp_sel = dweights
    dprobs = xp.zeros_like(probs)                                     # (n, E)
    dprobs[xp.arange(probs.shape[0])[:, None], chosen] = dp_sel       # each row's K chosen columns are distinct
    if dprobs_all is not None:
        dprobs += dprobs_all
    dlogits = probs * (dprobs - (dprobs * probs).sum(axis=-1, keepdims=True))   # the softmax's Jacobian
    if dlse is not None:
        dlogits += dlse[:, None] * probs                              # d lse / d logits = probs
    return dlogits


def capacity(factor: float, top_k: int, n_tokens: int, n_experts: int) -> int:
    """Tokens an expert computes at most: ceil(F K N / E) over the
    micro-batch's N tokens (every replica's), or N (no limit) for F = 0."""
    if not factor:
        return n_tokens
    return int(math.ceil(factor * top_k * n_tokens / n_experts))


def dispatch(chosen, n_experts: int, cap: int = None, offset=None, place=None):
    """Which entry goes where: chosen (n, K) -> (order (m,), expert (m,),
    counts (E,)). ``order`` lists the kept (token, choice) entries as flat
    indices into (n, K), grouped by expert (ascending) and in token order
    inside each; ``expert`` is each one's expert; ``counts`` how many each
    expert chose before any drop (the load-balancing loss counts these).
    With ``cap``, an expert keeps an entry only if fewer than ``cap`` of
    its choosers come before it in the global token order: ``offset`` (E,)
    of them on the ranks before this one, the rest here; under --cp the
    ring's tokens interleave, so ``place`` (n K,) gives each entry's place
    among its expert's choosers of the ring (``RouterLedger.ring_places``)."""
    xp = array_module(chosen)
    flat = chosen.reshape(-1)                                         # (n K,) token-major
    order = xp.argsort(flat, kind="stable")                          # (n K,) by expert, then token
    expert = flat[order]                                              # (n K,)
    counts = xp.bincount(flat, minlength=n_experts)                   # (E,)
    if cap is None:
        return order, expert, counts
    starts = xp.cumsum(counts) - counts                               # (E,) each expert's first entry
    rank = xp.arange(flat.shape[0]) - starts[expert] if place is None else place[order]   # (n K,)
    if offset is not None:
        rank = rank + offset[expert]
    keep = rank < cap
    return order[keep], expert[keep], counts
