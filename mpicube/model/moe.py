"""The mixture of experts that replaces a Llama block's MLP when
``cfg.n_experts`` > 0 (``--n-experts``, ``--arch mixtral``): a router
linear (hidden -> E, no bias, in float32 or wider), top-k routing with
Mixtral's weights, E SwiGLU experts, and the two router losses (the
load-balancing loss and the z-loss) whose gradients the block's backward
adds by hand. docs/moe.md has the formulas, the tie-break and the drop rule.

Parameters, one tensor per expert so that a file's per-expert tensors and
an expert-parallel rank's experts map one to one:

    h.{i}.moe.router.weight              (h, E)     x @ W, like every mpicube linear
    h.{i}.moe.experts.{e}.c_fc.weight    (h, 2 F)   columns [gate | up] (HF's w1 | w3, transposed)
    h.{i}.moe.experts.{e}.c_proj.weight  (F, h)     HF's w2, transposed
    h.{i}.moe.shared.c_fc.weight         (h, 2 S)   --n-shared-experts: S = n_shared x F, [gate | up]
    h.{i}.moe.shared.c_proj.weight       (S, h)

F is --moe-ffn-hidden (``cfg.moe_ffn``). The router is an object chosen
once (``routers.router_of``: Mixtral's softmax or DeepSeek-V3's sigmoid
with a bias buffer ``h.{i}.moe.router.score_bias`` (E,), not a parameter);
the shared experts are a dense SwiGLU MLP (``mlp.DenseMLP``) on the
block's canonical activations, sharded as every layout shards the dense
MLP, added to the routed output.

The router losses couple every token of a micro-batch and every layer
(transformers' ``load_balancing_loss_func`` concatenates all layers'
logits), so a micro-batch carries a ``RouterLedger`` (``router.py``, ``Micro.router``):
each MoE layer records its counts and sums there in forward, the step
driver sums them over the replicas that hold other tokens (``finish``)
before any backward, and each layer's backward reads the totals.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import ops
from ..core.config import ModelConfig
from ..device import precision
from ..device.arrays import array_module
from ..ops import moe as router_ops
from ..parallel.experts import Dispatch, local_experts
from ..parallel.layouts.base import COLUMN, ROW, Layout
from ..parallel.params import ParamDecl, ParamStore
from .router import RouterLedger  # noqa: F401 (moe.RouterLedger: the ledger the block's MoE records into)
from .mlp import DenseMLP, SwiGLU
from .moe_experts import LocalExperts
from .routers import router_of
from .tape import Saved


@dataclass
class MoETape(Saved):
    """What ``MoE`` keeps for backward."""

    x2: object              # (n, h) the routed tokens (whole sequences under a sequence split)
    route: object           # the router's tape (routers.SoftmaxRouter, SigmoidRouter)
    order: object           # (m,) the kept (token, slot) pairs in expert order
    bounds: object          # (E + 1,) each expert's run of ``order``
    dispatch: object        # parallel.experts.Dispatch: the all-to-all's counts
    runs: object            # the local experts' saved activations
    y_back: object          # (m, h) the experts' outputs, back in ``order``'s order
    ledger: object          # the micro-batch's RouterLedger, or None
    shape: tuple            # x's (B, T, h)
    shared: object = None   # the shared experts' (mlp.MLPTape), or None


def expert_names(cfg: ModelConfig, i: int):
    """Layer i's MoE parameter suffixes in declaration order (after ``h.{i}.``)."""
    yield "moe.router.weight"
    for e in range(cfg.n_experts):
        yield f"moe.experts.{e}.c_fc.weight"
        yield f"moe.experts.{e}.c_proj.weight"
    if cfg.n_shared_experts:
        yield "moe.shared.c_fc.weight"
        yield "moe.shared.c_proj.weight"


def moe_params(cfg: ModelConfig, i: int, std: float, resid_std: float) -> list:
    """Layer i's router and experts, with the MLP's init rule."""
    h, F, p = cfg.n_embd, cfg.moe_ffn, f"h.{i}.moe."
    decls = [ParamDecl(p + "router.weight", (h, cfg.n_experts), "router", "normal", std, decay=True)]
    for e in range(cfg.n_experts):
        decls += [ParamDecl(f"{p}experts.{e}.c_fc.weight", (h, 2 * F), "w_column", "normal", std, decay=True,
                            groups=2),
                  ParamDecl(f"{p}experts.{e}.c_proj.weight", (F, h), "w_row", "normal", resid_std, decay=True)]
    if cfg.n_shared_experts:
        S = F * cfg.n_shared_experts                                   # HF's shared_experts' intermediate size
        decls += [ParamDecl(p + "shared.c_fc.weight", (h, 2 * S), "w_column", "normal", std, decay=True, groups=2),
                  ParamDecl(p + "shared.c_proj.weight", (S, h), "w_row", "normal", resid_std, decay=True)]
    return decls


class MoE:
    """Layer ``i``'s mixture of experts on canonical activations (B_c, T,
    C_c). Forward: router logits in float32 or wider, top-k, the kept
    (token, expert) rows sent to the ranks holding their experts
    (``parallel.experts.Dispatch``; the identity without --ep), each local
    expert's SwiGLU on its rows (``moe_experts.LocalExperts``: the own rows
    while the others travel, where the layout allows), the outputs sent
    back, weighted and summed per token in expert order. Backward runs the
    same in reverse, computing the router's backward while the experts'
    input gradients travel back, and adds the router losses' gradients
    from the micro-batch's ledger.

    The layout enters at two seams. The router: where the canonical form
    splits the hidden columns (2-D, 2.5-D, 3-D: ``layout.hidden_comm``)
    this rank holds the router's rows of its columns, and the logits are
    the sum of the partial products over the hidden group (``_logits``),
    so every rank holding the same tokens routes them identically; so is
    backward's gradient of the routing weights (a dot product over the
    hidden columns); the router's input gradient needs no sum (each
    rank's columns), its weight's is summed over the ranks with other
    tokens (its ParamSpec). The experts:
    an expert's rows on this rank are a small batch of canonical rows,
    which enter the layout's first and second linears like an MLP's, as
    (rows, 1, C_c); ``layout.expert_rows`` says how many rows each runs
    on (zero padding where its collectives need equal shapes) and whether
    an expert with none still runs.

    A third seam where the canonical form splits the sequence (1-D under
    --sequence-parallel: ``layout.sequence_comm``): the mixture routes the
    gathered sequences, as the dense MLP's c_fc computes on them. Forward
    all-gathers x along T (every tp rank then routes the same tokens, so
    the ledger, the capacity's order and the dispatch are plain 1-D's),
    the experts' linears give partial sums (``layout.expert_linear``), and
    the weighted sum of all experts is reduce-scattered along T once.
    Backward all-gathers dy, sums the routing weights' gradient (a dot
    product with the partial outputs) over the group, reduce-scatters the
    experts' partial input gradients and adds the router's (complete on
    every rank) at this rank's positions."""

    def __init__(self, layout: Layout, store: ParamStore, i: int):
        cfg = layout.cfg
        p = f"h.{i}.moe."
        self.cfg, self.layer, self.store = cfg, i, store
        self.router_name = p + "router.weight"
        self.w_router = store.work[self.router_name]                              # (h, E)
        store.defer_zero(self.router_name)
        self.ep = layout.axes.ep if layout.axes.ep is not None else SELF
        self.layout, self.hidden, self.seq = layout, layout.hidden_comm, layout.sequence_comm
        self.local = local_experts(cfg.n_experts, self.ep)                        # this rank's experts
        self.router = router_of(cfg, i, store, layout, p)                         # softmax or sigmoid
        self.shared = (DenseMLP(layout, store, p + "shared", SwiGLU, bias=False)   # always-on, like the dense MLP
                       if cfg.n_shared_experts else None)
        self.local_experts = LocalExperts(layout, [(layout.expert_linear(store, f"{p}experts.{e}.c_fc", COLUMN),
                                                    layout.expert_linear(store, f"{p}experts.{e}.c_proj", ROW))
                                                   for e in self.local], store.backend)

    def forward(self, x, ctx):
        """x (B, T, h) -> (y (B, T, h), saved); T/p of them under a sequence split."""
        cfg, E, K = self.cfg, self.cfg.n_experts, self.cfg.top_k
        xp = array_module(x)
        shared_y = s_shared = None
        if self.shared is not None:
            shared_y, s_shared = self.shared.forward(x, ctx)                      # (B, T, h), T/p under a split
        if self.seq is not None:
            x = self.seq.allgather(x, axis=1)                                     # (B, T, h) whole sequences
        B, T, h = x.shape
        n = B * T
        x2 = x.reshape(n, h)                                                      # (n, h)
        wide = precision.compute_dtype(x.dtype)
        logits = self._logits(x2, wide)                                           # (n, E) float32+
        ledger = getattr(ctx, "router", None)
        chosen, weights, s_route = self.router.route(logits, ctx)                 # (n, K) each
        self.observe(logits, chosen, weights, s_route)
        cap = offset = None
        if cfg.capacity_factor:
            counts = xp.bincount(chosen.reshape(-1), minlength=E)                 # (E,)
            micro_tokens = n if ledger is None else ledger.micro_tokens
            cap = router_ops.capacity(cfg.capacity_factor, K, micro_tokens, E)
            offset, place = (None, None) if ledger is None else ledger.offsets(counts, chosen)
        else:
            place = None
        order, expert, counts = router_ops.dispatch(chosen, E, cap, offset, place)   # (m,), (m,), (E,)
        if ledger is not None:
            self.router.record(ledger, counts, s_route, n * K - order.shape[0])
        kept = np.asarray(self.store.backend.to_host(xp.bincount(expert, minlength=E)), dtype=np.int64)  # (E,)
        self.observe_dispatch(order, kept, n)
        route = Dispatch(self.ep, kept, E)
        if ledger is not None:
            ledger.routes[self.layer] = (route.send_counts, route.recv_counts)
        y_back, runs, pad = self.local_experts.forward(route, x2[order // K])   # (m, h) in ``order``'s order
        if ledger is not None:
            ledger.padded[self.layer] = pad
        out = xp.zeros((n, h), dtype=wide)                                        # (n, h)
        w_kept = weights.reshape(-1)[order]                                       # (m,)
        bounds = np.concatenate([[0], np.cumsum(kept)])                           # (E + 1,)
        for e in range(E):                                                        # each token's sum in expert order
            seg = slice(int(bounds[e]), int(bounds[e + 1]))
            out[order[seg] // K] += w_kept[seg, None] * y_back[seg]
        saved = MoETape(x2, s_route, order, bounds, route, runs, y_back, ledger, x.shape, s_shared)
        if self.seq is not None:                                                  # partial sums over tp
            out = self.seq.reduce_scatter(out.reshape(B, T, h), axis=1, wire=x.dtype).astype(wide, copy=False)
            y = precision.narrow(out, x.dtype)                                    # (B, T/p, h)
        else:
            y = precision.narrow(out, x.dtype).reshape(B, T, h)
        return (y if shared_y is None else y + shared_y), saved

    def observe(self, logits, chosen, weights, route=None) -> None:
        """The router's decisions of this forward - logits (n, E), chosen
        (n, K), weights (n, K) and the router's tape ``route`` (a sigmoid
        router's holds its scores) - offered to an observer: nothing here;
        a trace replaces it on the instance (analysis/trace_collect.py) to
        record them without the model knowing it is watched."""

    def observe_dispatch(self, order, kept, n: int) -> None:
        """The rows this forward sends to the experts - ``order`` (m,) the
        kept (token, slot) pairs in expert order (token = entry // top_k,
        a row of this rank's (n, h) routed tokens), ``kept`` (E,) each
        expert's run of them - offered to an observer: nothing here; trace
        --fp8 replaces it on the instance (analysis/trace_fp8.py) to place
        each expert's quantized rows among the tokens serial routes to it."""

    def backward(self, dy, saved):
        """dy (B, T, h) -> dx (B, T, h), T/p of them under a sequence split;
        adds every local expert's and the router's gradients."""
        x2, s_route, order, bounds = saved.x2, saved.route, saved.order, saved.bounds
        route, runs, y_back, ledger, shape = saved.dispatch, saved.runs, saved.y_back, saved.ledger, saved.shape
        xp = array_module(dy)
        dx_shared = None if self.shared is None else self.shared.backward(dy, saved.shared)   # (B, T, h) as dy
        if self.seq is not None:
            dy = self.seq.allgather(dy, axis=1)                                   # (B, T, h)
        K, E = self.cfg.top_k, self.cfg.n_experts
        n, h = x2.shape
        wide = precision.compute_dtype(dy.dtype)
        dyt = dy.reshape(n, h)[order // K]                                        # (m, h)
        w_kept = self.router.weights_of(s_route).reshape(-1)[order]               # (m,)
        dweights = xp.zeros(n * K, dtype=w_kept.dtype)                            # (n K,)
        dweights[order] = ops.rowdot(precision.up(dyt), precision.up(y_back))   # over this rank's columns
        dweights = self._hidden_sum(dweights)                                     # (n K,) over every column
        dweights = self._ordered_sum(self.seq, dweights)                          # over the experts' F shards
        dx_own, pending = self.local_experts.backward_start(route, precision.narrow(dyt * w_kept[:, None], dy.dtype),
                                                            runs)
        # the router's backward (its losses' gradients too), while the experts' input gradients travel back
        dlogits = self.router.backward(dweights.reshape(n, K), s_route, ledger)  # (n, E)
        self.store.add_matmul(self.router_name, x2.T, precision.narrow(dlogits, x2.dtype))
        d_router = precision.matmul(dlogits, self.w_router.T.astype(dlogits.dtype), dtype=wide)   # (n, h)
        dx_back = route.sent(dx_own, pending.wait())                              # (m, h)
        dx = xp.zeros((n, h), dtype=wide)                                         # (n, h)
        for e in range(E):
            seg = slice(int(bounds[e]), int(bounds[e + 1]))
            dx[order[seg] // K] += dx_back[seg]
        if self.seq is not None:                    # the experts' part partial over tp, the router's complete
            B, T = shape[0], shape[1]
            part = self.seq.reduce_scatter(dx.reshape(shape), axis=1, wire=dy.dtype).astype(wide, copy=False)
            t, Tl = self.seq.rank, T // self.seq.size
            dx = precision.narrow(part + d_router.reshape(shape)[:, t * Tl:(t + 1) * Tl], dy.dtype)   # (B, T/p, h)
        else:
            dx += d_router
            dx = precision.narrow(dx, dy.dtype).reshape(shape)
        return dx if dx_shared is None else dx + dx_shared

    def _logits(self, x2, wide):
        """x2 (n, C_c) -> the router's logits (n, E) in ``wide``: x2 times
        this rank's rows of W_router, summed over the hidden group (its
        partial products gathered and added in rank order, so every rank
        of the group holds the same logits to the last bit)."""
        return self._hidden_sum(precision.matmul(x2, self.w_router, dtype=wide))  # (n, E)

    def _hidden_sum(self, part):
        """part (...) over this rank's hidden columns -> the sum over the
        hidden group (the identity where the canonical form holds every
        column), the same on every rank of the group: the partials are
        gathered and added in rank order, never reduced in MPI's order."""
        return self._ordered_sum(self.hidden, part)

    @staticmethod
    def _ordered_sum(comm, part):
        """part (...) summed over ``comm`` (None: the identity), bitwise the
        same on every rank: gathered and added in rank order."""
        if comm is None or comm.size == 1:
            return part
        return comm.allgather(part[None], axis=0).sum(axis=0)

    def decode(self, x):
        """Inference without a ledger (generation): x (B, t, h) -> (B, t, h)."""
        return self.forward(x, None)[0]


class _Alone:
    """A group of one rank (no --ep): the dispatch's exchanges are the identity."""

    size, rank, axis = 1, 0, "ep"


SELF = _Alone()
