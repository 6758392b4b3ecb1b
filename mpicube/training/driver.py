"""The seam between the model and the axes: build a GPT for a layout, cut
each micro-batch to this rank's positions, run it, reduce its loss.

The model (``mpicube.model``) knows the layout protocol and nothing of the
axes around it. What the axes need happens here, once, for every entry
point (training, evaluation, benchmarks, traces, tests):

* ``build_gpt`` asks the layout for the linears, the tied embedding and the
  loss head (inside ``GPT``), chooses the attention (blockwise, the T x T
  reference, or a ring over the context-parallel ranks) and wraps blocks
  for ``--recompute blocks``;
* ``micro_context`` cuts a micro-batch's tokens and targets to the
  positions this rank holds (a context-parallel rank's two chunks; under
  ``--sequence-parallel`` the ids stay those of the tp group and the
  positions are the canonical rows', a run of them: ``rank_positions``)
  and makes the ``Micro`` the model is given;
* ``Runner`` runs a whole model one micro-batch at a time and holds the
  micro-batch's tape between its forward and backward; the loss shares of
  every rank are summed over the world (a pipeline sums its last stage's
  once per step instead: ``training.pipeline``).
"""

from __future__ import annotations

import numpy as np

from .. import ops
from ..ops import attention_blocks
from ..model.block import Dropout, Recomputed
from ..model import mtp
from ..model.gpt import GPT, Head
from ..model.router import RouterLedger
from ..model.tape import Micro, saved_buffers
from ..parallel import context
from ..parallel.ulysses import UlyssesAttention

def attention_for(layout):
    """The attention op pair a block calls: a ring over the cp ranks when
    the sequence is split, else blockwise (O(T) kept per head) or, when
    the plan's attention is "full", the op that holds T x T (the
    reference; the memory model counts blockwise only)."""
    axes = layout.axes
    if axes.cp_group is not None:        # --cp-kind ulysses or hybrid
        return UlyssesAttention(axes.cp_group, axes.cp_ring)
    if axes.cp.size > 1:
        return context.RingAttention(axes.cp)
    return ops if layout.attention_kind == "full" else attention_blocks


def build_gpt(cfg, layout, store, *, dropout: float = 0.0, seed: int = 0, grad_accum: int = 1,
              layers: range = None, first: bool = True, last: bool = True) -> GPT:
    """The GPT (or pipeline chunk ``layers``, with its ends when ``first``
    and ``last``) on ``layout``, its blocks wrapped for ``--recompute
    blocks`` when the layout asks."""
    model = GPT(cfg, layout, store, attention_for(layout), Dropout(dropout, seed, layout, grad_accum),
                layers=layers, first=first, last=last)
    if layout.recompute == "blocks":
        model.blocks = [Recomputed(block, layout) for block in model.blocks]
    return model


def make_runner(cfg, layout, store, *, dropout: float = 0.0, seed: int = 0, grad_accum: int = 1) -> "Runner":
    """``build_gpt``'s whole model, run by a ``Runner``."""
    return Runner(build_gpt(cfg, layout, store, dropout=dropout, seed=seed, grad_accum=grad_accum), layout,
                  grad_accum)


def rank_positions(layout, T: int):
    """(T_c,) the global positions of the canonical rows this rank holds of
    a T-long sequence, or None when it holds all T in order.

    Context parallelism gives the cp rank two chunks of every sequence
    (``context.local_positions``: T/cp positions, chunk r then chunk
    2C-1-r); sequence parallelism then gives each tp rank one run of
    whatever its replica's tp group holds (``layout.seq_positions`` of
    that length: run t of T_cp/tp). Composed, tp rank t holds run t of
    its cp rank's positions, so an all-gather along T over tp (what the
    sequence-parallel linears do) restores exactly the cp rank's rows, in
    the order the ring attention expects."""
    ring = layout.axes.cp
    pos = context.local_positions(T, ring.size, ring.rank, context.ulysses_of(ring)) if ring.size > 1 else None   # (T/cp,) or all T
    run = layout.seq_positions(T if pos is None else len(pos))     # (T_cp/tp,) indices into those, or None
    if run is None:
        return pos
    return run if pos is None else pos[run]


def canonical_length(layout, T: int) -> int:
    """Rows of a T-long sequence in this rank's canonical activation (what
    a pipeline stage sends and receives): T / (cp x tp) under both axes."""
    pos = rank_positions(layout, T)
    return T if pos is None else len(pos)


def micro_context(layout, idx, targets, step: int, micro: int, grad_accum: int, train: bool = True):
    """idx, targets (B_dp, T): this replica's rows of micro-batch ``micro``.
    Returns (idx, targets, Micro): the ids and targets cut to the positions
    of this rank's cp rank (B_dp, T/cp; all T without cp: under
    --sequence-parallel the lookup and the head gather their own rows
    over tp) and the micro-batch's context, whose positions are the
    canonical rows' (``rank_positions``)."""
    T = idx.shape[1]
    n_tokens = layout.batch_size * grad_accum * T                  # N, global, of the whole step
    cfg = layout.cfg
    depths = mtp.depth_inputs(cfg, targets) if cfg.mtp_depth and targets is not None else ()
    ring = layout.axes.cp
    cut = None
    if ring.size > 1:                       # this rank's two chunks of every sequence (parallel.context)
        cut = context.local_positions(T, ring.size, ring.rank, context.ulysses_of(ring))   # (T/cp,) global positions
        idx = np.asarray(idx)[:, cut]
        targets = None if targets is None else np.asarray(targets)[:, cut]
        depths = tuple(tuple(a[:, cut] for a in depth) for depth in depths)   # shifted first, then cut
    pos = rank_positions(layout, T)
    # a mixture of experts' router losses and capacity count the micro-batch's tokens over the dp replicas
    # (and the tp ranks with other sequences, the cp ranks with other positions)
    ledger = (RouterLedger(layout.cfg, layout.axes.dp, layout.batch_size * T, grad_accum, tokens=layout.token_comm,
                           ring=layout.axes.cp, seq_len=T) if layout.cfg.moe else None)
    counts = mtp.depth_counts(cfg, layout.batch_size * grad_accum, T)   # each depth's, global, of the whole step
    return idx, targets, Micro(step=step, micro=micro, positions=pos, gathered=cut, n_tokens=n_tokens, train=train,
                               router=ledger, mtp=depths, mtp_counts=counts)


class Runner:
    """A whole model on this rank, one micro-batch at a time: ``forward``
    returns the micro-batch's share of the step's mean loss (the same on
    every rank), ``backward`` adds its gradients. Holds the tape between
    the two; ``train`` False runs without dropout (evaluation)."""

    def __init__(self, model: GPT, layout, grad_accum: int = 1, train: bool = True):
        self.model, self.layout, self.grad_accum, self.train = model, layout, grad_accum, train
        self.tape = None
        self.logits = None                   # the last forward's logits (B_l, T, V_l), until its backward
        self.router_log = RouterLog(layout.backend.to_host)   # a mixture of experts' statistics since the last take()
        self.mtp_log = MtpLog()                  # multi-token prediction's losses since the last take()
        # --recompute blocks: the most one rerun block held during the last backward (elements, bytes)
        self.recompute_peak_elements = self.recompute_peak_bytes = 0
        for block in model.blocks if train else []:     # an evaluation runs no backward: no rerun to watch
            if isinstance(block, Recomputed):
                block.probe = self._rebuilt

    def evaluation(self) -> "Runner":
        """The same model without dropout (the blocks' rerun probe stays with
        this, the training runner)."""
        return Runner(self.model, self.layout, self.grad_accum, train=False)

    def forward(self, idx, targets, step: int = 0, micro: int = 0) -> float:
        """The micro-batch's share of the step's loss: with MTP, main + (W /
        D) sum_k L_k, each over its global count (``mtp.loss_terms``; the
        parts go to ``mtp_log``); evaluation's is the main loss alone."""
        idx, targets, ctx = micro_context(self.layout, idx, targets, step, micro, self.grad_accum, self.train)
        share, self.tape = self.model.forward(idx, targets, ctx)            # (1,) or (1 + D,) with MTP
        self.logits = Head.logits(self.tape)
        sums = self.layout.backend.to_host(self.layout.axes.world.allreduce(share))
        loss, main, depths = mtp.loss_terms(self.layout.cfg, sums, ctx.n_tokens, ctx.mtp_counts)
        if depths and self.train:
            self.mtp_log.add(main, depths)
        if not self.train:                   # evaluation: the model's cross-entropy, the MTP depths left out
            loss = main
        if ctx.router is not None:           # the router losses, summed over the replicas before any backward
            router_loss = ctx.router.finish()
            if self.train:
                self.router_log.add(ctx.router)
                loss += router_loss
        return loss

    def backward(self, loss_scale: float = 1.0) -> None:
        self.recompute_peak_elements = self.recompute_peak_bytes = 0
        tape, self.tape, self.logits = self.tape, None, None
        if tape.ctx.router is not None:
            tape.ctx.router.scale = loss_scale
        self.model.backward(loss_scale, tape)

    def _rebuilt(self, saved) -> None:
        buffers = saved_buffers(saved, self.model.store.buffers())
        self.recompute_peak_elements = max(self.recompute_peak_elements, sum(b.size for b in buffers))
        self.recompute_peak_bytes = max(self.recompute_peak_bytes, sum(b.nbytes for b in buffers))

    # --- what the held tape keeps (the memory the cost model predicts) -------------------
    def saved_elements(self) -> int:
        """Floating-point elements this rank holds for backward right after
        forward: activations, gathered weight panels, dropout masks, read
        off the tape (each buffer once, parameters excluded). Under
        --recompute blocks, backward holds one rerun block's on top:
        ``recompute_peak_elements``."""
        return sum(b.size for b in saved_buffers(self.tape, self.model.store.buffers()))

    def saved_bytes(self) -> int:
        return sum(b.nbytes for b in saved_buffers(self.tape, self.model.store.buffers()))

    # --- the model's own views ---------------------------------------------------------
    @property
    def embedding(self):
        return self.model.embedding

    @property
    def blocks(self):
        return self.model.blocks

    def new_caches(self, positions: int = None) -> list:
        return self.model.new_caches(positions)

    def decode(self, idx, pos: int, caches: list):
        return self.model.decode(idx, pos, caches)

    def full_logits(self, idx):
        """The training forward's logits (B_l, T, V_l) of idx (B_dp, T), no dropout."""
        return last_logits(self.model, *micro_context(self.layout, idx, np.zeros(idx.shape, dtype=np.int64),
                                                      0, 0, 1, train=False))


def last_logits(model: GPT, inputs, targets, ctx: Micro):
    """Forward ``model`` (a chunk with the head) and return the logits its
    head computed (B_l, T, V_l), read off the tape."""
    return Head.logits(model.forward(inputs, targets, ctx)[1])


class RouterLog:
    """A mixture of experts' per-step record for metrics.jsonl: the
    load-balancing and z-losses (means over the step's micro-batches),
    tokens per expert per layer and dropped choices, summed over the
    step's micro-batches; ``take`` returns it and starts afresh."""

    def __init__(self, to_host):
        self.ledgers, self.to_host = [], to_host
        self.loads = {}             # the last take's {layer: (E,) tokens per expert} (the bias update's)

    def add(self, ledger) -> None:
        self.ledgers.append(ledger)

    def take_ledgers(self) -> list:
        """The ledgers of the micro-batches since the last take (and forget them)."""
        ledgers, self.ledgers = self.ledgers, []
        return ledgers

    def take(self) -> dict:
        ledgers = self.take_ledgers()
        if not ledgers:
            return {}
        n = len(ledgers)
        counts = sum(self.to_host(led.counts()).astype(np.float64) for led in ledgers)      # (L_here, E)
        dropped = sum(self.to_host(led.dropped()).astype(np.float64) for led in ledgers)    # (L_here,)
        self.loads = {layer: counts[r] for r, layer in enumerate(ledgers[0].layers)}       # every micro-batch's
        extra = {}
        if ledgers[0].cfg.router == "sigmoid":
            extra["seq_aux_loss"] = sum(led.seq_aux_loss() for led in ledgers) / n
        return {**extra, "router_aux_loss": sum(led.aux_loss() for led in ledgers) / n,
                "router_z_loss": sum(led.z_loss() for led in ledgers) / n,
                "expert_tokens": [[int(round(c)) for c in row] for row in counts.tolist()],
                "expert_dropped": [int(round(d)) for d in dropped.tolist()]}


class MtpLog:
    """Multi-token prediction's per-step record for metrics.jsonl: the
    main cross-entropy and each depth's (``mtp_loss_{k}``), summed over
    the step's micro-batches (each already divided by the step's count,
    so the sum is the step's); ``take`` returns it and starts afresh."""

    def __init__(self):
        self.main, self.depths = 0.0, []

    def add(self, main: float, depths: list) -> None:
        self.main += main
        self.depths = [a + b for a, b in zip(self.depths, depths)] if self.depths else list(depths)

    def take(self) -> dict:
        if not self.depths:
            return {}
        out = {"main_loss": self.main, **{f"mtp_loss_{k}": v for k, v in enumerate(self.depths, start=1)}}
        self.main, self.depths = 0.0, []
        return out
