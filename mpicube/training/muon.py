"""Muon (``--optimizer muon``): momentum orthogonalised by Newton-Schulz
for each 2-D hidden weight, AdamW for the rest.

The algorithm (Keller Jordan's, 2024, as its reference implementation
computes it): for a hidden weight with gradient g (the clipped one),

    buf <- beta buf + (1 - beta) g                 (momentum, beta 0.95)
    u   <- (1 - beta) g + beta buf                 (Nesterov)
    O   <- NS5(u) * sqrt(max(1, rows / cols))      (rows x cols: out x in, PyTorch's weight shape)
    p   <- p (1 - lr wd) - lr O

where NS5 normalises u by its Frobenius norm (+ 1e-7), works on the
orientation with fewer rows, and runs 5 iterations of the quintic
X <- a X + (b A + c A A) X, A = X X^T, (a, b, c) = (3.4445, -4.7750,
2.0315), in float32 (float64 in a float64 run): the reference runs it in
bfloat16; "float32 or wider" keeps the float64 check at 1e-10. mpicube
stores weights as x @ W, W (in, out): the PyTorch matrix is W^T, so
NS5 runs on W^T and the scale uses out / in. The hidden weights are the
linears' matrices (roles ``w_column``/``w_row``: c_attn, attn.c_proj,
c_fc, mlp.c_proj); embeddings, the head, norms and biases take AdamW
(``training.optim.AdamW``, whose buffers this shares: ``m`` is Muon's
momentum where Muon runs, ``v`` stays zero there, so checkpoints carry
both as they carry AdamW's). A first linear of stacked matrices (c_attn's
q, k, v; SwiGLU's gate, up) is orthogonalised per stacked matrix
(``qkv="split"``, as frameworks that keep q, k, v as separate linears do)
or as one (``"joint"``, as GPT-2's one c_attn matrix is in PyTorch).

Why gather. NS5 is a polynomial in X X^T of the whole matrix after a
normalisation by its whole norm: every output element depends on every
input element, so no layout's block of the matrix (1-D's column panel,
SUMMA's tile, the cube's sub-block) nor a ZeRO chunk of the flat buffer
can be orthogonalised alone. It could be computed in distributed form
(the norm summed, X X^T by each layout's own GEMMs), one implementation
per layout and per ZeRO stage; mpicube instead gathers, which is the same
for every layout and stage and so checks them all against serial: the
Nesterov update's chunk is all-gathered over dp (under --zero 1-3), then
matrix by matrix every rank's block is all-gathered over tp, each rank
assembles the whole matrix, runs NS5 on it (redundantly over tp, dp and
cp, which the reference trades for simplicity) and keeps its own block of
the result. One whole matrix (and NS5's temporaries) is held at a time,
beside the (P_pad,) gathered update under ZeRO: the step's temporaries,
which the memory model prices with the optimizer state
(``analysis.costmuon``: they set the step's peak).
The cost model counts both all-gathers (``costmuon.muon_traffic``).
"""

from __future__ import annotations

import math

import numpy as np

from ..core.errors import ConfigError
from ..device.arrays import array_module
from ..device.precision import matmul
from .optim import AdamW

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
QKV_MODES = ("split", "joint")


def is_hidden_matrix(decl) -> bool:
    """Whether Muon orthogonalises this parameter (a linear's 2-D weight)."""
    return decl.role in ("w_column", "w_row") and len(decl.shape) == 2


def newton_schulz(G, steps: int = NS_STEPS):
    """G (rows, cols) -> the quintic Newton-Schulz approximation of its
    orthogonal factor U V^T, in G's format (float32 or float64)."""
    xp = array_module(G)
    a, b, c = NS_COEFFICIENTS
    X = G.T if G.shape[0] > G.shape[1] else G                    # (r, c), r <= c
    X = X / (xp.sqrt((X * X).sum()) + 1e-7)
    for _ in range(steps):
        A = matmul(X, X.T)                                       # (r, r)
        B = b * A + c * matmul(A, A)                             # (r, r)
        X = a * X + matmul(B, X)                                 # (r, c)
    return X.T if G.shape[0] > G.shape[1] else X


def orthogonalised(W, groups, qkv: str):
    """W (in, out), the Nesterov update of a mpicube weight -> the Muon
    update of the same shape: NS5 of the PyTorch matrix W^T, scaled by
    sqrt(max(1, out / in)), per stacked matrix of ``groups`` column sizes
    under "split"."""
    xp = array_module(W)
    n_in, n_out = W.shape
    out = xp.empty_like(W)
    for lo, hi in column_groups(n_out, groups, qkv):
        O = newton_schulz(W[:, lo:hi].T)                         # (out_g, in) PyTorch's orientation
        out[:, lo:hi] = O.T * math.sqrt(max(1.0, (hi - lo) / n_in))
    return out


def column_groups(n_out: int, groups, qkv: str) -> list:
    """[(lo, hi)] column ranges of a weight with ``n_out`` columns that
    Newton-Schulz orthogonalises apart: its stacked matrices (``groups``,
    a count or their sizes) under "split", the whole under "joint"."""
    if qkv == "joint" or groups == 1:
        return [(0, n_out)]
    sizes = list(groups) if isinstance(groups, tuple) else [n_out // groups] * groups
    ends = np.cumsum(sizes)
    return [(int(a), int(b)) for a, b in zip(ends - sizes, ends)]


def check(cfg, qkv: str) -> None:
    """What Muon cannot run: one line."""
    if qkv not in QKV_MODES:
        raise ConfigError(f"--muon-qkv must be one of {', '.join(QKV_MODES)}, got {qkv!r}")
    if cfg.moe:
        raise ConfigError("--optimizer muon does not orthogonalise a mixture's experts (their matrices are "
                          "sharded over --ep): use --optimizer adamw with --n-experts, or drop --n-experts")


class Muon(AdamW):
    """Muon on the hidden weights, AdamW on the rest, over this rank's
    flat buffer (or its ZeRO chunk); ``tp`` is the tensor-parallel group
    whose blocks make up each whole matrix (module docstring)."""

    def __init__(self, store, weight_decay: float = 0.1, tp=None, qkv: str = "split", momentum: float = 0.95,
                 **adam):
        super().__init__(store, weight_decay=weight_decay, **adam)
        self.tp, self.qkv, self.momentum = tp, qkv, momentum
        self.matrices = [s for s in store.specs if is_hidden_matrix(s.decl)]
        muon = store.partition.local(store._runs(self.matrices)) if self.matrices else []   # chunk coordinates
        self.muon_runs = muon
        self.adam_runs = _without(self.runs, muon)
        # every tp rank's blocks: (name, index, offset in its segment of hidden weights), once (metadata)
        mine, at = [], 0
        for spec in self.matrices:
            mine.append((spec.name, tuple(np.asarray(ix) for ix in spec.index), at))
            at += spec.size
        ranks = range(tp.size) if tp is not None and tp.size > 1 else []
        every = [tp.bcast_object(mine, root=j) for j in ranks] or [mine]
        # name -> [(tp rank, index)]: where each rank's block of the matrix sits
        self.blocks = {}
        for j, blocks in enumerate(every):
            for name, index, _ in blocks:
                self.blocks.setdefault(name, []).append((j, index))
        self.widest = {name: max(int(np.prod([len(i) for i in ix])) for _, ix in held)
                       for name, held in self.blocks.items()}

    def step(self, lr: float, grad_scale: float = 1.0) -> None:
        store = self.store
        store.settle()
        self.t += 1
        self._adam(self.adam_runs, lr, grad_scale)
        if self.matrices:
            self._muon(lr, grad_scale)
        store.params_changed()

    def _muon(self, lr: float, grad_scale: float) -> None:
        store, xp, beta = self.store, self.store.backend.xp, self.momentum
        flat, g, m = store.master, store.grad_chunk, self.m                             # (C,) each
        nesterov = xp.zeros_like(flat)                                                  # (C,)
        for run in self.muon_runs:
            m[run] *= beta
            m[run] += (1.0 - beta) * grad_scale * g[run]
            nesterov[run] = (1.0 - beta) * grad_scale * g[run] + beta * m[run]
        full = store.gather_chunks(nesterov) if store.partition.sharded else nesterov   # (P_pad,)
        update = xp.zeros_like(full)                                                     # (P_pad,)
        gather = self.tp is not None and self.tp.size > 1
        for spec in self.matrices:                     # one whole matrix at a time: one all-gather over tp each
            lo, hi = store.offsets[spec.name]
            mine = xp.zeros(self.widest[spec.name], dtype=flat.dtype)                    # (n,) this rank's block
            mine[:hi - lo] = full[lo:hi]
            every = self.tp.allgather(mine[None], axis=0) if gather else mine[None]      # (tp, n)
            W = xp.zeros(spec.decl.shape, dtype=flat.dtype)                              # (in, out) whole
            for j, index in self.blocks[spec.name]:
                shape = tuple(len(i) for i in index)
                W[_ix(xp, index)] = every[j, :int(np.prod(shape))].reshape(shape)
            O = orthogonalised(W, spec.decl.groups, self.qkv)                            # (in, out)
            update[lo:hi] = O[_ix(xp, spec.index)].reshape(-1)
        mine = store.partition.take(xp, update) if store.partition.sharded else update  # (C,)
        keep = 1.0 - lr * self.weight_decay
        for run in self.muon_runs:
            flat[run] *= keep
            flat[run] -= lr * mine[run]


def _ix(xp, index) -> tuple:
    """np.ix_ of a block's global indices, on the arrays' device."""
    grids = np.ix_(*[np.asarray(i) for i in index])
    return grids if xp is np else tuple(xp.asarray(g) for g in grids)


def _without(runs: list, holes: list) -> list:
    """(slice, decayed?) ``runs`` with the ``holes`` slices cut out."""
    out = []
    for run, decays in runs:
        pieces = [(run.start, run.stop)]
        for h in holes:
            pieces = [(a, b) for lo, hi in pieces for a, b in ((lo, min(hi, h.start)), (max(lo, h.stop), hi))
                      if a < b]
        out += [(slice(a, b), decays) for a, b in pieces]
    return out
