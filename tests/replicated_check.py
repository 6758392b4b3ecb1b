"""The REPLICATED linear kind (parallel/layouts/base.LINEAR_KINDS) on the
layout under test against the serial formula in float64, for the
multi-case launches (tests/parallel_check.py, tests/combo_matrix_check.py)
to call after their own checks: no launch of its own.

A probe weight W (h, r), declared with role "w_replicated", is built by
the layout (``Layout.shard``, ``Layout.linear(..., REPLICATED)``) in a
store of its own. Each rank feeds it its canonical block of a global
input X (B, T, h) (its dp replica's rows, its canonical sequences,
positions and hidden columns) and its rows of an upstream gradient
G (B, T, r); after the store's gradient sums (its replica groups, then
dp: ``gradients.sync_gradients``) the rank's y, dx and whole dW must be
those of y = X W, dX = G W^T, dW = X^T G to 1e-10, and the gradient norm
(each replicated element counted once) must be |dW|.
"""

from __future__ import annotations

import numpy as np

from mpicube.parallel.gradients import global_grad_norm, sync_gradients
from mpicube.parallel.layouts.base import REPLICATED
from mpicube.parallel.params import ParamDecl, ParamStore

LATENT = 5              # r: the probe's (low-rank) output width
NAME = "probe.latent"


def check_replicated(layout, close) -> None:
    """Raise (through ``close``, parallel_check's comparison) unless the
    layout's replicated linear equals the serial formula; collective over
    the layout's communicators, so every rank of the launch calls it."""
    cfg, backend = layout.cfg, layout.backend
    h, T, dp = cfg.n_embd, cfg.n_ctx, layout.axes.dp
    decl = ParamDecl(NAME + ".weight", (h, LATENT), "w_replicated", "normal", 0.02, decay=True)
    spec = layout.shard(decl)
    assert spec.local_shape == (h, LATENT), f"{layout.name}: a replicated weight is whole, got {spec.local_shape}"
    store = ParamStore([spec], backend, seed=11)
    fp8, layout.fp8 = layout.fp8, None      # the plain formula (an --fp8 case's replicated linears: its serial check)
    try:
        linear = layout.linear(store, NAME, REPLICATED, bias=False)
    finally:
        layout.fp8 = fp8
    W = np.asarray(backend.to_host(store.work[decl.name]), dtype=np.float64)          # (h, r) the same everywhere
    rng = np.random.default_rng(17)
    X = rng.standard_normal((layout.batch_size, T, h))                              # (B, T, h)
    G = rng.standard_normal((layout.batch_size, T, LATENT))                         # (B, T, r)
    seqs = dp.rank * layout.local_batch + np.asarray(layout.canonical_seqs)         # this replica's rows
    pos = layout.seq_positions(T)
    pos = np.arange(T) if pos is None else pos
    cols = np.asarray(layout.canonical_cols)
    rows = np.ix_(seqs, pos, cols)
    out_rows = np.ix_(seqs, pos, np.arange(LATENT))
    xp = backend.xp

    store.zero_grad()
    y, saved = linear.forward(xp.asarray(X[rows], dtype=backend.dtype))             # (B_c, T_c, r)
    dx = linear.backward(xp.asarray(G[out_rows], dtype=backend.dtype), saved)       # (B_c, T_c, C_c)
    sync_gradients(store, dp)
    where = f"replicated linear on {layout.name}"
    close(f"{where}: y", backend.to_host(y), (X @ W)[out_rows])
    close(f"{where}: dx", backend.to_host(dx), (G @ W.T)[rows])
    dW = np.einsum("bth,btr->hr", X, G)                                             # (h, r) over the global batch
    close(f"{where}: dW", backend.to_host(store.grad[decl.name]), dW)
    close(f"{where}: grad norm", [global_grad_norm(store, layout.axes.tp)], [np.linalg.norm(dW)])
