"""DeepSeek-V3's multi-token prediction modules (``--mtp-depth D``) as the
model runs them: the local math is ``ops.mtp``'s, this strings it to the
layout's pieces (norms, a replicated projection, a block, the shared
embedding and LM head).

Depth k = 1 .. D at position i (docs/deepseek.md):

    u = [RMSNorm_e(Emb(t_{i+k})) | RMSNorm_h(h^{k-1}_i)]       (B, T, 2C)
    h^k_i = RMSNorm_k( Block_{L+k-1}(u @ W_k) )                (B, T, C)
    L_k = CE(h^k_i @ head^T, t_{i+k+1}) over i < T - k

h^0 is the main model's state AFTER its final norm: what transformers'
``MtpLayer`` drafts from (``hidden_states[-1]``, which it sets to the
normed state) and what megatron-core's decoder hands its MTP block (the
decoder ends with its final layernorm); each depth's output, after its
own norm (HF's ``shared_head.norm``), is both what its head reads and
the next depth's h^{k-1}, as in both. Emb is the main model's token
embedding and the head its LM head, shared (not copies): their gradients
from every depth add into the same buffers.

Where the pieces sit: the depths run on the chunk with the head (a
pipeline's last stage). Their blocks are named ``h.{n_layer + k - 1}``
(HF's ``model.layers.{L + k - 1}``), so a block is streamed, recomputed,
routed and bias-updated as any other; the depth's own tensors are
``mtp.{k-1}.{enorm,hnorm,proj,ln_f}.weight``. Under a pipeline the last
stage holds a copy of ``wte`` for the lookup, summed with stage 0's over
the tied pair as a tied embedding is (training.pipeline.stage_specs).

Loss: each depth's cross-entropy sum is divided by ITS global token
count, B (T - k) summed over every replica and micro-batch of the step
(``Micro.mtp_counts``, from the global batch's shape, never a count
taken on one rank: Megatron #2417, #1532).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..core.config import ModelConfig
from ..ops import mtp as mtp_ops
from ..parallel.layouts.modules import ReplicatedLinear
from ..parallel.paramspec import ParamDecl
from .tape import Saved

MTP_OWN = ("enorm.weight", "hnorm.weight", "proj.weight", "ln_f.weight")   # a depth's tensors besides its block


def mtp_blocks(cfg: ModelConfig) -> range:
    """The block indices of the MTP depths: n_layer .. n_layer + D - 1."""
    return range(cfg.n_layer, cfg.n_layer + cfg.mtp_depth)


def own_params(cfg: ModelConfig, j: int, std: float) -> list:
    """Depth j + 1's norms, its projection W (2C, C) (the replicated kind:
    every tp rank holds it whole) and its output norm."""
    h, p = cfg.n_embd, f"mtp.{j}."
    return [ParamDecl(p + "enorm.weight", (h,), "norm", "ones"),
            ParamDecl(p + "hnorm.weight", (h,), "norm", "ones"),
            ParamDecl(p + "proj.weight", (2 * h, h), "w_replicated", "normal", std, decay=True),
            ParamDecl(p + "ln_f.weight", (h,), "norm", "ones")]


def depth_inputs(cfg: ModelConfig, targets, cut=None):
    """The per-depth token arrays of a micro-batch: targets (B_dp, T) whole
    sequences, ``cut`` (T_l,) the global positions this rank keeps (cp) or
    None -> tuple of (ids, depth targets, valid) (B_dp, T_l) each
    (``ops.mtp.depth_tokens``, cut after the shift: position i's token
    t_{i+k} may sit in another cp rank's chunk)."""
    out = []
    for k in range(1, cfg.mtp_depth + 1):
        ids, tgt, valid = mtp_ops.depth_tokens(np.asarray(targets), k)              # (B_dp, T) each
        if cut is not None:
            ids, tgt, valid = ids[:, cut], tgt[:, cut], valid[:, cut]               # (B_dp, T_l)
        out.append((ids, tgt, valid))
    return tuple(out)


def depth_counts(cfg: ModelConfig, seqs: int, T: int) -> tuple:
    """Depth k's GLOBAL token count: ``seqs`` sequences (the step's, every
    replica and micro-batch) of T positions, the last k of each without a
    target."""
    return tuple(seqs * max(T - k, 0) for k in range(1, cfg.mtp_depth + 1))


def loss_terms(cfg: ModelConfig, sums, n_tokens: int, counts: tuple):
    """sums (1 + D,) host float64: the main cross-entropy sum and each
    depth's, over the world -> (loss, main loss, [L_k]): loss = main +
    (W / D) sum_k L_k (``ops.mtp.combine_losses``)."""
    main = float(sums[0]) / n_tokens
    if not cfg.mtp_depth:
        return main, main, []
    loss, depth_losses, _ = mtp_ops.combine_losses(float(sums[0]), [float(s) for s in sums[1:]], n_tokens,
                                                   list(counts), cfg.mtp_loss_weight)
    return loss, main, depth_losses


@dataclass
class DepthTape(Saved):
    """What one depth keeps for backward."""

    lookup: object          # the embedding lookup's (its local rows)
    emb_norm: object        # RMSNorm_e's (xhat, 1/rms); fields of their own, not ops.mtp.MtpInputTape,
    hid_norm: object        # so that ``tape.saved_buffers`` counts them (it walks Saved records)
    u_emb: object           # (B_c, T, C_c) RMSNorm_e(emb): the projection's input, embedding half
    u_hid: object           # (B_c, T, C_c) RMSNorm_h(h): the other half
    block: object           # the block's tape
    ln: object              # the output norm's
    loss: object            # the loss head's


class MtpDepth:
    """Depth j + 1 on one rank's share of the layout: its norms (split over
    the hidden group as every norm), the projection as two REPLICATED
    linears over W's two row blocks (embedding rows 0..C, hidden rows
    C..2C: this rank's canonical columns' rows of each, summed over the
    hidden group), which give every output column, of which the rank keeps
    its canonical ones; then the block, its norm and the shared head."""

    def __init__(self, layout, store, j: int, block, family, loss_head):
        cfg = layout.cfg
        p = f"mtp.{j}."
        self.j, self.block, self.loss = j, block, loss_head
        self.enorm = family.norm(store, p + "enorm", layout)
        self.hnorm = family.norm(store, p + "hnorm", layout)
        self.ln_f = family.norm(store, p + "ln_f", layout)
        cols = layout.canonical_cols
        lo, hi = int(cols[0]), int(cols[-1]) + 1                    # this rank's contiguous hidden block
        self.cols = slice(lo, hi)
        self.proj_emb = ReplicatedLinear(store, p + "proj", slice(lo, hi), layout.hidden_comm)
        self.proj_hid = ReplicatedLinear(store, p + "proj", slice(cfg.n_embd + lo, cfg.n_embd + hi),
                                         layout.hidden_comm)
        self.hidden = layout.hidden_comm if layout.hidden_comm is not None and layout.hidden_comm.size > 1 else None
        self.xp = layout.backend.xp

    def forward(self, h, emb_lookup, panels, ctx, ids, targets, valid, count: int, weight: float):
        """h (B_c, T, C_c) the previous depth's state -> (h^k (B_c, T, C_c),
        this rank's cross-entropy sum over valid rows (1,), DepthTape)."""
        emb, s_lookup = emb_lookup(ids)                                            # (B_c, T, C_c)
        e, s_e = self.enorm.forward(emb)                                           # (B_c, T, C_c)
        g, s_h = self.hnorm.forward(h)                                             # (B_c, T, C_c)
        y = self.proj_emb.forward(e)[0] + self.proj_hid.forward(g)[0]              # (B_c, T, C) every column
        x = self.xp.ascontiguousarray(y[..., self.cols])                           # (B_c, T, C_c)
        z, s_block = self.block.forward(x, ctx)                                    # (B_c, T, C_c)
        out, s_ln = self.ln_f.forward(z)                                           # (B_c, T, C_c)
        share, s_loss = self.loss.forward(out, targets, panels, count, valid=valid, weight=weight)
        tape = DepthTape(s_lookup, s_e, s_h, e, g, s_block, s_ln, s_loss)
        return out, share, tape

    def backward(self, dout, loss_scale: float, tape: DepthTape, panels, lookup_backward):
        """dout (B_c, T, C_c): the next depth's gradient of h^k (or None)
        -> the gradient of h^{k-1} (B_c, T, C_c); adds into every weight
        and, through ``lookup_backward``, the embedding."""
        d = self.loss.backward(loss_scale, tape.loss, panels)                     # (B_c, T, C_c)
        if dout is not None:
            d = d + dout
        dz = self.ln_f.backward(d, tape.ln)                                        # (B_c, T, C_c)
        dx = self.block.backward(dz, tape.block)                                   # (B_c, T, C_c)
        dy = self.xp.zeros(dx.shape[:-1] + (self.proj_emb.w.shape[1],), dtype=dx.dtype)   # (B_c, T, C)
        dy[..., self.cols] = dx
        if self.hidden is not None:        # every column's gradient on every rank of the hidden group
            dy = self.hidden.allreduce(dy)
        de = self.proj_emb.backward(dy, tape.u_emb)                               # (B_c, T, C_c)
        dg = self.proj_hid.backward(dy, tape.u_hid)                               # (B_c, T, C_c)
        lookup_backward(self.enorm.backward(de, tape.emb_norm), tape.lookup)
        return self.hnorm.backward(dg, tape.hid_norm)                       # (B_c, T, C_c)


class MultiTokenPrediction:
    """The D depths on the chunk with the head, run by ``gpt.Head`` right
    after the main loss: ``forward`` takes the main model's final-normed
    state and returns each depth's cross-entropy share (D,); ``backward``
    returns the gradient of that state. ``blocks`` are the depths' blocks
    as the model holds them (``GPT.blocks`` continues into them: a
    recompute wrapper or an observer wraps them alike); ``first_site`` is
    the index of depth 1's block among the chunk's streamed sites."""

    def __init__(self, layout, store, family, embedding, loss_head, blocks: list, first_site: int):
        self.cfg, self.xp, self.embedding = layout.cfg, layout.backend.xp, embedding
        self.blocks, self.first_site = blocks, first_site
        self.depths = [MtpDepth(layout, store, j, None, family, loss_head) for j in range(layout.cfg.mtp_depth)]
        self.resident = None                   # the store's stream of this pass (set by GPT before the head)

    def _sync_blocks(self):
        for depth, block in zip(self.depths, self.blocks):
            depth.block = block

    def forward(self, h, tape, panels):
        """h (B_c, T, C_c) -> (shares (D,) this rank's cross-entropy sum per
        depth, divided by the head's row replicas; [DepthTape])."""
        self._sync_blocks()
        ctx, cfg = tape.ctx, self.cfg
        weight = cfg.mtp_loss_weight / cfg.mtp_depth
        lookup = lambda ids: self.embedding.embed(self.xp.asarray(ids), tape.panel)   # noqa: E731
        shares, tapes = [], []
        for j, depth in enumerate(self.depths):
            ids, tgt, valid = ctx.mtp[j]                                       # (B_dp, T_l) each
            self.resident.enter(self.first_site + j)
            h, share, saved = depth.forward(h, lookup, panels, ctx, ids, tgt, valid, ctx.mtp_counts[j], weight)
            self.resident.leave(self.first_site + j)
            shares.append(share)
            tapes.append(saved)
        return self.xp.concatenate(shares), tapes                             # (D,)

    def backward(self, loss_scale: float, tapes: list, tape, panels):
        """-> the gradient of the main model's final-normed state (B_c, T, C_c)."""
        self._sync_blocks()
        back = lambda dx, s: self.embedding.embed_backward(dx, s, tape.panel)   # noqa: E731
        d = None
        for j in reversed(range(len(self.depths))):
            self.resident.enter(self.first_site + j)
            d = self.depths[j].backward(d, loss_scale, tapes[j], panels, back)
            self.resident.leave(self.first_site + j)
        return d
