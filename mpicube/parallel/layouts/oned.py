"""1-D tensor parallelism (Megatron-LM) over p ranks.

Activations between blocks are replicated on every rank. The first linear of
each pair is split by columns (so attention heads split p ways), the second
by rows; the row-split output is all-reduced in forward and the input
gradient of the column-split linear is all-reduced in backward. The tied
embedding and LM head are split by vocabulary: the lookup is all-reduced,
and the cross-entropy reduces its max, sum of exponentials and target logit.

``--recompute gathers`` keeps the replicated inputs of the column-parallel
linears and of the LM head as a 1/p row shard (``RowShard``), all-gathered
again in backward; ``--recompute blocks`` keeps each block's (replicated)
input the same way. Both need the B_dp*T token rows to split p ways.

``--sequence-parallel`` (``sequence_parallel=True``, ``seqpar.py``): the
canonical form is a shard along the sequence instead, (B, T/p, C) with
positions [t T/p, (t+1) T/p) on rank t, and each all-reduce splits into an
all-gather before the column-parallel linear and a reduce-scatter after the
row-parallel one (T divisible by p). Under --recompute gathers a
column-parallel linear and the head keep their T/p shard and gather it
again in backward; under --recompute blocks a block's input is its shard.

Overlap (on unless the plan's ``overlap`` is off): a column-parallel linear's backward
starts the all-reduce of dX nonblocking and computes dW meanwhile.
"""

from __future__ import annotations

import numpy as np

from ...core.errors import ConfigError
from ..fp8 import Splits
from ..params import ParamDecl, ParamSpec, full_index, split_index
import math

from .base import COLUMN, REPLICATED, Layout, check_head_split, nearest_multiples
from .modules import DenseLinear, RowShard, replicated_linear
from .seqpar import SeqLinear, SeqTiedEmbedding
from .serial import DenseTiedEmbedding


class OneDLayout(Layout):
    name = "1d"

    @classmethod
    def validate(cls, cfg, tp, local_batch, depth, recompute="none"):
        cls.require(cfg.n_head % tp == 0,
                    f"n_head {cfg.n_head} must be divisible by the tensor-parallel size {tp} "
                    f"(heads are split {tp} ways): use n_head {nearest_multiples(cfg.n_head, tp)}")
        check_head_split(cfg, tp)
        if recompute != "none":       # replicated activations are kept as row shards
            step = tp // math.gcd(tp, cfg.n_ctx)      # sequences per replica must be a multiple of this
            cls.require(local_batch * cfg.n_ctx % tp == 0,
                        f"--recompute {recompute} keeps 1/{tp} of the {local_batch} x {cfg.n_ctx} token rows "
                        f"per replica, which must be divisible by {tp}: use a batch size per replica of "
                        f"{nearest_multiples(local_batch, step)}")

    @classmethod
    def head_coords(cls, tp, depth, rank):
        return tp, rank, 0                              # heads split over all p ranks

    @classmethod
    def validate_sequence(cls, cfg, tp, T, recompute="none"):
        """--sequence-parallel: every sequence splits into tp runs of T/tp positions."""
        if T % tp:
            raise ConfigError(f"--sequence-parallel splits each sequence of {T} positions over the {tp} "
                              f"tensor-parallel ranks: use a sequence length (--seq-len) of "
                              f"{nearest_multiples(T, tp)}, or a tensor-parallel size dividing {T}")

    def __init__(self, cfg, axes, batch_size, depth=1, recompute="none", sequence_parallel=False, **settings):
        super().__init__(cfg, axes, batch_size, recompute=recompute, **settings)
        p, t = axes.tp.size, axes.tp.rank
        self.p, self.t = p, t
        self.sequence_parallel = sequence_parallel and p > 1
        self.sequence_comm = axes.tp if self.sequence_parallel else None
        self.head_comm = axes.tp if p > 1 else None        # every rank the same rows, its own heads
        self.row_shard = RowShard(axes.tp)
        self.vocab_padded = self.pad_to(cfg.vocab_size, p)
        self.canonical_seqs = np.arange(self.local_batch)
        self.mid_seqs = self.canonical_seqs
        self.canonical_cols = np.arange(cfg.n_embd)
        self.place_heads(depth)

    def shard(self, decl: ParamDecl) -> ParamSpec:
        p, t, shape = self.p, self.t, decl.shape
        if decl.role == "wte":
            return ParamSpec(decl, (split_index(self.vocab_padded, p, t), full_index(shape[1])))
        if decl.role == "w_column":
            cols, shared = self.first_columns(decl)
            return ParamSpec(decl, (full_index(shape[0]), cols), shared=shared)
        if decl.role == "b_column":
            cols, shared = self.first_columns(decl)
            return ParamSpec(decl, (cols,), shared=shared)
        if decl.role == "w_row":
            return ParamSpec(decl, (split_index(shape[0], p, t), full_index(shape[1])))
        if decl.role == "w_replicated":   # the same canonical block on every rank, unless the sequence is split
            return self.replicated_spec(decl, shared=self.sequence_parallel)
        full = tuple(full_index(n) for n in shape)
        if self.sequence_parallel and decl.role in ("wpe", "norm"):   # partial sums from this rank's positions
            return ParamSpec(decl, full, grad_comm=self.axes.tp, replicas=p, writer=(t == 0))
        # wpe, norm, b_row: replicated, and every rank computes the whole gradient
        return ParamSpec(decl, full, replicas=p, writer=(t == 0))

    def seq_positions(self, T: int):
        """(T/p,) the global positions of this rank's canonical rows, or None (all T)."""
        if not self.sequence_parallel:
            return None
        if T % self.p:
            raise ConfigError(f"--sequence-parallel: sequence length {T} must be divisible by the "
                              f"tensor-parallel size {self.p}: use {nearest_multiples(T, self.p)}")
        n = T // self.p
        return np.arange(self.t * n, (self.t + 1) * n)

    def fp8_splits(self, store, prefix, kind):
        """--fp8: a column-parallel linear's W and dy columns are split over
        tp, a row-parallel one's x columns and W rows."""
        tp = self.axes.tp
        splits = Splits(w_cols=tp, dy_cols=tp) if kind == COLUMN else Splits(x_cols=tp, w_rows=tp)
        return self.fp8_linear(store, prefix, splits)

    def linear(self, store, prefix, kind, bias=True):
        if kind == REPLICATED:       # x's canonical rows (T/p of them under --sequence-parallel) times all of W
            return replicated_linear(self, store, prefix, bias)
        position = kind
        fp8 = self.fp8_splits(store, prefix, position)
        if self.sequence_parallel:
            return SeqLinear(store, prefix, self.axes.tp, position, overlap=self.overlap,
                             regather=self.recompute == "gathers", bias=bias, fp8=fp8)
        if position == COLUMN and self.recompute == "gathers":   # its replicated input kept as a row shard
            return DenseLinear(store, prefix, dx_reduce=self.axes.tp, shard=self.row_shard, overlap=self.overlap,
                               bias=bias, fp8=fp8)
        if position == COLUMN:   # column-parallel
            return DenseLinear(store, prefix, dx_reduce=self.axes.tp, overlap=self.overlap, bias=bias, fp8=fp8)
        return DenseLinear(store, prefix, out_reduce=self.axes.tp, bias=bias, fp8=fp8)   # row-parallel

    def expert_linear(self, store, prefix, position):
        """An expert's linear (``Layout.expert_linear``). Under
        --sequence-parallel the mixture has gathered the whole sequences
        and will reduce-scatter its output (model/moe.py), so c_fc is
        column-split without the dX sum and c_proj row-split without the
        output sum: partial sums over tp, summed once for all experts.
        Under --recompute gathers the column-split input is kept as a row
        shard (the rows padded to a multiple of p: ``expert_rows``)."""
        if not self.sequence_parallel:
            return self.linear(store, prefix, position, bias=False)
        keep = self.row_shard if position == COLUMN and self.recompute == "gathers" else None
        return DenseLinear(store, prefix, shard=keep, bias=False, fp8=self.fp8_splits(store, prefix, position))

    def expert_rows(self, held):
        """``Layout.expert_rows``: every collective of an expert's linears
        joins the tp ranks, which hold the same tokens, so an empty expert
        is skipped; under --recompute gathers an expert's replicated input
        rows are kept as 1/p row shards (``RowShard``), so its rows are
        padded with zero rows to a multiple of p (exact: a bias-free SwiGLU
        maps a zero row to a zero row and adds nothing to its gradients)."""
        if self.recompute != "gathers" or self.p == 1:
            return held, self.fp8_every()
        return -(-held // self.p) * self.p, self.fp8_every()

    def tied_embedding(self, store, name="wte"):
        if self.sequence_parallel:
            return SeqTiedEmbedding(store, self, vocab_comm=self.axes.tp,
                                    vocab_start=self.t * self.vocab_padded // self.p,
                                    regather=self.recompute == "gathers", name=name)
        return DenseTiedEmbedding(store, self, vocab_comm=self.axes.tp,
                                  vocab_start=self.t * self.vocab_padded // self.p,
                                  shard=self.row_shard if self.recompute == "gathers" else None, name=name)

    def save_block_input(self, x):
        if self.sequence_parallel:
            return x                                 # (B, T/p, h): already this rank's share
        return self.row_shard.keep(x)                # (n/p, C) rows and x's shape

    def load_block_input(self, saved):
        if self.sequence_parallel:
            return saved
        return self.row_shard.restore(saved)         # (B, T, h)

    def describe(self):
        return {**super().describe(), "p": self.p,
                **({"sequence_parallel": True} if self.sequence_parallel else {})}
