"""One rank holds everything: the reference every other layout must match."""

from __future__ import annotations

import numpy as np

from ... import ops
from ...device import precision
from ..fp8 import Splits
from ..params import ParamDecl, ParamSpec, full_index
from .base import REPLICATED, Layout, acc, matmul_rows
from .modules import DenseLinear, replicated_linear


class SerialLayout(Layout):
    name = "serial"

    @classmethod
    def validate(cls, cfg, tp, local_batch, depth, recompute="none"):
        cls.require(tp == 1, f"runs on one rank per data-parallel replica, not {tp}; "
                             "use --dp to replicate it or choose a parallel layout")

    def __init__(self, cfg, axes, batch_size, depth=1, recompute="none", **settings):
        super().__init__(cfg, axes, batch_size, recompute=recompute, **settings)
        self.canonical_seqs = np.arange(self.local_batch)
        self.mid_seqs = self.canonical_seqs
        self.canonical_cols = np.arange(cfg.n_embd)
        self.place_heads(depth)                          # all heads (split 1)

    def shard(self, decl: ParamDecl) -> ParamSpec:
        return ParamSpec(decl, tuple(full_index(n) for n in decl.shape))

    def linear(self, store, prefix, kind, bias=True):
        if kind == REPLICATED:
            return replicated_linear(self, store, prefix, bias)
        return DenseLinear(store, prefix, bias=bias, fp8=self.fp8_linear(store, prefix, Splits()))

    def tied_embedding(self, store, name="wte"):
        return DenseTiedEmbedding(store, self, name=name)


class DenseTiedEmbedding:
    """Token embedding and LM head sharing ``wte``, with an optional vocabulary
    split over ``vocab_comm`` (1-D); serial has none. With a ``RowShard``
    (1-D, --recompute gathers) the head keeps a row shard of its replicated
    input and gathers it again in backward."""

    def __init__(self, store, layout, vocab_comm=None, vocab_start=0, shard=None, name="wte"):
        self.name = name                    # "wte", or an untied model's "lm_head"
        self.wte = store.work[name]         # (V_l, h)
        self.store = store
        store.defer_zero(name)             # the head's GEMM writes it first (backward runs head -> lookup)
        self.vocab_comm = vocab_comm
        self.vocab_start = vocab_start
        self.shard = shard
        self.logit_seqs = layout.canonical_seqs
        self.row_replicas = layout.axes.tp.size

    def embed(self, ids, panel):
        """ids (B, T) -> (x (B, T, h), saved). Dense layouts gather nothing: ``panel`` stays empty."""
        x, saved = ops.embedding_forward(ids, self.wte, self.vocab_start)
        if self.vocab_comm is not None:
            x = self.vocab_comm.allreduce(x, wire=x.dtype)
        return x, saved

    def embed_backward(self, dx, saved, panel):
        ops.embedding_backward(dx, saved, self.store.grad_for_add(self.name))

    def logits(self, x, panel):
        """x (B, T, h) -> (logits (B, T, V_l), saved: x or its row shard)."""
        saved = x if self.shard is None else self.shard.keep(x)
        return matmul_rows(x, self.wte.T), saved

    def logits_backward(self, dlogits, saved, panel):
        """dlogits (B, T, V_l) -> dx (B, T, h)."""
        x = saved if self.shard is None else self.shard.restore(saved)   # (B, T, h)
        x2 = x.reshape(-1, x.shape[-1])                         # (B*T, h)
        dl2 = dlogits.reshape(-1, dlogits.shape[-1])            # (B*T, V_l)
        self.store.add_matmul(self.name, dl2.T, x2)                # dwte (V_l, h) += dlogits^T x
        if self.vocab_comm is None:
            return matmul_rows(dlogits, self.wte)                # (B, T, h)
        # partial sums over the vocabulary split
        dx = self.vocab_comm.allreduce(matmul_rows(dlogits, self.wte, acc(dlogits)), wire=dlogits.dtype)
        return precision.narrow(dx, dlogits.dtype)

    def finish_backward(self, panel):
        """Nothing gathered, nothing to reduce."""
