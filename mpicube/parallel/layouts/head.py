"""The LM head and its cross-entropy, as a layout supplies them.

Why the layout owns the loss: the vocabulary-parallel softmax needs the
reductions of the layout's vocabulary split (max, sum of exponentials and
the target's logit over ``vocab_comm``), and only the rows ``logit_seqs``
the layout's head holds; ``row_replicas`` ranks hold the same rows. The
model calls ``forward`` and ``backward`` and never sees a communicator.
"""

from __future__ import annotations

from ... import ops


class LossHead:
    """logits = x @ wte^T on the layout's tied embedding (``embedding``),
    then the mean cross-entropy's share of this rank. ``forward`` returns
    the sum of this rank's row losses divided by ``row_replicas`` (a (1,)
    float64 array on the device): summed over every rank of the model it
    is the step's total, which the step driver divides by the token count."""

    def __init__(self, embedding, vocab_size: int, xp):
        self.embedding, self.vocab_size, self.xp = embedding, vocab_size, xp
        comm = embedding.vocab_comm
        self.allmax = (lambda a: comm.allreduce(a, "max")) if comm is not None else ops.identity
        self.allsum = comm.allreduce if comm is not None else ops.identity

    def forward(self, x, targets, panel, n_tokens: int, valid=None, weight: float = 1.0):
        """x (B_c, T, C_c) final-normed activations, targets (B_dp, T) global
        ids -> (loss share (1,), saved). ``valid`` (B_dp, T) bool, when
        given, keeps only those positions' losses (a multi-token prediction
        depth: its last positions have no target); backward then takes the
        gradient of ``weight`` x (sum of the kept losses) / ``n_tokens``."""
        xp, emb = self.xp, self.embedding
        logits, s_logits = emb.logits(x, panel)                             # (B_l, T, V_l)
        rows = xp.asarray(emb.logit_seqs)
        tgt = xp.asarray(targets)[rows].reshape(-1)                          # (B_l*T,)
        row_loss, s_ce = ops.cross_entropy_forward(logits.reshape(-1, logits.shape[-1]), tgt, emb.vocab_start,
                                                   self.vocab_size, self.allmax, self.allsum)
        keep = None
        if valid is not None:
            keep = xp.asarray(valid)[rows].reshape(-1).astype(row_loss.dtype)   # (B_l*T,) 1 or 0
            row_loss = row_loss * keep
        share = row_loss.sum(dtype=xp.float64).reshape(1) / emb.row_replicas  # (1,) on the device
        return share, (logits, s_logits, s_ce, n_tokens, keep, weight)

    def backward(self, loss_scale: float, saved, panel):
        """The gradient of loss_scale x (the step's mean loss) with respect
        to x (B_c, T, C_c); adds into wte's gradient."""
        logits, s_logits, s_ce, n_tokens, keep, weight = saved
        scale = loss_scale / n_tokens if keep is None else loss_scale * weight / n_tokens
        dlogits = ops.cross_entropy_backward(scale, s_ce)                   # (B_l*T, V_l)
        if keep is not None:
            dlogits *= keep[:, None].astype(dlogits.dtype)
        return self.embedding.logits_backward(dlogits.reshape(logits.shape), s_logits, panel)
