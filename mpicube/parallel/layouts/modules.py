"""The modules every layout builds from, beside its own linears: the dense
linear with Megatron's two all-reduce hooks (``DenseLinear``, serial's and
1-D's), the replicated linear every layout returns for that kind
(``ReplicatedLinear``), a replicated activation kept as a row shard (``RowShard``, 1-D's
``--recompute gathers``), a micro-batch's gathered embedding weight
(``Panel``, which the model's tapes hold) and the norms over a hidden size
that may be split (``LayerNorm``, ``RMSNorm``; a model family picks one,
``model/families``).

They follow the GEMM and precision conventions of ``base`` (``matmul_rows``,
``acc``, the bias helpers): compute with the store's working copy, add into
its float32 gradients, round to the activation format once.
"""

from __future__ import annotations

import numpy as np

from ... import ops
from ...device import precision
from ..comm import Comm
from ..comm_start import iallreduce
from ..fp8 import OperandIndex, Splits
from ..params import ParamStore
from .base import acc, add_bias, add_bias_grad, bias_views, matmul_rows


class RowShard:
    """A replicated activation kept as this rank's 1/p of its rows and
    all-gathered over ``comm`` when backward needs it again (1-D's
    ``--recompute``). The kept part is a copy: a view would hold on to
    the whole array."""

    def __init__(self, comm: Comm):
        self.comm = comm

    def keep(self, x):
        """x (..., C), the same on every rank of comm -> (rows (n/p, C), x's shape)."""
        p, r = self.comm.size, self.comm.rank
        if p == 1:
            return x, x.shape
        x2 = x.reshape(-1, x.shape[-1])                  # (n, C)
        if x2.shape[0] % p:
            raise ValueError(f"{x2.shape[0]} rows cannot be split {p} ways")
        n = x2.shape[0] // p
        return x2[r * n:(r + 1) * n].copy(), x.shape     # (n/p, C)

    def restore(self, kept):
        """The whole x (..., C) back from ``keep``'s result."""
        part, shape = kept
        return self.comm.allgather(part, axis=0).reshape(shape)


class DenseLinear:
    """y = x @ W + b on local blocks, with the two Megatron hooks: an
    all-reduce of the output before the bias (row-parallel) and an all-reduce
    of the input gradient (column-parallel). Serial uses neither. With a
    ``RowShard`` (1-D column-parallel under ``--recompute gathers``) the
    replicated input is kept as a row shard and gathered again in backward.
    With ``overlap``, backward starts the all-reduce of dX before the dW
    GEMM and waits for it after (the same operations, reordered: dX and dW
    do not depend on each other)."""

    def __init__(self, store: ParamStore, prefix: str, out_reduce: Comm = None, dx_reduce: Comm = None,
                 shard: RowShard = None, overlap: bool = False, bias: bool = True, fp8=None):
        self.w = store.work[prefix + ".weight"]       # (C_in, C_out)
        self.b, self.db = bias_views(store, prefix, bias)   # (C_out,) or None
        self.store, self.w_name = store, prefix + ".weight"
        store.defer_zero(self.w_name)                 # dW is written by add_matmul
        self.out_reduce = out_reduce
        self.dx_reduce = dx_reduce
        self.shard = shard
        self.overlap = overlap and dx_reduce is not None
        self.fp8 = fp8                                # --fp8: each GEMM's quantized operands (parallel/fp8.py)

    def forward(self, x):
        """x (B, T, C_in) -> (y (B, T, C_out), saved: x, or its row shard)."""
        saved = x if self.shard is None else self.shard.keep(x)
        xg, w = (x, self.w) if self.fp8 is None else self.fp8.forward(x, self.w)   # (B, T, C_in), (C_in, C_out)
        y = matmul_rows(xg, w, acc(x))                # (B, T, C_out)
        if self.out_reduce is not None:
            y = self.out_reduce.allreduce(y, wire=x.dtype)
        add_bias(y, self.b)
        return precision.narrow(y, x.dtype), saved

    def backward(self, dy, saved):
        """dy (B, T, C_out) -> dx (B, T, C_in)."""
        x = saved if self.shard is None else self.shard.restore(saved)   # (B, T, C_in)
        x2 = x.reshape(-1, x.shape[-1])               # (B*T, C_in)
        dy2 = dy.reshape(-1, dy.shape[-1])            # (B*T, C_out)
        dyd, w, xw, dyw = dy, self.w, x2, dy2         # the operands of dgrad (dy, W) and wgrad (x, dy)
        if self.fp8 is not None:
            dyd, w = self.fp8.dgrad(dy, self.w)       # (B, T, C_out), (C_in, C_out)
            xw, dyw = self.fp8.wgrad(x2, dy2)         # (B*T, C_in), (B*T, C_out)
        # dW and db (now, or filed for a zero-bubble schedule's weight phase: parallel/wgrad.py)
        if self.overlap:                              # dX travels while dW and db are computed
            pending = iallreduce(self.dx_reduce, matmul_rows(dyd, w.T, acc(dy)), wire=dy.dtype)  # (B, T, C_in)
            self.store.wgrads.add(self.backward_weight, xw, dyw, dy2)
            return precision.narrow(pending.wait(), dy.dtype)
        self.store.wgrads.add(self.backward_weight, xw, dyw, dy2)
        if self.dx_reduce is not None:
            dx = self.dx_reduce.allreduce(matmul_rows(dyd, w.T, acc(dy)), wire=dy.dtype)   # (B, T, C_in)
            dx = precision.narrow(dx, dy.dtype)
        else:
            dx = matmul_rows(dyd, w.T)                # (B, T, C_in)
        return dx

    def backward_weight(self, xw, dyw, dy2):
        """dW (C_in, C_out) += x^T dy and db += the column sums of dy: the
        weight phase, from the operands the input phase kept."""
        self.store.add_matmul(self.w_name, xw.T, dyw)
        add_bias_grad(self.db, dy2)


class ReplicatedLinear:
    """y = x @ W for a small weight W (C_in, C_out) that every tensor-parallel
    rank holds whole (the REPLICATED kind, megatron-core's duplicated linear;
    MLA's low-rank latent projections): canonical x (B_c, T, C_c) in, y
    (B_c, T, C_out) out, every output column, for this rank's canonical rows.
    Where the canonical form splits the hidden size over ``hidden`` (2-D,
    2.5-D, 3-D), this rank multiplies by its columns' rows ``W[rows]`` and
    the partial products are all-reduced over ``hidden``. Backward: dy must
    be complete on every rank holding the rows; dx = dy W[rows]^T needs no
    sum, and dW[rows] += x^T dy is this rank's canonical block's share,
    summed over the ranks holding the others by the layout's ParamSpec
    (``Layout.replicated_spec``: the tensor-parallel group where the
    blocks differ, nothing on serial and 1-D, where every rank's is whole).
    No bias, no overlap.

    Under --fp8 (``fp8``, a ``LinearFp8``) every rank quantizes the whole W
    it holds, for each GEMM, and keeps its rows: the serial model's values
    with no reduction and no tile to straddle; x's and dy's rows and
    scales are reduced where their pieces lie (``Splits``)."""

    def __init__(self, store: ParamStore, prefix: str, rows: slice, hidden: Comm = None, fp8=None):
        self.whole = store.work[prefix + ".weight"]             # (C_in, C_out)
        self.rows = rows
        self.w = self.whole[rows]                               # (C_c, C_out) view of the whole (C_in, C_out)
        self.dw = store.grad[prefix + ".weight"][rows]          # (C_c, C_out) its gradient's rows
        self.hidden = hidden if hidden is not None and hidden.size > 1 else None
        self.wgrads = store.wgrads                              # dW now, or filed (parallel/wgrad.py)
        self.fp8 = fp8

    def forward(self, x):
        """x (B_c, T, C_c) -> (y (B_c, T, C_out), saved: x)."""
        xq, w = x, self.w                                       # (B_c, T, C_c), (C_c, C_out)
        if self.fp8 is not None:
            xq = self.fp8.oriented(x, "x", "forward")
            w = self.fp8.oriented(self.whole, "w", "forward")[self.rows]
        y = matmul_rows(xq, w, acc(x))                          # (B_c, T, C_out) partial over the hidden split
        if self.hidden is not None:
            y = self.hidden.allreduce(y, wire=x.dtype)
        return precision.narrow(y, x.dtype), x

    def backward(self, dy, x):
        """dy (B_c, T, C_out) -> dx (B_c, T, C_c); adds into dW's rows."""
        x2 = x.reshape(-1, x.shape[-1])                         # (n, C_c)
        dy2 = dy.reshape(-1, dy.shape[-1])                      # (n, C_out)
        dyd, w, xw, dyw = dy, self.w, x2, dy2
        if self.fp8 is not None:                                # each GEMM's own quantization
            dyd, w = self.fp8.oriented(dy, "dy", "dgrad"), self.fp8.oriented(self.whole, "w", "dgrad")[self.rows]
            xw, dyw = self.fp8.oriented(x2, "x", "wgrad"), self.fp8.oriented(dy2, "dy", "wgrad")
        self.wgrads.add(self.backward_weight, xw, dyw)          # now, or filed (parallel/wgrad.py)
        return matmul_rows(dyd, w.T)                            # (B_c, T, C_c)

    def backward_weight(self, x2, dy2):
        """dW[rows] += x^T dy (the weight phase: parallel/wgrad.py)."""
        self.dw += precision.matmul(x2.T, dy2, dtype=self.dw.dtype)


def replicated_linear(layout, store: ParamStore, prefix: str, bias: bool = False) -> ReplicatedLinear:
    """The REPLICATED kind on ``layout`` (every layout's ``linear`` returns
    this): the whole weight on every tensor-parallel rank, this rank's
    canonical rows of x times its canonical columns' rows of W, summed
    over ``layout.hidden_comm`` where the canonical form splits the hidden
    size. The layouts' ``shard`` answer role "w_replicated" with the whole
    tensor and the gradient sum over the ranks holding other canonical
    blocks (``Layout.replicated_spec``)."""
    if bias:
        raise ValueError(f"{prefix}: a replicated linear has no bias (its gradient would be summed "
                         f"over the hidden group's copies too)")
    cols = layout.canonical_cols
    rows = slice(int(cols[0]), int(cols[-1]) + 1)        # a contiguous block of the hidden size
    assert rows.stop - rows.start == len(cols), "canonical columns must be one contiguous block"
    fp8 = None
    if layout.fp8 is not None:       # x's columns over the hidden split; its tokens over the stage under sp
        tokens = layout.fp8.stage if layout.sequence_comm is not None else None
        width = store.by_name[prefix + ".weight"].decl.shape[1]            # x (B_c, T_c, C_c) -> dy (B_c, T_c, C_out)
        where = OperandIndex(np.asarray(cols), np.arange(width), ("canonical", "canonical"), ("canonical", "canonical"))
        fp8 = layout.fp8_linear(store, prefix, Splits(x_cols=layout.hidden_comm, tokens=tokens), where)
    return ReplicatedLinear(store, prefix, rows, layout.hidden_comm, fp8)


class Panel:
    """One micro-batch's gathered embedding weight ``w`` and the float32+
    accumulator ``dw`` of its gradient, shared by the lookup and the LM
    head of the layouts that gather wte (2-D, 2.5-D, 3-D: one gather per
    micro-batch serves both); empty until the first of the two gathers, and
    reduced into the store by ``finish_backward``. It lives in the
    micro-batch's tape, never on the module, so micro-batches of a pipeline
    in flight at once each have their own."""

    __slots__ = ("w", "dw")

    def __init__(self):
        self.w = self.dw = None


class LayerNorm:
    """LayerNorm over a hidden size that may be split across ``comm``."""

    def __init__(self, store: ParamStore, prefix: str, n_hidden: int, comm: Comm = None):
        self.gamma = store.work[prefix + ".weight"]   # (C_c,)
        self.beta = store.work[prefix + ".bias"]      # (C_c,)
        self.dgamma = store.grad[prefix + ".weight"]
        self.dbeta = store.grad[prefix + ".bias"]
        self.n_hidden = n_hidden
        self.allsum = comm.allreduce if comm is not None else ops.identity

    def forward(self, x):
        """x (B, T, C_c) -> (y (B, T, C_c), saved: the normalised rows and their statistics)."""
        return ops.layernorm_forward(x, self.gamma, self.beta, self.n_hidden, allsum=self.allsum)

    def backward(self, dy, saved):
        """dy (B, T, C_c) -> dx (B, T, C_c); adds into the weight and bias gradients."""
        return ops.layernorm_backward(dy, saved, self.gamma, self.dgamma, self.dbeta, self.n_hidden,
                                      allsum=self.allsum)


class RMSNorm:
    """Llama's RMSNorm over a hidden size that may be split across ``comm``
    (the mean square all-summed, as LayerNorm's statistics are): a weight,
    no bias, ``eps`` from the model's configuration."""

    def __init__(self, store: ParamStore, prefix: str, n_hidden: int, comm: Comm = None, eps: float = 1e-6):
        self.gamma = store.work[prefix + ".weight"]   # (C_c,)
        self.dgamma = store.grad[prefix + ".weight"]
        self.n_hidden, self.eps = n_hidden, eps
        self.allsum = comm.allreduce if comm is not None else ops.identity

    def forward(self, x):
        """x (B, T, C_c) -> (y (B, T, C_c), saved: the normalised rows and 1/rms)."""
        return ops.rmsnorm_forward(x, self.gamma, self.n_hidden, self.eps, allsum=self.allsum)

    def backward(self, dy, saved):
        """dy (B, T, C_c) -> dx (B, T, C_c); adds into the weight's gradient."""
        return ops.rmsnorm_backward(dy, saved, self.gamma, self.dgamma, self.n_hidden, allsum=self.allsum)

