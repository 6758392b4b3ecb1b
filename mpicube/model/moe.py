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

The router losses couple every token of a micro-batch and every layer
(transformers' ``load_balancing_loss_func`` concatenates all layers'
logits), so a micro-batch carries a ``RouterLedger`` (``Micro.router``):
each MoE layer records its counts and sums there in forward, the step
driver sums them over the replicas that hold other tokens (``finish``)
before any backward, and each layer's backward reads the totals.
"""

from __future__ import annotations

import numpy as np

from .. import ops
from ..core.config import ModelConfig
from ..device import precision
from ..device.arrays import array_module
from ..ops import moe as router_ops
from ..parallel.context import local_positions
from ..parallel.experts import Dispatch, local_experts
from ..parallel.layouts.base import Layout
from ..parallel.params import ParamDecl, ParamStore
from .moe_experts import LocalExperts


def expert_names(cfg: ModelConfig, i: int):
    """Layer i's MoE parameter suffixes in declaration order (after ``h.{i}.``)."""
    yield "moe.router.weight"
    for e in range(cfg.n_experts):
        yield f"moe.experts.{e}.c_fc.weight"
        yield f"moe.experts.{e}.c_proj.weight"


def moe_params(cfg: ModelConfig, i: int, std: float, resid_std: float) -> list:
    """Layer i's router and experts, with the MLP's init rule."""
    h, F, p = cfg.n_embd, cfg.ffn, f"h.{i}.moe."
    decls = [ParamDecl(p + "router.weight", (h, cfg.n_experts), "router", "normal", std, decay=True)]
    for e in range(cfg.n_experts):
        decls += [ParamDecl(f"{p}experts.{e}.c_fc.weight", (h, 2 * F), "w_first", "normal", std, decay=True,
                            groups=2),
                  ParamDecl(f"{p}experts.{e}.c_proj.weight", (F, h), "w_second", "normal", resid_std, decay=True)]
    return decls


class RouterLedger:
    """One micro-batch's routing statistics, layer by layer, and the router
    losses they define. ``group`` is the communicator of the replicas that
    hold the micro-batch's other tokens (dp), in global token order,
    ``tokens`` those of the replica's tensor-parallel group that hold its
    other sequences (2-D, 2.5-D, 3-D: ``Layout.token_comm``), ranked in
    sequence order, and ``ring`` the context-parallel ranks that hold the
    sequences' other positions (--cp); ranks that hold the same tokens
    record the same.

    The load-balancing loss, as transformers computes it over all L layers'
    N tokens at once: aux = E sum_e c_e S_e / (L N)^2, c_e the times expert
    e is among a token's top-k (no gradient), S_e the sum of its router
    probabilities. The z-loss: z = sum over layers and tokens of
    logsumexp(logits)^2 / (L N). Under --grad-accum A each micro-batch's
    aux counts its own tokens and the step's is their mean; z is a mean
    over the step's tokens either way."""

    def __init__(self, cfg: ModelConfig, group, micro_tokens: int, grad_accum: int, tokens=None, ring=None,
                 seq_len: int = 0):
        self.cfg, self.group, self.seq_len = cfg, group, seq_len     # seq_len: T, whole (cp cuts it)
        self.tokens = tokens            # the tp ranks with the replica's other sequences (Layout.token_comm), or None
        self.ring = ring                # the cp ranks with the sequences' other positions (--cp), or None
        self.micro_tokens, self.grad_accum = micro_tokens, grad_accum    # N of one micro-batch, all replicas
        self.stats = {}                 # layer -> (2 E + 2,) this rank's [counts | prob sums | z sum | dropped]
        self.routes = {}                # layer -> (rows sent to, rows received from, each ep rank) (g,) each
        self.padded = {}                # layer -> zero rows this rank's experts ran on (Layout.expert_rows; 3-D)
        self.totals = None              # after finish: (L_here, 2 E + 2) summed over the group
        self.scale = 1.0                # the loss scale backward runs under (float16)

    # --- forward -------------------------------------------------------------------
    def offsets(self, counts, chosen):
        """(offset, place): offset (E,) choosers of each expert on the
        ranks with earlier sequences or replicas (the capacity's global
        token order), or None alone; place (n K,) under --cp, each local
        choice's place among its expert's choosers over the cp ranks
        (their positions interleave), else None."""
        place, total = None, counts.astype("float64")                             # (E,) exact integers
        if self.ring is not None and self.ring.size > 1:
            place, total = self.ring_places(chosen)
        before = None
        for comm in (self.tokens, self.group):      # earlier sequences of the replica, then earlier replicas
            if comm is None or comm.size == 1:
                continue
            every = comm.allgather(total[None], axis=0)                          # (size, E)
            mine = every[:comm.rank].sum(axis=0)                                 # (E,)
            before = mine if before is None else before + mine
            total = every.sum(axis=0)                                            # (E,) the whole group's
        return (None if before is None else before.astype(counts.dtype)), place

    def ring_places(self, chosen):
        """((n K,) place of each local choice among its expert's choosers
        in the cp ring's tokens, sequence then position order; (E,) the
        ring's choosers of each expert), from one all-gather of the
        choices (n K numbers a rank) over the ring."""
        xp, ring, E = array_module(chosen), self.ring, self.cfg.n_experts
        n, K = chosen.shape
        T, g = self.seq_len, ring.size
        B, Tc = n // (T // g), T // g                                            # this rank: (B, Tc) tokens
        every = ring.allgather(chosen.astype("float64")[None], axis=0)           # (g, n, K)
        hits = xp.zeros((B, T, E))                                               # (B, T, E) choosers, all positions
        for c in range(g):
            one = (every[c].reshape(B, Tc, K)[..., None] == xp.arange(E)).sum(axis=2)   # (B, Tc, E)
            hits[:, xp.asarray(local_positions(T, g, c))] = one
        flat = hits.reshape(B * T, E)                                            # (B T, E) in global order
        before = (xp.cumsum(flat, axis=0) - flat).reshape(B, T, E)               # choosers before each token
        mine = before[:, xp.asarray(local_positions(T, g, ring.rank))].reshape(n, E)   # (n, E)
        place = xp.take_along_axis(mine, chosen.astype(xp.int64), axis=1)        # (n, K)
        return place.reshape(-1).astype(xp.int64), flat.sum(axis=0)

    def record(self, layer: int, counts, probs, lse, dropped) -> None:
        """Layer ``layer``'s local statistics (a rerun overwrites them with the same values)."""
        xp = array_module(probs)
        self.stats[layer] = xp.concatenate([counts.astype(probs.dtype), probs.sum(axis=0),
                                            (lse * lse).sum()[None], xp.asarray([dropped], dtype=probs.dtype)])

    def finish(self) -> float:
        """Sum the statistics over the group (one all-reduce) and return
        the micro-batch's router loss terms, ready to add to its share of
        the step's mean loss: coef_aux aux / A + coef_z z_share."""
        xp = array_module(next(iter(self.stats.values())))
        local = xp.stack([self.stats[k] for k in sorted(self.stats)])            # (L_here, 2 E + 2)
        for comm in (self.tokens, self.ring, self.group):
            if comm is not None and comm.size > 1:
                local = comm.allreduce(local)
        self.totals = local
        return self.aux_term() + self.z_term()

    def start(self, comm, replicas: int):
        """Pipeline stages (``training.pipeline``): start summing this
        stage's statistics (every layer's row, zero for the layers other
        stages hold) over ``comm`` (the world) without waiting; ``replicas``
        ranks (the tp group) hold each sum, so ``wait`` divides by it. Every
        stage starts after its last forward of the micro-batch and waits at
        its first backward of it, by when every stage has started."""
        from ..parallel.comm_start import iallreduce

        xp = array_module(next(iter(self.stats.values())))
        some = next(iter(self.stats.values()))
        rows = [self.stats.get(k, xp.zeros_like(some)) for k in range(self.cfg.n_layer)]
        self._pending, self._replicas = iallreduce(comm, xp.stack(rows)), replicas    # (L, 2 E + 2)

    def wait(self) -> None:
        """The totals of ``start``'s sum (once; later calls do nothing)."""
        if getattr(self, "_pending", None) is not None:
            self.totals = self._pending.wait() / self._replicas
            self._pending = None

    def _sums(self):
        E = self.cfg.n_experts
        t = self.totals.sum(axis=0)                                              # (2 E + 2,)
        return t[:E], t[E:2 * E], t[2 * E]

    def aux_loss(self) -> float:
        """This micro-batch's load-balancing loss (before its coefficient)."""
        c, S, _ = self._sums()
        LN = self.cfg.n_layer * self.micro_tokens
        return float(self.cfg.n_experts * (c * S).sum() / (LN * LN))

    def aux_term(self) -> float:
        return self.cfg.router_aux_loss_coef * self.aux_loss() / self.grad_accum

    def z_loss(self) -> float:
        """This micro-batch's z-loss: its rows' mean logsumexp^2 over every layer."""
        _, _, z = self._sums()
        return float(z) / (self.cfg.n_layer * self.micro_tokens)

    def z_term(self) -> float:
        """coef_z x this micro-batch's share of the step's z-loss."""
        return self.cfg.router_z_loss_coef * self.z_loss() / self.grad_accum

    def counts(self):
        """(L_here, E) how many tokens chose each expert, per layer (all replicas)."""
        return self.totals[:, :self.cfg.n_experts]

    def dropped(self):
        """(L_here,) chosen (token, expert) pairs a capacity dropped, per layer."""
        return self.totals[:, -1]

    # --- backward ------------------------------------------------------------------
    def dprobs(self):
        """(E,) the aux loss's gradient on every router probability of every
        layer and token: coef E c_e / (A (L N)^2), times the loss scale; None without it."""
        coef = self.cfg.router_aux_loss_coef
        if not coef:
            return None
        c, _, _ = self._sums()
        LN = self.cfg.n_layer * self.micro_tokens
        return c * (self.scale * coef * self.cfg.n_experts / (self.grad_accum * LN * LN))

    def dlse(self, lse):
        """(n,) the z-loss's gradient on each row's log-sum-exp, or None."""
        coef = self.cfg.router_z_loss_coef
        if not coef:
            return None
        return lse * (self.scale * coef * 2.0 / (self.cfg.n_layer * self.micro_tokens * self.grad_accum))


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
    an expert with none still runs."""

    def __init__(self, layout: Layout, store: ParamStore, i: int):
        cfg = layout.cfg
        p = f"h.{i}.moe."
        self.cfg, self.layer, self.store = cfg, i, store
        self.router_name = p + "router.weight"
        self.w_router = store.work[self.router_name]                              # (h, E)
        store.defer_zero(self.router_name)
        self.ep = layout.axes.ep if layout.axes.ep is not None else SELF
        self.layout, self.hidden = layout, layout.hidden_comm
        self.local = local_experts(cfg.n_experts, self.ep)                        # this rank's experts
        self.local_experts = LocalExperts(layout, [(layout.linear(store, f"{p}experts.{e}.c_fc", "first", bias=False),
                                                    layout.linear(store, f"{p}experts.{e}.c_proj", "second",
                                                                  bias=False))
                                                   for e in self.local], store.backend)

    def forward(self, x, ctx):
        """x (B, T, h) -> (y (B, T, h), saved)."""
        cfg, E, K = self.cfg, self.cfg.n_experts, self.cfg.top_k
        xp = array_module(x)
        B, T, h = x.shape
        n = B * T
        x2 = x.reshape(n, h)                                                      # (n, h)
        wide = precision.compute_dtype(x.dtype)
        logits = self._logits(x2, wide)                                           # (n, E) float32+
        probs, chosen, weights, lse, s_route = router_ops.route(logits, K, cfg.norm_topk)
        self.observe(logits, chosen, weights)
        ledger = getattr(ctx, "router", None)
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
            ledger.record(self.layer, counts, probs, lse, n * K - order.shape[0])
        kept = np.asarray(self.store.backend.to_host(xp.bincount(expert, minlength=E)), dtype=np.int64)  # (E,)
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
        saved = (x2, s_route, order, bounds, route, runs, y_back, ledger, x.shape)
        return precision.narrow(out, x.dtype).reshape(B, T, h), saved

    def observe(self, logits, chosen, weights) -> None:
        """The router's decisions of this forward - logits (n, E), chosen
        (n, K), weights (n, K) - offered to an observer: nothing here; a
        trace replaces it on the instance (analysis/trace_collect.py) to
        record them without the model knowing it is watched."""

    def backward(self, dy, saved):
        """dy (B, T, h) -> dx (B, T, h); adds every local expert's and the router's gradients."""
        x2, s_route, order, bounds, route, runs, y_back, ledger, shape = saved
        xp = array_module(dy)
        K, E = self.cfg.top_k, self.cfg.n_experts
        n, h = x2.shape
        wide = precision.compute_dtype(dy.dtype)
        dyt = dy.reshape(n, h)[order // K]                                        # (m, h)
        w_kept = s_route[2].reshape(-1)[order]                                    # (m,)
        dweights = xp.zeros(n * K, dtype=s_route[0].dtype)                        # (n K,)
        dweights[order] = ops.rowdot(precision.up(dyt), precision.up(y_back))   # over this rank's columns
        dweights = self._hidden_sum(dweights)                                     # (n K,) over every column
        dx_own, pending = self.local_experts.backward_start(route, precision.narrow(dyt * w_kept[:, None], dy.dtype),
                                                            runs)
        dprobs = dlse = None            # the router's backward, while the experts' input gradients travel back
        if ledger is not None:
            dprobs, dlse = ledger.dprobs(), ledger.dlse(s_route[4])
        dlogits = router_ops.route_backward(dweights.reshape(n, K), s_route, dprobs, dlse)   # (n, E)
        self.store.add_matmul(self.router_name, x2.T, precision.narrow(dlogits, x2.dtype))
        d_router = precision.matmul(dlogits, self.w_router.T.astype(dlogits.dtype), dtype=wide)   # (n, h)
        dx_back = route.sent(dx_own, pending.wait())                              # (m, h)
        dx = xp.zeros((n, h), dtype=wide)                                         # (n, h)
        for e in range(E):
            seg = slice(int(bounds[e]), int(bounds[e + 1]))
            dx[order[seg] // K] += dx_back[seg]
        dx += d_router
        return precision.narrow(dx, dy.dtype).reshape(shape)

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
        if self.hidden is None or self.hidden.size == 1:
            return part
        return self.hidden.allgather(part[None], axis=0).sum(axis=0)

    def decode(self, x):
        """Inference without a ledger (generation): x (B, t, h) -> (B, t, h)."""
        return self.forward(x, None)[0]


class _Alone:
    """A group of one rank (no --ep): the dispatch's exchanges are the identity."""

    size, rank, axis = 1, 0, "ep"


SELF = _Alone()
