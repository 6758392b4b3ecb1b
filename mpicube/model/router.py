"""A mixture of experts' router ledger (``Micro.router``): one micro-batch's
routing statistics, layer by layer, summed over the ranks that hold the
micro-batch's other tokens, and the router losses (load balancing, z) with
their gradients; also the capacity's global token order (``offsets``).
Why its own module: the losses couple every token of a micro-batch and
every layer (transformers' ``load_balancing_loss_func`` concatenates all
layers' logits), so the ledger belongs to the micro-batch, not to a layer
(``moe.MoE`` records into it and reads it back); docs/moe.md has the
formulas.
"""

from __future__ import annotations

from ..core.config import ModelConfig
from ..device.arrays import array_module
from ..parallel.context import local_positions, ulysses_of


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
        self.n_moe = cfg.n_layer - cfg.first_k_dense                  # L: the layers with a mixture
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
            hits[:, xp.asarray(local_positions(T, g, c, ulysses_of(ring)))] = one
        flat = hits.reshape(B * T, E)                                            # (B T, E) in global order
        before = (xp.cumsum(flat, axis=0) - flat).reshape(B, T, E)               # choosers before each token
        mine = before[:, xp.asarray(local_positions(T, g, ring.rank, ulysses_of(ring)))].reshape(n, E)   # (n, E)
        place = xp.take_along_axis(mine, chosen.astype(xp.int64), axis=1)        # (n, K)
        return place.reshape(-1).astype(xp.int64), flat.sum(axis=0)

    def record(self, layer: int, counts, probs, lse, dropped, z_sum=None) -> None:
        """Layer ``layer``'s local statistics (a rerun overwrites them with
        the same values). ``z_sum`` in place of lse's squares: the sigmoid
        router's share of its sequence-wise auxiliary loss (model/routers.py)."""
        xp = array_module(probs)
        z = (lse * lse).sum()[None] if z_sum is None else xp.asarray([z_sum], dtype=probs.dtype)
        self.stats[layer] = xp.concatenate([counts.astype(probs.dtype), probs.sum(axis=0),
                                            z, xp.asarray([dropped], dtype=probs.dtype)])

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
        self.layers = sorted(self.stats)
        return self.aux_term() + self.z_term() + self.seq_aux_term()

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
        rows = [self.stats.get(k, xp.zeros_like(some)) for k in range(self.cfg.n_blocks)]   # MTP's blocks too
        self._pending, self._replicas = iallreduce(comm, xp.stack(rows)), replicas    # (L, 2 E + 2)
        self.layers = list(range(self.cfg.n_blocks))

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
        if self.cfg.router == "sigmoid":        # its statistics are sigmoid scores, not probabilities
            return 0.0
        c, S, _ = self._sums()
        LN = self.n_moe * self.micro_tokens
        return float(self.cfg.n_experts * (c * S).sum() / (LN * LN))

    def aux_term(self) -> float:
        return self.cfg.router_aux_loss_coef * self.aux_loss() / self.grad_accum

    def seq_aux_loss(self) -> float:
        """The sigmoid router's sequence-wise auxiliary loss of this
        micro-batch, its coefficient in (the z column's sum under that router)."""
        if self.cfg.router != "sigmoid":
            return 0.0
        return float(self._sums()[2])

    def seq_aux_term(self) -> float:
        return self.seq_aux_loss() / self.grad_accum

    def loads(self) -> dict:
        """{layer: (E,) tokens that chose each expert} over the group (after finish or wait)."""
        counts = self.counts()
        return {layer: counts[r] for r, layer in enumerate(self.layers)}

    def z_loss(self) -> float:
        """This micro-batch's z-loss: its rows' mean logsumexp^2 over every layer."""
        if self.cfg.router == "sigmoid":
            return 0.0
        _, _, z = self._sums()
        return float(z) / (self.n_moe * self.micro_tokens)

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
        LN = self.n_moe * self.micro_tokens
        return c * (self.scale * coef * self.cfg.n_experts / (self.grad_accum * LN * LN))

    def dlse(self, lse):
        """(n,) the z-loss's gradient on each row's log-sum-exp, or None."""
        coef = self.cfg.router_z_loss_coef
        if not coef:
            return None
        return lse * (self.scale * coef * 2.0 / (self.n_moe * self.micro_tokens * self.grad_accum))
