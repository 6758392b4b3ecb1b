"""Sequence parallelism for the 1-D layout (``--sequence-parallel``).

The canonical form becomes a shard along the sequence: tp rank t holds the
positions [t T/p, (t+1) T/p) of every sequence of its replica, all C
columns, (B, T/p, C). LayerNorms, dropout and residual adds run on that
shard, so what they keep is 1/p of the plain 1-D layout's. The Megatron
all-reduces split into their halves along T:

* the replicated input of a column-parallel linear is all-gathered
  (B, T/p, C) -> (B, T, C); in backward its partial dX is reduce-scattered;
* the partial output of a row-parallel linear is reduce-scattered
  (B, T, C) -> (B, T/p, C); in backward its dY is all-gathered;
* the vocabulary-split lookup is reduce-scattered instead of all-reduced
  (its dX all-gathered in backward), and the LM head all-gathers its input
  (its dX reduce-scattered).

An all-gather plus a reduce-scatter of n elements move what one all-reduce
of n moves (ring counts: (g-1)/g n each), so the bytes are the plain
layout's. A row-parallel bias gradient is summed from the gathered dY (so
it is complete on every rank, as before); LayerNorm weights and wpe get
partial gradients from their rows and are summed over tp once per step
(``ParamSpec.grad_comm``).
"""

from __future__ import annotations

from ... import ops
from ...device import precision
from .base import COLUMN, acc, add_bias, add_bias_grad, bias_views, matmul_rows
from .serial import DenseTiedEmbedding

SEQ = 1                    # the axis of (B, T, C) the shards split


class SeqLinear:
    """A 1-D linear under sequence parallelism. ``position`` COLUMN
    (column-parallel): forward all-gathers x along T and keeps the gathered
    x for dW; backward reduce-scatters dX (nonblocking with ``overlap``,
    while dW is computed). ROW (row-parallel): forward reduce-scatters
    the partial output before the bias; backward all-gathers dY."""

    def __init__(self, store, prefix: str, comm, position: str, overlap: bool = False, regather: bool = False,
                 bias: bool = True, fp8=None):
        self.w = store.work[prefix + ".weight"]       # (C_in, C_out/p) or (C_in/p, C_out)
        self.fp8 = fp8                                # --fp8: each GEMM's quantized operands (parallel/fp8.py)
        self.b, self.db = bias_views(store, prefix, bias)
        self.store, self.w_name = store, prefix + ".weight"
        store.defer_zero(self.w_name)
        self.comm, self.first, self.overlap = comm, position == COLUMN, overlap
        self.regather = regather and self.first     # --recompute gathers: keep the shard, gather it again

    def forward(self, x):
        """first: x (B, T/p, C) -> (B, T, C_m); second: x (B, T, C_m) -> (B, T/p, C).
        Returns (y, saved): the input x for dW (its T/p shard under regather)."""
        if self.first:
            shard, x = x, self.comm.allgather(x, axis=SEQ)   # (B, T/p, C), (B, T, C)
            xg, w = self.operands(x)                  # (B, T, C), (C, C_m)
            y = matmul_rows(xg, w, acc(x))            # (B, T, C_m)
            add_bias(y, self.b)
            return precision.narrow(y, x.dtype), (shard if self.regather else x)
        xg, w = self.operands(x)                      # (B, T, C_m), (C_m, C)
        y = self.comm.reduce_scatter(matmul_rows(xg, w, acc(x)), axis=SEQ, wire=x.dtype)   # (B, T/p, C)
        y = y.astype(acc(x), copy=False)
        add_bias(y, self.b)
        return precision.narrow(y, x.dtype), x

    def backward(self, dy, saved):
        """first: dy (B, T, C_m) -> dx (B, T/p, C); second: dy (B, T/p, C) -> dx (B, T, C_m)."""
        if not self.first:
            dy = self.comm.allgather(dy, axis=SEQ)    # (B, T, C)
        x = self.comm.allgather(saved, axis=SEQ) if self.regather else saved   # (B, T, C_in)
        x2 = x.reshape(-1, x.shape[-1])               # (B*T, C_in)
        dy2 = dy.reshape(-1, dy.shape[-1])            # (B*T, C_out)
        dyd, w, xw, dyw = dy, self.w, x2, dy2         # the operands of dgrad (dy, W) and wgrad (x, dy)
        if self.fp8 is not None:
            dyd, w = self.fp8.dgrad(dy, self.w)       # (B, T, C_out), (C_in, C_out)
            xw, dyw = self.fp8.wgrad(x2, dy2)         # (B*T, C_in), (B*T, C_out)
        # dW and db (now, or filed for a zero-bubble schedule's weight phase: parallel/wgrad.py)
        if self.first and self.overlap:               # dX travels while dW and db are computed
            pending = self.comm.ireduce_scatter(matmul_rows(dyd, w.T, acc(dy)), axis=SEQ, wire=dy.dtype)
            self.store.wgrads.add(self.backward_weight, xw, dyw, dy2)
            return precision.narrow(pending.wait(), dy.dtype)
        self.store.wgrads.add(self.backward_weight, xw, dyw, dy2)
        if self.first:
            dx = self.comm.reduce_scatter(matmul_rows(dyd, w.T, acc(dy)), axis=SEQ, wire=dy.dtype)
            dx = precision.narrow(dx, dy.dtype)       # (B, T/p, C)
        else:
            dx = matmul_rows(dyd, w.T)                # (B, T, C_m)
        return dx

    def backward_weight(self, xw, dyw, dy2):
        """dW += x^T dy, db += the column sums of dy (complete: from all T rows)."""
        self.store.add_matmul(self.w_name, xw.T, dyw)
        add_bias_grad(self.db, dy2)

    def operands(self, x):
        """The forward GEMM's (x, W): themselves, or quantized under --fp8."""
        return (x, self.w) if self.fp8 is None else self.fp8.forward(x, self.w)


class SeqTiedEmbedding(DenseTiedEmbedding):
    """The vocabulary-split lookup and LM head of 1-D with a sequence-shard
    canonical form: the lookup's partial rows are reduce-scattered along T,
    the head gathers its input along T (and keeps it for dwte, or under
    --recompute gathers its T/p shard, gathered again in backward)."""

    def __init__(self, store, layout, vocab_comm, vocab_start, regather: bool = False, name="wte"):
        super().__init__(store, layout, vocab_comm=vocab_comm, vocab_start=vocab_start, name=name)
        self.regather = regather

    def embed(self, ids, panel):
        """ids (B, T) -> (x (B, T/p, h), saved)."""
        x, saved = ops.embedding_forward(ids, self.wte, self.vocab_start)   # (B, T, h) partial
        return self.vocab_comm.reduce_scatter(x, axis=SEQ, wire=x.dtype), saved

    def embed_backward(self, dx, saved, panel):
        """dx (B, T/p, h): gathered to every position of the replica's ids."""
        super().embed_backward(self.vocab_comm.allgather(dx, axis=SEQ), saved, panel)   # (B, T, h)

    def logits(self, x, panel):
        """x (B, T/p, h) -> (logits (B, T, V_l), saved: the gathered x, or its shard under regather)."""
        gathered = self.vocab_comm.allgather(x, axis=SEQ)                            # (B, T, h)
        return matmul_rows(gathered, self.wte.T), (x if self.regather else gathered)

    def logits_backward(self, dlogits, saved, panel):
        """dlogits (B, T, V_l) -> dx (B, T/p, h)."""
        x = self.vocab_comm.allgather(saved, axis=SEQ) if self.regather else saved   # (B, T, h)
        x2 = x.reshape(-1, x.shape[-1])                          # (B*T, h)
        dl2 = dlogits.reshape(-1, dlogits.shape[-1])             # (B*T, V_l)
        self.store.add_matmul(self.name, dl2.T, x2)                # dwte (V_l, h) += dlogits^T x
        dx = self.vocab_comm.reduce_scatter(matmul_rows(dlogits, self.wte, acc(dlogits)), axis=SEQ,
                                            wire=dlogits.dtype)  # (B, T/p, h)
        return precision.narrow(dx, dlogits.dtype)
