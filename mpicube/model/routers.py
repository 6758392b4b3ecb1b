"""The two routers a mixture of experts (``moe.MoE``) can have, one object
chosen once from the configuration (``router_of``), so the mixture never
asks which it runs:

* ``SoftmaxRouter`` (``--router softmax``, Mixtral's): softmax over the
  logits, the top k, their probabilities (renormalised under norm_topk);
  the load-balancing and z-losses through the micro-batch's ledger
  (``router.RouterLedger``);
* ``SigmoidRouter`` (``--router sigmoid``, DeepSeek-V3's): sigmoid scores,
  the top k chosen on score + a per-expert bias among the best
  ``topk_groups`` of ``n_groups`` groups, weights from the scores without
  the bias normalised over the top k and times ``routed_scaling_factor``
  (``ops.deepseek_router``); the bias is a persistent buffer of the store
  (not a parameter: no gradient, no weight decay, no optimizer state),
  moved after each optimizer step by ``balance`` from the loads of the
  whole global batch; and the optional sequence-wise auxiliary loss.

Both take logits (n, E) and give the chosen experts (n, K), their
weights (n, K) and a tape; backward takes the weights' gradient (n, K)
and gives the logits' (n, E), with whatever the router's losses add.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.config import ModelConfig
from ..device import precision
from ..ops import deepseek_router as sigmoid_ops
from ..ops import moe as softmax_ops
from .tape import Saved


class SoftmaxRouter:
    """Mixtral's router (ops.moe.route); the ledger's statistics are the
    probabilities' sums and log-sum-exps (the load-balancing and z-losses)."""

    def __init__(self, cfg: ModelConfig, layer: int):
        self.cfg, self.layer = cfg, layer

    def route(self, logits, ctx=None):
        """logits (n, E) -> (chosen (n, K), weights (n, K), tape)."""
        probs, chosen, weights, lse, tape = softmax_ops.route(logits, self.cfg.top_k, self.cfg.norm_topk)
        return chosen, weights, tape

    def record(self, ledger, counts, tape, dropped) -> None:
        """Layer statistics into the micro-batch's ledger (counts (E,) before any drop)."""
        ledger.record(self.layer, counts, tape[0], tape[4], dropped)

    def weights_of(self, tape):
        return tape[2]                                                   # (n, K)

    def backward(self, dweights, tape, ledger):
        """dweights (n, K) -> dlogits (n, E), the ledger's losses added."""
        dprobs = dlse = None
        if ledger is not None:
            dprobs, dlse = ledger.dprobs(), ledger.dlse(tape[4])
        return softmax_ops.route_backward(dweights, tape, dprobs, dlse)


@dataclass
class SigmoidTape(Saved):
    """What ``SigmoidRouter`` keeps for backward (``tape.saved_buffers`` counts its arrays)."""

    scores: object          # (n, E) sigmoid scores
    chosen: object          # (n, K)
    weights: object         # (n, K) final weights
    denom: object           # (n, 1) the top-k sum + 1e-20, or None without norm_topk
    scaling: float
    seq_aux: object         # the sequence-wise loss's (normed (B, T, E), sums (B, T, 1), f (B, E), ...), or None
    share: float            # this rank's share of that loss (0 without it)

    def route_tape(self):
        return sigmoid_ops.RouteTape(self.scores, self.chosen, self.weights, self.denom, self.scaling)


class SigmoidRouter:
    """DeepSeek-V3's router over a bias buffer ``h.{i}.moe.router.score_bias``
    (E,) registered in ``store.persistent``: whole on every rank, written to
    checkpoints by one rank of each replica's tensor group, read back
    bitwise. The ledger records its counts (the bias update's loads) and
    its scores' sums in the places Mixtral's statistics take (its own
    losses are off: core.config refuses them under this router).

    The sequence-wise auxiliary loss (``seq_aux_loss_coef``): per sequence,
    coef sum_e f_e P_e (ops.deepseek_router), the mean over the global
    batch's sequences, summed over layers, divided by --grad-accum like the
    other router losses. A sequence's tokens are on this rank, or spread
    over the cp ring (its chunks: their counts and score sums are summed
    over the ring first); only cp rank 0 adds the value to the ledger, so
    the ledger's sum over the ring counts it once."""

    def __init__(self, cfg: ModelConfig, layer: int, store, layout, name: str):
        self.cfg, self.layer, self.name = cfg, layer, name
        self.ring = layout.axes.cp if layout.axes.cp is not None and layout.axes.cp.size > 1 else None
        if name not in store.persistent:
            xp = store.backend.xp
            dtype = precision.compute_dtype(store.backend.dtype)         # float32, float64 in float64 runs
            tp = layout.axes.tp
            store.persist(name, xp.zeros(cfg.n_experts, dtype=dtype), writer=tp is None or tp.rank == 0)
        self.store = store

    @property
    def bias(self):
        """(E,) the choice bias (the store's buffer: a checkpoint read replaces it)."""
        return self.store.persistent[self.name]

    def route(self, logits, ctx=None):
        cfg = self.cfg
        scores, chosen, weights, tape = sigmoid_ops.route(logits, self.bias, cfg.top_k, cfg.n_groups, cfg.topk_groups,
                                                          cfg.norm_topk, cfg.routed_scaling_factor)
        aux, share = None, 0.0
        ledger = getattr(ctx, "router", None)
        if cfg.seq_aux_loss_coef and ledger is not None:
            share, aux = self._seq_aux(scores, chosen, ledger)
        return chosen, weights, SigmoidTape(scores, chosen, weights, tape.denom, tape.scaling, aux, share)

    def _seq_aux(self, scores, chosen, ledger):
        """(loss share, tape) of the sequence-wise auxiliary loss on this
        rank's sequences (the whole micro-batch's sequences in its mean)."""
        T = ledger.seq_len
        Tl = T // (self.ring.size if self.ring is not None else 1)          # this rank's positions of each
        n, E = scores.shape
        B = n // Tl
        n_seqs = ledger.micro_tokens // T                                 # the micro-batch's, every replica's
        allsum = (lambda a: self.ring.allreduce(a)) if self.ring is not None else (lambda a: a)
        loss, tape = sigmoid_ops.seq_aux_forward(scores.reshape(B, Tl, E), chosen.reshape(B, Tl, -1),
                                                 self.cfg.seq_aux_loss_coef, T, n_seqs, allsum)
        if self.ring is not None and self.ring.rank != 0:
            loss = 0.0                                                    # the ring's sum counts it once
        return float(loss), tape

    def record(self, ledger, counts, tape, dropped) -> None:
        """Counts (the loads), the scores' sums, and in the z-loss's place
        this rank's share of the sequence-wise auxiliary loss."""
        ledger.record(self.layer, counts, tape.scores, None, dropped, z_sum=tape.share)

    def weights_of(self, tape):
        return tape.weights                                               # (n, K)

    def backward(self, dweights, tape, ledger):
        aux = tape.seq_aux
        dscores = None
        if aux is not None:
            normed = aux[0]
            B, Tl, E = normed.shape
            scale = ledger.scale / ledger.grad_accum
            dscores = sigmoid_ops.seq_aux_backward(scale, aux).reshape(B * Tl, E)   # (n, E)
        return sigmoid_ops.route_backward(dweights, tape.route_tape(), dscores)


def balance(store, cfg: ModelConfig, loads: dict) -> None:
    """The aux-loss-free bias update, after an optimizer step: ``loads``
    {layer: (E,) tokens that chose each expert over the whole global batch,
    every replica and micro-batch} -> each sigmoid router's bias held in
    ``store`` (a pipeline stage: its own layers') moves by rate sign(mean -
    load), less its mean under ``centred`` (ops.deepseek_router.bias_update).
    Every rank computes the same from the same sums, so the biases stay
    equal everywhere without a message."""
    if cfg.router != "sigmoid" or not cfg.bias_update_rate:
        return
    for layer, load in loads.items():
        name = f"h.{layer}.moe.router.score_bias"
        if name in store.persistent:
            bias = store.persistent[name]
            bias[...] = sigmoid_ops.bias_update(bias, store.backend.asarray(load), cfg.bias_update_rate,
                                                cfg.bias_update == "centred")


def router_of(cfg: ModelConfig, layer: int, store, layout, prefix: str):
    """Layer ``layer``'s router, by ``cfg.router`` (the one place that asks)."""
    if cfg.router == "sigmoid":
        return SigmoidRouter(cfg, layer, store, layout, prefix + "router.score_bias")
    return SoftmaxRouter(cfg, layer)
