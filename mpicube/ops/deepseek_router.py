"""DeepSeekMoE's router (DeepSeek-V3): sigmoid scores, bias-steered
group-limited top-k, the sequence-wise auxiliary loss and the
aux-loss-free bias update, as local forward/backward pairs with no
communication (a sum over ranks arrives as ``allsum``; loads arrive
already summed).

Routing, per token (n tokens, E experts in G groups of E/G, top K of the
best Kg groups):

* scores s = sigmoid(logits) (n, E), in the logits' format (float32 or
  wider; float64 runs stay float64);
* choice scores c = s + bias (the per-expert ``e_score_correction_bias``,
  which steers the choice and nothing else);
* a group's score is the sum of its two best choice scores; the Kg best
  groups stay, the others' experts are excluded; the top K of the
  remaining choice scores are chosen;
* weights w_k = s_k (WITHOUT the bias) / (sum_j s_j + 1e-20) over the K
  chosen (``norm_topk``; transformers adds the same 1e-20, below float64's
  resolution of any sum of sigmoids of a real model), times
  ``routed_scaling_factor``.

Tie-breaks (documented because they decide which expert computes): every
selection is a stable sort descending, so an equal score goes to the
LOWER index: of two experts in a group for the group's two best, of two
groups for the kept groups, of two experts for the top K. ``chosen``
lists each token's experts in descending choice score. torch.topk leaves
ties unspecified, so transformers agrees with this wherever there are
none (the comparison tests use random scores).

Sequence-wise auxiliary loss (DeepSeek-V3 report, eq. 17-20), per
sequence of T tokens: L = coef sum_e f_e P_e, f_e = E / (K T) times the
number of the sequence's tokens that chose e, P_e = the mean over the
sequence of s'_e = s_e / sum_j s_j (the scores normalised over all E
experts, without bias). f counts choices (no gradient); the gradient
reaches the logits through P only. The loss of a batch is the mean over
its sequences (the caller passes the global sequence count).

Aux-loss-free balancing: after each step, bias_e += rate * sign(mean
load - load_e), the loads counted over the whole global batch (the
caller sums them over every data, context and expert rank and every
micro-batch first). ``centred`` subtracts the update's mean (torchtitan's
variant), so the biases keep a zero sum; the default is the report's
rule, not centred, because that is what DeepSeek-V3's published biases
were trained with and what the report specifies.

Shapes: n tokens, E experts, G groups, K chosen per token.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..device.arrays import array_module, identity

NORM_EPS = 1e-20   # transformers' DeepseekV3TopkRouter adds it to the top-k sum


def sigmoid(x):
    """x (...) -> 1 / (1 + exp(-x)), without overflow for large |x|."""
    xp = array_module(x)
    e = xp.exp(-xp.abs(x))                                           # (...) in (0, 1]
    return xp.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def top_indices(values, k: int):
    """values (n, m) -> (n, k) column indices of each row's k largest, in
    descending order, ties to the lower index (a stable sort of -values)."""
    return array_module(values).argsort(-values, axis=-1, kind="stable")[:, :k]


def group_limited_topk(choice, top_k: int, n_groups: int, topk_groups: int):
    """choice (n, E) choice scores (scores + bias) -> chosen (n, K) expert
    indices: the top K among the experts of the ``topk_groups`` groups
    whose two best choice scores sum highest (all groups when n_groups is
    1). Ties to the lower index at every step (the module's docstring)."""
    xp = array_module(choice)
    n, E = choice.shape
    if n_groups > 1 and topk_groups < n_groups:
        per = E // n_groups
        grouped = choice.reshape(n, n_groups, per)                        # (n, G, E/G)
        best2 = xp.sort(grouped, axis=-1)[..., -2:].sum(axis=-1)          # (n, G) sum of each group's two best
        kept = top_indices(best2, topk_groups)                            # (n, Kg)
        allowed = xp.zeros((n, n_groups), dtype=bool)                     # (n, G)
        allowed[xp.arange(n)[:, None], kept] = True
        allowed = xp.repeat(allowed, per, axis=1)                         # (n, E)
        choice = xp.where(allowed, choice, -xp.inf)                       # (n, E) excluded groups never chosen
    return top_indices(choice, top_k)


@dataclass
class RouteTape:
    """What ``route`` keeps for backward."""
    scores: object       # (n, E) sigmoid scores
    chosen: object       # (n, K)
    weights: object      # (n, K) final weights (normalised, scaled)
    denom: object        # (n, 1) sum of the chosen scores + 1e-20, or None without norm_topk
    scaling: float


def route(logits, bias, top_k: int, n_groups: int = 1, topk_groups: int = 1, norm_topk: bool = True,
          scaling: float = 1.0):
    """logits (n, E) float32+, bias (E,) or None -> (scores (n, E), chosen
    (n, K), weights (n, K), RouteTape). The bias only steers the choice; it
    is added in the scores' format (transformers: float32 + float32)."""
    xp = array_module(logits)
    scores = sigmoid(logits)                                              # (n, E)
    choice = scores if bias is None else scores + bias.astype(scores.dtype)   # (n, E)
    chosen = group_limited_topk(choice, top_k, n_groups, topk_groups)     # (n, K)
    s_sel = scores[xp.arange(scores.shape[0])[:, None], chosen]           # (n, K) without the bias
    denom = s_sel.sum(axis=-1, keepdims=True) + NORM_EPS if norm_topk else None   # (n, 1)
    weights = (s_sel / denom if norm_topk else s_sel) * scaling           # (n, K)
    return scores, chosen, weights, RouteTape(scores, chosen, weights, denom, scaling)


def route_backward(dweights, tape: RouteTape, dscores_all=None):
    """dweights (n, K) (the loss through the chosen experts' outputs) ->
    dlogits (n, E); ``dscores_all`` (n, E) adds a gradient on every score
    (the auxiliary loss's, ``seq_aux_backward``)."""
    xp = array_module(dweights)
    scores, chosen = tape.scores, tape.chosen
    dsel = dweights * tape.scaling                                        # (n, K) d (unscaled weights)
    if tape.denom is not None:     # u_k = s_k / d, d = sum_j s_j + eps: ds_k = (du_k - sum_j du_j u_j) / d
        u = tape.weights / tape.scaling                                   # (n, K)
        dsel = (dsel - (dsel * u).sum(axis=-1, keepdims=True)) / tape.denom
    dscores = xp.zeros_like(scores) if dscores_all is None else dscores_all.astype(scores.dtype, copy=True)
    dscores[xp.arange(scores.shape[0])[:, None], chosen] += dsel          # a row's K columns are distinct
    return dscores * scores * (1.0 - scores)                              # sigmoid' = s (1 - s)


def expert_loads(chosen, n_experts: int):
    """chosen (n, K) -> (E,) how many of the tokens chose each expert (the
    bias update's and the auxiliary loss's counts, before any capacity)."""
    return array_module(chosen).bincount(chosen.reshape(-1), minlength=n_experts)


# --- the sequence-wise auxiliary loss ------------------------------------------
def seq_aux_forward(scores, chosen, coef: float, seq_len: int, n_seqs: int, allsum=identity):
    """scores (B, T, E) sigmoid scores of B whole or partial sequences (T of
    their ``seq_len`` tokens here: under context parallelism ``allsum``
    sums a sequence's counts and score sums over its chunks), chosen (B, T, K)
    -> (loss: this rank's share of coef * sum_b sum_e f_be P_be / n_seqs
    over the ``n_seqs`` sequences of the global batch, tape). Every rank
    holding a chunk of a sequence returns the same value for it: the
    caller adds the shares of distinct sequences, once each."""
    xp = array_module(scores)
    B, T, E = scores.shape
    K = chosen.shape[-1]
    flat = (xp.arange(B)[:, None, None] * E + chosen).reshape(-1)          # (B T K) row-major (sequence, expert)
    counts = xp.bincount(flat, minlength=B * E).reshape(B, E).astype(scores.dtype)   # (B, E) choices per sequence
    total = scores.sum(axis=-1, keepdims=True)                            # (B, T, 1)
    normed = scores / total                                               # (B, T, E) s'
    counts, p_sum = allsum(xp.stack([counts, normed.sum(axis=1)]))        # (B, E) each, whole sequences
    f = counts * (E / (K * seq_len))                                      # (B, E)
    P = p_sum / seq_len                                                   # (B, E)
    loss = coef * (f * P).sum() / n_seqs
    return loss, (normed, total, f, coef, seq_len, n_seqs)


def seq_aux_backward(dloss, tape):
    """d loss -> dscores (B, T, E) for this rank's tokens (route_backward's
    ``dscores_all``, reshaped to (n, E))."""
    normed, total, f, coef, seq_len, n_seqs = tape
    dnormed = (dloss * coef / (n_seqs * seq_len)) * f[:, None, :]         # (B, T, E) d s'
    # s'_e = s_e / sum_j s_j: ds_e = (ds'_e - sum_j ds'_j s'_j) / sum_j s_j
    return (dnormed - (dnormed * normed).sum(axis=-1, keepdims=True)) / total


# --- aux-loss-free balancing ---------------------------------------------------
def bias_update(bias, loads, rate: float, centred: bool = False):
    """bias (E,), loads (E,) tokens each expert received over the whole
    global batch -> the new bias (E,), bias + rate * sign(mean(loads) -
    loads): an overloaded expert's bias falls, an underloaded one's rises,
    an expert exactly at the mean keeps its bias. ``centred`` subtracts the
    update's mean first (torchtitan), keeping sum(bias) unchanged. A pure
    function of the loads; the arithmetic runs in float64 and the result
    keeps the bias's format."""
    xp = array_module(bias)
    loads = loads.astype("float64")
    delta = rate * xp.sign(loads.mean() - loads)                          # (E,)
    if centred:
        delta = delta - delta.mean()
    return (bias.astype("float64") + delta).astype(bias.dtype)
