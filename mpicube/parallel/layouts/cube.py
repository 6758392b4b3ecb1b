"""3-D tensor parallelism: the q x q x q cube of Bian et al. (arXiv 2105.14450).

Rank (i, j, k) holds 1/q^3 of every matrix:

* activation X (N, h): rows block i, sub-block j; columns block k
  -> (B/q^2, T, h/q), the *canonical* form;
* weight W (h_in, h_out) of a first linear: rows block k, sub-block i;
  columns block j -> (h_in/q^2, h_out/q).

A linear all-gathers X over j and W over i, multiplies the
(N/q, h_in/q) x (h_in/q, h_out/q) blocks, and reduce-scatters the partial Y
over k, leaving rows block i, sub-block k, columns block j. The second linear
of a pair swaps the roles of j and k, which brings the activation back to
canonical form with no re-layout. Backward mirrors it: all-gather dY,
reduce-scatter dX and dW.

``--recompute gathers``: a linear keeps its local X instead of the gathered
one and drops the gathered W after the forward GEMM, gathering both again
in backward; the LM head keeps its local input and drops the wte panel the
same way.
"""

from __future__ import annotations

import math

import numpy as np

from ... import ops
from ...device import precision
from ..comm import Comm
from ...core.errors import ConfigError
from ..params import ParamDecl, ParamSpec, full_index, split_index
from .base import COLUMN, REPLICATED, Layout, acc, check_head_split, add_bias, add_bias_grad, bias_views, matmul_rows
from ..fp8 import Fp8Scaling, OperandIndex, Splits
from .modules import replicated_linear


class CubeLayout(Layout):
    name = "3d"
    token_split = True

    @classmethod
    def fp8_widths(cls, cfg, tp, depth):
        """``Layout.fp8_widths``: activations split q ways by columns,
        weight rows q^2 ways (a sub-block of a row block): the hidden size,
        the MLP's and the heads' widths over q and over q^2."""
        q = cls.cube_side(tp)
        heads = cfg.n_head * (cfg.v_head_dim if cfg.mla else cfg.head_dim)    # c_proj's input
        return {**cls.fp8_head_widths(cfg, tp, depth),
                f"a rank's hidden columns (--n-embd / {q})": cfg.n_embd // q,
                f"a rank's MLP hidden columns ({cfg.ffn} / {q})": cfg.ffn // q,
                f"a rank's weight rows (--n-embd / {q * q})": cfg.n_embd // (q * q),
                f"a rank's weight rows ({cfg.ffn} / {q * q})": cfg.ffn // (q * q),
                f"a rank's weight rows ({heads} / {q * q})": heads // (q * q)}

    @classmethod
    def fp8_latent_splits(cls, tp, depth):
        """``Layout.fp8_latent_splits``: activations' columns q ways, weights' rows q^2 ways."""
        q = cls.cube_side(tp)
        return q, q * q

    @classmethod
    def cube_side(cls, tp: int) -> int:
        from ...core.intmath import integer_root

        q = integer_root(tp, 3)
        if q is None:
            below = max(s ** 3 for s in range(1, tp + 1) if s ** 3 <= tp)
            above = min(s ** 3 for s in range(1, tp + 2) if s ** 3 > tp)
            raise ConfigError(f"layout 3d: needs a tensor-parallel size q^3; got {tp}: "
                              f"nearest valid sizes {below} or {above}")
        return q

    @classmethod
    def head_coords(cls, tp, depth, rank):
        q = cls.cube_side(tp)
        i, rest = divmod(rank, q * q)
        j, k = divmod(rest, q)
        return q, j, i * q + k                          # heads over j; weight rows block (k, i)

    @classmethod
    def validate(cls, cfg, tp, local_batch, depth, recompute="none"):
        q = cls.cube_side(tp)
        cls.require(depth == 1, "--depth applies to 2.5d only")
        cls.require_multiple("batch size per replica", local_batch, q * q, f"q^2 = {q * q}")
        cls.require_multiple("n_embd", cfg.n_embd, q * q, f"q^2 = {q * q} (weights split q^2 ways)",
                             math.lcm(q * q, cfg.n_head))
        cls.require_multiple("n_head", cfg.n_head, q, f"q = {q}")
        check_head_split(cfg, q)

    def __init__(self, cfg, axes, batch_size, depth=1, recompute="none", **settings):
        super().__init__(cfg, axes, batch_size, recompute=recompute, **settings)
        self.q = q = self.cube_side(axes.tp.size)
        self.i, rest = divmod(axes.tp.rank, q * q)
        self.j, self.k = divmod(rest, q)
        i, j, k = self.i, self.j, self.k
        def sub(name, color, key):
            return axes.tp.split(name, color, key)      # same backend, counters and recorder as tp

        self.ci = sub("i", j * q + k, i)          # varies i
        self.cj = sub("j", i * q + k, j)          # varies j
        self.ck = sub("k", i * q + j, k)          # varies k
        self.ij = sub("ij", k, i * q + j)         # plane varying i, j
        self.ik = sub("ik", j, i * q + k)         # plane varying i, k
        self.hidden_comm = self.ck
        self.token_comm = self.ij                 # ranked i q + j: the canonical sequence blocks
        # Nonblocking weight gathers and weight-gradient reductions overlap the
        # activation collectives and GEMMs; the plan's overlap off (self.overlap, set
        # by Layout) turns it off to measure it.
        self.vocab_padded = self.pad_to(cfg.vocab_size, q)
        self.canonical_seqs = split_index(self.local_batch, q * q, i * q + j)
        self.mid_seqs = split_index(self.local_batch, q * q, i * q + k)
        self.canonical_cols = split_index(cfg.n_embd, q, k)
        self.place_heads(depth)                          # heads split over j

    def canonical_block(self, n):
        return split_index(n, self.q, self.k)

    def shared_key(self, k):
        """``Layout.shared_key``: the heads of rank (i, j, k) attend over the
        intermediate rows i q + k, held in canonical form by the ranks
        (i, k, *): gathered over j (ranks (i, *, k), the plane's row blocks
        in order), block k kept."""
        rows = k.shape[0]
        every = self.cj.allgather(self.backend.xp.ascontiguousarray(k), axis=0)   # (q B_c, T, w) rows i q + 0..q-1
        return every[self.k * rows:(self.k + 1) * rows]                            # (B_m, T, w) rows i q + k

    def shared_key_backward(self, dk):
        """The adjoint of ``shared_key`` with the sum over heads: dk into
        slot k of the plane's row blocks, reduce-scattered over j (the
        ranks (i, *, k) of the same rows and the other heads): rank
        (i, j, j) receives rows i q + j summed over every head, the others
        zero; all-reduced over k, every rank holding rows i q + j has them."""
        xp, rows = self.backend.xp, dk.shape[0]
        slots = xp.zeros((self.q * rows,) + tuple(dk.shape[1:]), dtype=dk.dtype)   # (q B_m, T, w)
        slots[self.k * rows:(self.k + 1) * rows] = dk
        return self.ck.allreduce(self.cj.reduce_scatter(slots, axis=0))           # (B_c, T, w)

    def shard(self, decl: ParamDecl) -> ParamSpec:
        q, i, j, k, shape = self.q, self.i, self.j, self.k, decl.shape
        on_ij = dict(grad_comm=self.ij, replicas=q * q, writer=(i == 0 and j == 0))
        if decl.role == "wte":     # the LM head's W = wte^T as a first linear
            return ParamSpec(decl, (split_index(self.vocab_padded, q, j), split_index(shape[1], q * q, k * q + i)))
        if decl.role == "w_column":
            cols, shared = self.first_columns(decl)
            return ParamSpec(decl, (split_index(shape[0], q * q, k * q + i), cols), shared=shared)
        if decl.role == "w_row":
            return ParamSpec(decl, (split_index(shape[0], q * q, j * q + i), split_index(shape[1], q, k)))
        if decl.role == "b_column":
            cols, shared = self.first_columns(decl)
            return ParamSpec(decl, (cols,), grad_comm=self.ik, replicas=q * q, writer=(i == 0 and k == 0),
                             shared=shared)
        if decl.role == "wpe":
            return ParamSpec(decl, (full_index(shape[0]), split_index(shape[1], q, k)), **on_ij)
        if decl.role == "router":  # a mixture's router (h, E): hidden block k's rows, like a norm
            return ParamSpec(decl, (split_index(shape[0], q, k), full_index(shape[1])), **on_ij)
        if decl.role == "w_replicated":   # whole on every rank; the rank's canonical block's partial gradient
            return self.replicated_spec(decl, shared=True)
        # norm, b_row: hidden block k
        return ParamSpec(decl, (split_index(shape[0], q, k),), **on_ij)

    def fp8_scaling(self, recipe) -> Fp8Scaling:
        """``Layout.fp8_scaling`` with the cube's token groups (a wgrad row
        scale, rowwise): the other tokens of a column block lie on the
        plane of ranks sharing its column coordinate and on the dp x cp
        replicas, so one group per coordinate: ``tokens`` the ranks with
        this rank's k (a canonical activation's columns), ``fp8_tokens_j``
        with its j (an intermediate one's). Called from
        ``Layout.__init__``, before the cube coordinates are set."""
        world, pp, tp = self.axes.world, self.axes.pp, self.axes.tp
        q = self.cube_side(tp.size)
        j, k = divmod(tp.rank % (q * q), q)
        stage = world.split("fp8", pp.rank, world.rank)
        tokens = world.split("fp8", pp.rank * q + k, world.rank)
        self.fp8_tokens_j = world.split("fp8", pp.rank * q + j, world.rank)
        return Fp8Scaling(recipe, stage, tokens, self.axes.ep, (self.fp8_tokens_j,))

    def linear(self, store, prefix, kind, bias=True):
        if kind == REPLICATED:
            return replicated_linear(self, store, prefix, bias)
        a, b = (self.cj, self.ck) if kind == COLUMN else (self.ck, self.cj)
        fp8 = None
        if self.fp8 is not None:
            # --fp8 rowwise: K_in runs over b (x's columns) and over b and i (W's rows: plane ik or ij), K_out
            # over a (dy's and W's columns); the tokens of x's columns over the plane with its b coordinate
            # fixed, of dy's with its a coordinate fixed (and the replicas)
            by = {"k": self.fp8.tokens, "j": self.fp8_tokens_j}
            first = kind == COLUMN
            fp8 = self.fp8_linear(store, prefix, Splits(x_cols=b, w_rows=self.ik if first else self.ij, w_cols=a,
                                                        dy_cols=a, tokens=by[b.axis], dy_tokens=by[a.axis]),
                                  self.fp8_index(store, prefix, kind))
        return CubeLinear(store, prefix, a=a, b=b, weight_comm=self.ci, overlap=self.overlap,
                          regather=self.recompute == "gathers", bias=bias, fp8=fp8)

    def fp8_index(self, store, prefix, kind):
        """``OperandIndex`` of a cube linear: x holds input rows sub-block
        a and K_in block b (W's rows gathered over i), dy output rows
        sub-block b and W's columns; a first linear's (a, b) are (j, k):
        canonical rows in, intermediate (mid) rows out; a second's the
        reverse."""
        if self.fp8 is None:
            return None
        spec = store.by_name[prefix + ".weight"]
        q, block = self.q, self.k if kind == COLUMN else self.j
        x_cols = np.concatenate([split_index(spec.decl.shape[0], q * q, block * q + i) for i in range(q)])
        rows = [("canonical", "gathered"), ("mid", "gathered")]
        return OperandIndex(x_cols, np.asarray(spec.index[1]), *(rows if kind == COLUMN else rows[::-1]))

    def tied_embedding(self, store, name="wte"):
        return CubeTiedEmbedding(store, self, name)

    def expert_rows(self, held):
        """A linear all-gathers its input rows over j (ranks (i, *, k),
        holding other tokens) and reduce-scatters its output rows over k
        in q equal blocks, so the ranks of one j line must hold equally
        many rows of an expert: each pads with zero rows up to the line's
        most (one all-gather of E_l counts). Bias-free SwiGLU keeps zero
        rows zero (silu(0) 0 = 0) and they add nothing to the weight
        gradients. The rows held are the same across k (the same tokens),
        so the padded count is the same on the whole (j, k) plane; every
        rank runs every expert, with no rows too (the weights' gathers
        over i)."""
        mine = self.backend.asarray(np.asarray(held, dtype=np.int64)[None])     # (1, E_l) where the backend computes
        return self.cj.allgather(mine, axis=0).max(axis=0), True                # (E_l,) of (q, E_l)

    def expert_mid_rows(self):
        """``Layout.expert_mid_rows``: a first linear all-gathers its input
        rows over j (each rank's padded to the line's most, ``expert_rows``)
        and reduce-scatters its output over k in q equal blocks, so block k,
        the rows of the j line's rank k, is this rank's."""
        return self.cj, self.k

    def describe(self):
        return {**super().describe(), "q": self.q}


class CubeLinear:
    """Input rows sub-block ``a``, columns block ``b``; output rows sub-block
    ``b``, columns block ``a``. First linears use (a, b) = (j, k), second
    linears (k, j). Forward saves the gathered X and W for backward; with
    ``regather`` (--recompute gathers) only the local X, and backward
    gathers X and W again."""

    def __init__(self, store, prefix, a: Comm, b: Comm, weight_comm: Comm, overlap: bool = True,
                 regather: bool = False, bias: bool = True, fp8=None):
        self.overlap = overlap
        self.fp8 = fp8                               # --fp8 (parallel/fp8.py LinearFp8), or None
        self.oriented = fp8 is not None and not fp8.tensor_scaled   # tiles: each GEMM quantizes its own way
        self.regather = regather
        self.w = store.work[prefix + ".weight"]      # (h_in/q^2, h_out/q)
        self.bias, self.dbias = bias_views(store, prefix, bias)   # (h_out/q,) or None
        self.store, self.w_name = store, prefix + ".weight"
        store.defer_zero(self.w_name)                # dW arrives whole from a reduce-scatter: add_grad
        self.a, self.b, self.wc = a, b, weight_comm

    def forward(self, x):
        """x (B/q^2, T, h_in/q) -> (y (B/q^2, T, h_out/q), saved (x, X gathered, W gathered))."""
        raw = x                                      # (B/q^2, T, h_in/q)
        if self.oriented:                            # tiles: W and x are quantized again for backward's GEMMs
            x, w = self.fp8.oriented(x, "x", "forward"), self.fp8.oriented(self.w, "w", "forward")
        else:                                        # under --fp8 the gathers carry quantized values
            x, w = self.quantized(x, "x"), self.quantized(self.w, "w")
        if self.overlap:                             # W travels while X is gathered
            w_pending = self.wc.iallgather(w, axis=0)
            xg = self.a.allgather(x, axis=0)         # (B/q, T, h_in/q)
            wg = w_pending.wait()                    # (h_in/q, h_out/q)
        else:
            xg = self.a.allgather(x, axis=0)
            wg = self.wc.allgather(w, axis=0)
        y = self.b.reduce_scatter(matmul_rows(xg, wg, acc(x)), axis=0, wire=x.dtype)  # (B/q^2, T, h_out/q)
        if self.oriented:                            # backward gathers its own quantizations of the local X, W
            saved = (raw, None, None)
        else:                                        # --recompute gathers: the local X only
            saved = (x, None, None) if self.regather else (None, xg, wg)
        add_bias(y, self.bias)
        return precision.narrow(y, x.dtype), saved

    def backward(self, dy, saved):
        """dy (B/q^2, T, h_out/q) -> dx (B/q^2, T, h_in/q)."""
        x, xg, wg = saved
        if self.oriented:                            # --fp8 tiles: wgrad's x and dy along the tokens, dgrad's along K_out
            xg = self.a.allgather(self.fp8.oriented(x, "x", "wgrad"), axis=0)              # (B/q, T, h_in/q)
            wg = self.wc.allgather(self.fp8.oriented(self.w, "w", "dgrad"), axis=0)        # (h_in/q, h_out/q)
            dyg = self.b.allgather(self.fp8.oriented(dy, "dy", "dgrad"), axis=0)           # (B/q, T, h_out/q)
            dyw = self.b.allgather(self.fp8.oriented(dy, "dy", "wgrad"), axis=0)           # (B/q, T, h_out/q)
        else:
            if xg is None:                           # --recompute gathers: gather them again (blocking)
                xg = self.a.allgather(x, axis=0)                   # (B/q, T, h_in/q)
                wg = self.wc.allgather(self.quantized(self.w, "w"), axis=0)   # (h_in/q, h_out/q)
            dyg = dyw = self.b.allgather(self.quantized(dy, "dy"), axis=0)   # (B/q, T, h_out/q)
        xg2 = xg.reshape(-1, xg.shape[-1])                     # (N/q, h_in/q)
        dy2 = dyw.reshape(-1, dyw.shape[-1])                   # (N/q, h_out/q) wgrad's dY
        if self.overlap and not self.store.wgrads.deferring:   # dW travels while dX is computed and reduced
            dwg = precision.matmul(xg2.T, dy2, dtype=self.store.flat_grad.dtype)   # (h_in/q, h_out/q)
            dw_pending = self.wc.ireduce_scatter(dwg, axis=0, wire=self.w.dtype)
            dx = self.a.reduce_scatter(matmul_rows(dyg, wg.T, acc(dy)), axis=0, wire=dy.dtype)  # (B/q^2,T,h_in/q)
            self.store.add_grad(self.w_name, dw_pending.wait())
            add_bias_grad(self.dbias, dy.reshape(-1, dy.shape[-1]))
        else:
            dx = self.a.reduce_scatter(matmul_rows(dyg, wg.T, acc(dy)), axis=0, wire=dy.dtype)
            self.store.wgrads.add(self.backward_weight, xg2, dy2, dy)   # now, or filed (parallel/wgrad.py)
        return precision.narrow(dx, dy.dtype)

    def backward_weight(self, xg2, dy2, dy):
        """The weight phase: dW's gathered block (h_in/q, h_out/q) reduce-
        scattered over the weight's group, db from this rank's dy."""
        dwg = precision.matmul(xg2.T, dy2, dtype=self.store.flat_grad.dtype)   # (h_in/q, h_out/q)
        self.store.add_grad(self.w_name, self.wc.reduce_scatter(dwg, axis=0, wire=self.w.dtype))
        add_bias_grad(self.dbias, dy.reshape(-1, dy.shape[-1]))

    def quantized(self, a, role):
        """a under --fp8's tensor scale, or a itself."""
        return a if self.fp8 is None else self.fp8.tensor(a, role)


class CubeTiedEmbedding:
    """wte (V, h) is held like the LM head's W = wte^T of a first linear:
    rank (i, j, k) has vocabulary block j, hidden block k, sub-block i.
    One all-gather over i per micro-batch serves both the lookup and the
    head (the tape's ``Panel``)."""

    def __init__(self, store, layout: CubeLayout, name: str = "wte"):
        self.name = name                             # "wte", or an untied model's "lm_head"
        self.wte = store.work[name]                 # (V/q, h/q^2)
        self.store = store
        store.defer_zero(name)                      # written once, in finish_backward
        self.ci, self.cj, self.ck = layout.ci, layout.cj, layout.ck
        q, i = layout.q, layout.i
        self.row_block = split_index(layout.local_batch, q, i)    # sequences of rows block i
        self.logit_seqs = layout.mid_seqs
        self.vocab_comm = layout.cj
        self.vocab_start = layout.j * layout.vocab_padded // q
        self.row_replicas = q
        self.xp = layout.backend.xp
        self.regather = layout.recompute == "gathers"

    def _gather(self, panel):
        """The micro-batch's wte panel and its gradient accumulator: one
        all-gather over i serves the lookup and the head."""
        panel.w = self.ci.allgather(self.wte, axis=1)             # (V/q, h/q)
        panel.dw = self.xp.zeros(panel.w.shape, dtype=self.store.flat_grad.dtype)   # (V/q, h/q) float32+

    def embed(self, ids, panel):
        """ids (B_dp, T) -> (x (B/q^2, T, h/q) canonical, saved)."""
        self._gather(panel)
        ids_i = ids[self.xp.asarray(self.row_block)]              # (B/q, T)
        part, saved = ops.embedding_forward(ids_i, panel.w, self.vocab_start)  # (B/q, T, h/q)
        return self.cj.reduce_scatter(part, axis=0, wire=part.dtype), saved

    def embed_backward(self, dx, saved, panel):
        dxg = self.cj.allgather(dx, axis=0)                       # (B/q, T, h/q)
        ops.embedding_backward(dxg, saved, panel.dw)

    def logits(self, x, panel):
        """x (B/q^2, T, h/q) -> (logits (B/q^2, T, V/q), saved): rows block
        i, sub-block k; vocabulary block j."""
        if panel.dw is None:              # a pipeline's last stage: the head without the lookup
            self._gather(panel)
        elif panel.w is None:             # let go by an earlier head of this pass (--recompute gathers, MTP)
            panel.w = self.ci.allgather(self.wte, axis=1)         # (V/q, h/q)
        xg = self.cj.allgather(x, axis=0)                         # (B/q, T, h/q)
        logits = self.ck.reduce_scatter(matmul_rows(xg, panel.w.T, acc(x)), axis=0, wire=x.dtype)
        if self.regather:                 # --recompute gathers: both gathered again in logits_backward
            panel.w = None
            return precision.narrow(logits, x.dtype), (x, None)
        return precision.narrow(logits, x.dtype), (None, xg)

    def logits_backward(self, dlogits, saved, panel):
        x, xg = saved
        if xg is None:
            panel.w = self.ci.allgather(self.wte, axis=1)         # (V/q, h/q)
            xg = self.cj.allgather(x, axis=0)                     # (B/q, T, h/q)
        dlg = self.ck.allgather(dlogits, axis=0)                  # (B/q, T, V/q)
        panel.dw += precision.matmul(dlg.reshape(-1, dlg.shape[-1]).T, xg.reshape(-1, xg.shape[-1]),
                                     dtype=panel.dw.dtype)
        dx = self.cj.reduce_scatter(matmul_rows(dlg, panel.w, acc(dlogits)), axis=0,
                                   wire=dlogits.dtype)                          # (B/q^2, T, h/q)
        return precision.narrow(dx, dlogits.dtype)

    def finish_backward(self, panel):
        self.store.add_grad(self.name, self.ci.reduce_scatter(panel.dw, axis=1, wire=self.wte.dtype))
        panel.w = panel.dw = None
