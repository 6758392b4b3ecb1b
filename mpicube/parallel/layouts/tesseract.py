"""2-D (Optimus / SUMMA) and 2.5-D (Tesseract) tensor parallelism.

The tensor-parallel group is d stacked q x q grids; rank (l, r, c) is depth
l, row r, column c. d = 1 is the 2-D scheme.

* Activations (B/(d q), T, h/q): sequence block l*q + r, hidden block c.
* Weights (h_in/q, h_out/q): row block r, column block c, the same on every
  depth slice; their gradients are all-reduced over depth.
* Y = X W by SUMMA: q steps, each broadcasting an X panel along the row and
  a W panel along the column. dX = dY W^T and dW = X^T dY broadcast one
  operand and reduce the product onto the panel's owner.
* LayerNorm statistics are all-reduced along the row (hidden is split by c).
* Tied embedding: rank (r, c) holds wte[vocabulary block r, hidden block c];
  one all-gather along the column gives wte[:, hidden block c], used both for
  the lookup and for the LM head, whose partial logits are reduce-scattered
  along the row (vocabulary split by c).

Overlap (on unless the plan's ``overlap`` is off): SUMMA's panels are double-buffered,
the broadcasts of step s+1 posted (nonblocking) before step s's GEMM runs;
the products are summed in the same order, so the results are the
blocking path's bit for bit.

``--recompute gathers``: SUMMA linears keep only their local X already
(panels are broadcast again in backward); the tied embedding lets go of
wte[:, block c] after the LM head's forward GEMM and gathers it again in
``logits_backward``.
"""

from __future__ import annotations

import numpy as np

from ... import ops
from ...device import precision
from ..comm_start import ibcast
from ...core.errors import ConfigError
from ..params import ParamDecl, ParamSpec, full_index, split_index
from .base import REPLICATED, Layout, acc, check_head_split, add_bias, add_bias_grad, bias_views, matmul_rows
from .modules import replicated_linear
from ..fp8 import Fp8Scaling, OperandIndex, Splits


class TesseractLayout(Layout):
    name = "2.5d"
    token_split = True

    @classmethod
    def fp8_widths(cls, cfg, tp, depth):
        """``Layout.fp8_widths``: the hidden size, the MLP's and a rank's
        heads' columns, each split q ways (weights by row block r and
        column block c, activations by column block c)."""
        q = cls.grid_side(tp, depth)
        return {**cls.fp8_head_widths(cfg, tp, depth),
                f"a rank's hidden columns (--n-embd / {q})": cfg.n_embd // q,
                f"a rank's MLP hidden columns ({cfg.ffn} / {q})": cfg.ffn // q}

    @classmethod
    def fp8_latent_splits(cls, tp, depth):
        """``Layout.fp8_latent_splits``: activations' and weights' rows by the grid's side q."""
        q = cls.grid_side(tp, depth)
        return q, q

    @classmethod
    def grid_side(cls, tp: int, depth: int) -> int:
        from ...core.intmath import integer_root

        if depth < 1 or tp % depth:
            raise ConfigError(f"layout {cls.name}: --depth {depth} must divide the tensor-parallel size {tp}")
        q = integer_root(tp // depth, 2)
        if q is None:
            below = max(depth * s * s for s in range(1, tp + 1) if depth * s * s <= tp)
            above = min(depth * s * s for s in range(1, tp + 2) if depth * s * s > tp)
            raise ConfigError(f"layout {cls.name}: needs a tensor-parallel size d*q*q (d = {depth}); "
                              f"got {tp}: nearest valid sizes {below} or {above}")
        return q

    @classmethod
    def head_coords(cls, tp, depth, rank):
        q = cls.grid_side(tp, depth)
        l, rest = divmod(rank, q * q)
        r, c = divmod(rest, q)
        return q, c, l * q + r                          # heads over c; weight rows block r, on depth slice l

    @classmethod
    def validate(cls, cfg, tp, local_batch, depth, recompute="none"):
        q = cls.grid_side(tp, depth)
        split = depth * q
        cls.require_multiple("batch size per replica", local_batch, split, f"d*q = {split}")
        cls.require_multiple("n_head", cfg.n_head, q, f"q = {q}")
        check_head_split(cfg, q)

    def __init__(self, cfg, axes, batch_size, depth=1, recompute="none", **settings):
        self.d = depth                                  # before Layout's __init__: fp8_scaling reads it
        super().__init__(cfg, axes, batch_size, recompute=recompute, **settings)
        self.q = q = self.grid_side(axes.tp.size, depth)
        self.l, rest = divmod(axes.tp.rank, q * q)
        self.r, self.c = divmod(rest, q)
        l, r, c = self.l, self.r, self.c
        tp = axes.tp                                    # splits share its backend, counters and recorder
        self.row = tp.split("row", l * q + r, c)                # varies c
        self.col = tp.split("col", l * q + c, r)                # varies r
        self.depth = tp.split("depth", r * q + c, l)            # varies l
        self.col_depth = tp.split("col_depth", c, l * q + r)    # varies r, l
        self.hidden_comm = self.row
        self.head_comm = self.row                               # the same rows (mid = canonical), other heads
        self.token_comm = self.col_depth                        # ranked l q + r: the canonical sequence blocks
        self.vocab_padded = self.pad_to(cfg.vocab_size, q)
        self.canonical_seqs = split_index(self.local_batch, depth * q, l * q + r)
        self.mid_seqs = self.canonical_seqs
        self.canonical_cols = split_index(cfg.n_embd, q, c)
        self.place_heads(depth)                         # heads split over the grid's columns c

    def canonical_block(self, n):
        return split_index(n, self.q, self.c)

    def fp8_scaling(self, recipe) -> Fp8Scaling:
        """``Layout.fp8_scaling`` with the token group of a grid column: the
        other tokens of this rank's columns (a wgrad row scale, rowwise)
        lie on every depth slice and grid row with the same column c, and
        on the dp x cp replicas. Called from ``Layout.__init__``, before
        the grid coordinates are set."""
        world, pp, tp = self.axes.world, self.axes.pp, self.axes.tp
        q = self.grid_side(tp.size, self.d)
        stage = world.split("fp8", pp.rank, world.rank)
        tokens = world.split("fp8", pp.rank * q + tp.rank % q, world.rank)
        return Fp8Scaling(recipe, stage, tokens, self.axes.ep)

    def shard(self, decl: ParamDecl) -> ParamSpec:
        q, r, c, shape = self.q, self.r, self.c, decl.shape
        on_depth = dict(grad_comm=self.depth if self.d > 1 else None, replicas=self.d, writer=self.l == 0)
        on_plane = dict(grad_comm=self.col_depth, replicas=self.d * q, writer=(self.l == 0 and r == 0))
        if decl.role == "wte":
            return ParamSpec(decl, (split_index(self.vocab_padded, q, r), split_index(shape[1], q, c)), **on_depth)
        if decl.role in ("w_column", "w_row"):
            cols, shared = self.first_columns(decl)
            return ParamSpec(decl, (split_index(shape[0], q, r), cols), **on_depth, shared=shared)
        if decl.role == "wpe":
            return ParamSpec(decl, (full_index(shape[0]), split_index(shape[1], q, c)), **on_plane)
        if decl.role == "w_replicated":   # whole on every rank; the rank's canonical block's partial gradient
            return self.replicated_spec(decl, shared=True)
        if decl.role == "router":   # a mixture's router (h, E): the canonical columns' rows, like a norm
            return ParamSpec(decl, (split_index(shape[0], q, c), full_index(shape[1])), **on_plane)
        # norm, b_column, b_row: hidden block c, partial gradients over rows
        cols, shared = self.first_columns(decl)
        return ParamSpec(decl, (cols,), **on_plane, shared=shared)

    def linear(self, store, prefix, kind, bias=True):
        if kind == REPLICATED:
            return replicated_linear(self, store, prefix, bias)
        return SummaLinear(store, prefix, self, bias=bias)      # the same SUMMA for COLUMN and ROW

    def expert_rows(self, held):
        """SUMMA moves activations only along the row, whose ranks hold the
        same tokens, so an expert runs on the rows held, however many each
        grid row has; the column's broadcasts and reductions carry weight
        panels, so every rank runs every local expert, with no rows too."""
        return held, True

    def tied_embedding(self, store, name="wte"):
        return TesseractTiedEmbedding(store, self, name)

    def describe(self):
        return {**super().describe(), "q": self.q, "depth": self.d}


class TwoDLayout(TesseractLayout):
    """The 2-D scheme: one q x q grid (d = 1)."""

    name = "2d"

    @classmethod
    def validate(cls, cfg, tp, local_batch, depth, recompute="none"):
        if depth != 1:
            raise ConfigError("layout 2d: --depth applies to 2.5d only")
        super().validate(cfg, tp, local_batch, 1, recompute)


class SummaLinear:
    """Y[r, c] = sum_s X[r, s] W[s, c] (+ b[c]) on a q x q grid."""

    def __init__(self, store, prefix, layout: TesseractLayout, bias: bool = True):
        self.w = store.work[prefix + ".weight"]      # (h_in/q, h_out/q)
        self.b, self.db = bias_views(store, prefix, bias)   # (h_out/q,) or None
        self.store, self.w_name = store, prefix + ".weight"
        store.defer_zero(self.w_name)                # dW arrives whole from a reduce: add_grad
        self.row, self.col = layout.row, layout.col
        self.q, self.r, self.c = layout.q, layout.r, layout.c
        self.xp = layout.backend.xp
        self.overlap = layout.overlap
        # --fp8: a row of x, dy or W (along K_out) is split over the grid's row, a column of W over its column
        # x (B_c, T, h_in/q) holds K_in block c (W's rows on grid row c), dy W's columns
        k_in = store.by_name[self.w_name].decl.shape[0]
        where = OperandIndex(split_index(k_in, self.q, self.c), np.asarray(store.by_name[self.w_name].index[1]))
        self.fp8 = layout.fp8_linear(store, prefix, Splits(x_cols=self.row, w_rows=self.col, w_cols=self.row,
                                                           dy_cols=self.row), where)
        self.oriented = self.fp8 is not None and not self.fp8.tensor_scaled   # each GEMM quantizes its own way

    def panels(self, *sources):
        """For s = 0 .. q-1, the broadcasts from root s of each (comm, array)
        in ``sources``, as a list. With overlap, step s+1's broadcasts are
        posted before step s's panels are handed out, so they travel while
        the caller multiplies (two panels of each kind alive at a time)."""
        if not self.overlap:
            for s in range(self.q):
                yield [comm.bcast(a, root=s) for comm, a in sources]
            return
        posted = [ibcast(comm, a, root=0) for comm, a in sources]
        for s in range(self.q):
            ready = [p.wait() for p in posted]
            if s + 1 < self.q:
                posted = [ibcast(comm, a, root=s + 1) for comm, a in sources]
            yield ready

    def forward(self, x):
        """x (B_c, T, h_in/q) -> (y (B_c, T, h_out/q), saved: x as rows (n, h_in/q))."""
        B, T, _ = x.shape
        x2 = x.reshape(B * T, x.shape[-1])                      # (n, h_in/q); n may be 0 (an expert)
        if self.oriented:                                       # saved raw: wgrad quantizes it along the tokens
            xf, wf = self.fp8.oriented(x2, "x", "forward"), self.fp8.oriented(self.w, "w", "forward")
        else:                                                   # one quantization serves every GEMM
            x2 = xf = self.quantized(x2, "x")
            wf = self.quantized(self.w, "w")                    # (h_in/q, h_out/q)
        y = self.xp.zeros((B * T, self.w.shape[1]), dtype=acc(x))   # (n, h_out/q), float32 for 16-bit x
        for x_panel, w_panel in self.panels((self.row, xf), (self.col, wf)):
            # X[r, s] (n, h_in/q), W[s, c] (h_in/q, h_out/q)
            y += precision.matmul(x_panel, w_panel, dtype=y.dtype)
        add_bias(y, self.b)
        return precision.narrow(y, x.dtype).reshape(B, T, y.shape[-1]), x2

    def backward(self, dy, x2):
        """dy (B_c, T, h_out/q) -> dx (B_c, T, h_in/q)."""
        B, T, _ = dy.shape
        dy2 = dy.reshape(B * T, dy.shape[-1])                   # (n, h_out/q)
        if self.oriented:                                       # (n, h_out/q) twice, (h_in/q, h_out/q), (n, h_in/q)
            dyd, wd = self.fp8.oriented(dy2, "dy", "dgrad"), self.fp8.oriented(self.w, "w", "dgrad")
            dyw, xw = self.fp8.oriented(dy2, "dy", "wgrad"), self.fp8.oriented(x2, "x", "wgrad")
        else:                                                   # dy2, W, x2 themselves without --fp8
            dyd = dyw = self.quantized(dy2, "dy")
            wd, xw = self.quantized(self.w, "w"), x2
        dx = None
        for s, (w_panel,) in enumerate(self.panels((self.col, wd))):
            # dX[r, s] = sum_c dY[r, c] W[s, c]^T
            part = self.row.reduce(precision.matmul(dyd, w_panel.T, dtype=acc(dy2)), root=s,
                                   wire=dy.dtype)               # (n, h_in/q)
            if self.c == s:                                     # on column s
                dx = precision.narrow(part, dy.dtype)
        self.store.wgrads.add(self.backward_weight, xw, dyw, dy2)   # now, or filed (parallel/wgrad.py)
        return dx.reshape(B, T, dx.shape[-1])

    def backward_weight(self, xw, dyw, dy2):
        """The weight phase: dW[s, c] = sum_r X[r, s]^T dY[r, c] over wgrad's
        operands (quantized along the tokens under --fp8's tiles; broadcasts
        over the row, reduces over the column: every rank of the grid runs
        the same weight phases in the same order), db from dy's columns."""
        for s, (x_panel,) in enumerate(self.panels((self.row, xw))):
            part = self.col.reduce(precision.matmul(x_panel.T, dyw, dtype=self.store.flat_grad.dtype),
                                   root=s, wire=self.w.dtype)   # (h_in/q, h_out/q) on row s
            if self.r == s:
                self.store.add_grad(self.w_name, part)
        add_bias_grad(self.db, dy2)

    def quantized(self, a, role):
        """a under --fp8's tensor scale (the panels carry quantized values), or a itself."""
        return a if self.fp8 is None else self.fp8.tensor(a, role)


class TesseractTiedEmbedding:
    """Lookup and LM head over wte[:, hidden block c], gathered once per
    micro-batch into the tape's ``Panel``."""

    def __init__(self, store, layout: TesseractLayout, name: str = "wte"):
        self.name = name                             # "wte", or an untied model's "lm_head"
        self.wte = store.work[name]                 # (V/q, h/q): vocab block r, hidden block c
        self.store = store
        store.defer_zero(name)                      # written once, in finish_backward
        self.row, self.col = layout.row, layout.col
        self.seqs = layout.canonical_seqs
        self.logit_seqs = layout.canonical_seqs
        self.vocab_comm = layout.row
        self.vocab_start = layout.c * layout.vocab_padded // layout.q
        self.row_replicas = layout.q
        self.xp = layout.backend.xp
        self.regather = layout.recompute == "gathers"

    def _gather(self, panel):
        """The micro-batch's wte columns and their gradient accumulator:
        gathered once, for the lookup and the head."""
        panel.w = self.col.allgather(self.wte, axis=0)          # (V, h/q)
        panel.dw = self.xp.zeros(panel.w.shape, dtype=self.store.flat_grad.dtype)  # (V, h/q) float32+

    def embed(self, ids, panel):
        """ids (B_dp, T) -> (x (B_c, T, h/q), saved)."""
        self._gather(panel)
        return ops.embedding_forward(ids[self.xp.asarray(self.seqs)], panel.w, 0)

    def embed_backward(self, dx, saved, panel):
        ops.embedding_backward(dx, saved, panel.dw)

    def logits(self, x, panel):
        """x (B_c, T, h/q) -> (logits (B_c, T, V/q), vocabulary block c; saved: x)."""
        if panel.dw is None:              # a pipeline's last stage: the head without the lookup
            self._gather(panel)
        elif panel.w is None:             # let go by an earlier head of this pass (--recompute gathers, MTP)
            panel.w = self.col.allgather(self.wte, axis=0)       # (V, h/q)
        partial = matmul_rows(x, panel.w.T, acc(x))             # (B_c, T, V) partial over c
        if self.regather:                                       # gathered again in logits_backward
            panel.w = None
        return precision.narrow(self.row.reduce_scatter(partial, axis=-1, wire=x.dtype), x.dtype), x

    def logits_backward(self, dlogits, x, panel):
        """dlogits (B_c, T, V/q) -> dx (B_c, T, h/q)."""
        dfull = self.row.allgather(dlogits, axis=-1)            # (B_c, T, V)
        d2 = dfull.reshape(-1, dfull.shape[-1])
        panel.dw += precision.matmul(d2.T, x.reshape(-1, x.shape[-1]), dtype=panel.dw.dtype)
        if panel.w is None:                                     # --recompute gathers
            panel.w = self.col.allgather(self.wte, axis=0)      # (V, h/q)
        return matmul_rows(dfull, panel.w)                      # (B_c, T, h/q)

    def finish_backward(self, panel):
        self.store.add_grad(self.name, self.col.reduce_scatter(panel.dw, axis=0, wire=self.wte.dtype))
        panel.w = panel.dw = None
