"""``trace --fp8``: each linear's quantized operands as a trace keeps
them (``Fp8Recorder``, the layout's FP8 observer): the FP8 bytes and
scales of x, W and dy for every GEMM, as pieces of the logical tensors
(``trace_collect.Piece``) that rank 0 assembles like any traced tensor."""

from __future__ import annotations

import numpy as np

from ..parallel.experts import local_experts
from ..parallel.fp8 import CANONICAL
from .trace_collect import Collector, Observed, Piece

ZERO = np.zeros(1, dtype=np.int64)      # the index of a dimension of length 1


class Fp8Recorder:
    """``trace --fp8``: the layout's FP8 observer (``parallel.fp8``),
    keeping as pieces each linear's quantized operands for every GEMM:
    x, W and dy as their FP8 bytes (uint8, compared exactly) and their
    scales in the recipe's groups (one number, one per row, per tile or
    per block; MX's E8M0 as bytes). Each is oriented as its GEMM
    quantizes it, the contraction last (``ops/fp8_recipes.py``): x
    (N, K_in) forward, x^T (K_in, N) wgrad, W^T (K_out, K_in) forward, W
    (K_in, K_out) dgrad, dy (N, K_out) dgrad, dy^T (K_out, N) wgrad, N =
    the tokens of the step's last micro-batch over every replica
    (sequence-major; B T without --grad-accum). A tensor scale quantizes every
    orientation alike, so its operands are kept once, as the layouts with
    panels quantize them (``parallel.fp8.CANONICAL``). Names:
    ``fp8/<linear>/<role>.<gemm>/bytes`` and ``.../scale``. Where x and dy
    lie comes from the linear (``OperandIndex``) and the ``Collector``'s
    sequences and positions of the micro-batch. An expert's x and dy are
    (N_e, K): the N_e tokens of the micro-batch routed to it over every
    replica, in serial's order (the global token order), placed from the
    routing (``watch``, ``place_experts``; on 3-D an expert's
    intermediate rows are another rank's input rows:
    ``Layout.expert_mid_rows``). A later micro-batch (or a recomputed forward) replaces an
    earlier one: the step keeps its last."""

    def __init__(self, store, collect: Collector, T: int):
        self.store, self.collect, self.T = store, collect, T
        self.seen = {}                 # "fp8/<linear>/<role>.<gemm>" -> (Quantized, OperandIndex, name, role, gemm)
        self.dispatched = {}           # MoE layer -> ((m,) routed token row of each kept entry, (E,) kept, n)
        self.placed = {}               # "h.{i}.moe.experts.{e}" -> ((m_e,) its run rows' places among N_e, N_e)
        self.mid = {}                  # the same for its intermediate rows ("mid": Layout.expert_mid_rows)
        self.watched = []              # the MoE instances whose dispatch is kept

    def watch(self, models: list) -> None:
        """Hook every mixture of experts of ``models`` (``MoE.observe_dispatch``)
        to keep each forward's kept rows, from which ``place_experts`` finds
        where an expert's rows lie among serial's."""
        for model in models:
            for block in model.blocks:
                inner = unwrapped(block)
                moe = unwrapped(getattr(unwrapped(getattr(inner, "block", inner)), "mlp", None))
                if hasattr(moe, "observe_dispatch"):
                    moe.observe_dispatch = self.dispatch_keeper(moe.layer)
                    self.watched.append(moe)

    def unwatch(self) -> None:
        """Give the watched mixtures their own (silent) ``observe_dispatch`` back."""
        for moe in self.watched:
            del moe.observe_dispatch
        self.watched = []

    def dispatch_keeper(self, layer: int):
        def keep(order, kept, n):
            rows = np.asarray(self.collect.parts.backend.to_host(order)) // self.collect.cfg.top_k   # (m,)
            self.dispatched[layer] = (rows, np.asarray(kept).copy(), int(n))
        return keep

    def place_experts(self, world) -> None:
        """Each local expert's rows as it ran them, placed among the N_e
        rows serial runs it on (the micro-batch's tokens routed to it over
        every replica, in global token order): each rank's kept rows per
        expert as global token indices, all-gathered over ``world`` (an
        mpi4py communicator, uncounted: every rank calls this) for N_e and
        the order, and under --ep > 1 over the ep group too, whose ranks
        in turn (the order ``Dispatch`` delivers them) send the expert's
        holder its rows."""
        cfg = self.collect.cfg
        b, canonical = len(self.collect.layout.canonical_seqs), self.collect.canonical_positions(self.T)
        mine = {}                                    # layer -> per expert (m_e,) global token indices
        for layer, (rows, kept, n) in self.dispatched.items():
            tokens = self.tokens(("canonical", "canonical" if n == b * len(canonical) else "gathered"))   # (n,)
            if len(tokens) != n:                     # a layout's bookkeeping, not the user's input
                raise RuntimeError(f"trace --fp8: layer {layer} routed {n} tokens on this rank, "
                                   f"its index {len(tokens)}")
            bounds = np.concatenate([[0], np.cumsum(kept)])
            mine[layer] = [tokens[rows[bounds[e]:bounds[e + 1]]] for e in range(len(kept))]
        everyone = world.allgather(mine)
        ep = self.collect.layout.axes.ep
        sources = ep.mpi.allgather(mine) if ep is not None and ep.size > 1 else [mine]
        held = local_experts(cfg.n_experts, ep) if ep is not None else range(cfg.n_experts)
        self.placed = {}
        for layer in mine:
            for e in held:
                routed = np.unique(np.concatenate([r[layer][e] for r in everyone if layer in r]))   # (N_e,)
                ran = np.concatenate([source[layer][e] for source in sources])                     # (m_e,)
                self.placed[f"h.{layer}.moe.experts.{e}"] = (np.searchsorted(routed, ran), len(routed))
        self.mid = self.placed
        where = self.collect.layout.expert_mid_rows()
        if where is not None:                        # 3-D: another rank's rows (uncounted, like the gathers above)
            comm, source = where
            theirs = comm.mpi.allgather({key: rows for key, (rows, _) in self.placed.items()})[source]
            self.mid = {key: (theirs[key], N) for key, (_, N) in self.placed.items()}

    def __call__(self, name: str, role: str, gemm: str, q, index=None) -> None:
        if q.group == "tensor" and CANONICAL[role] != gemm:
            return                     # the same bytes as the canonical orientation's, transposed
        self.seen[f"fp8/{name}/{role}.{gemm}"] = (q, index, name, role, gemm)

    def take(self, world) -> list:
        """The pieces of the step's quantized operands (collective over
        ``world``, the mpi4py communicator the trace gathers over, where
        the model has experts: ``place_experts``)."""
        if self.collect.cfg.moe:
            self.place_experts(world)
        out = []
        for key, (q, index, name, role, gemm) in self.seen.items():
            out += self.pieces(key, q, index, name, role, gemm)
        self.seen = {}
        return out

    def micro_batch(self) -> tuple:
        """(this replica's index, sequences per replica's micro-batch, replicas)."""
        parts = self.collect.parts
        per_replica = parts.rows.stop - parts.rows.start                   # B / dp sequences
        return parts.rows.start // per_replica, parts.layout.local_batch, self.collect.B // per_replica

    def tokens(self, rows: tuple) -> np.ndarray:
        """(n,) the token index (sequence T + position) of each row of a
        (B_l, T_l, K) operand flattened to (B_l T_l, K), the sequence
        counted in the step's last micro-batch over every replica (the
        step's own without --grad-accum)."""
        c, T, layout = self.collect, self.T, self.collect.layout
        replica, b, _ = self.micro_batch()
        seqs = replica * b + np.asarray(layout.canonical_seqs if rows[0] == "canonical" else layout.mid_seqs)
        pos = c.positions(T) if rows[1] == "gathered" else c.canonical_positions(T)
        return (seqs[:, None] * T + np.asarray(pos)[None, :]).ravel()

    def pieces(self, key, q, index, name, role, gemm) -> list:
        """The bytes and scale pieces of one quantized operand, or only a
        tensor scale where the operand's place is not known (an expert's
        whose routing was not watched)."""
        scale = q.host_scale()                                # host numbers, from a CPU or a GPU run
        if q.group == "tensor":
            out = [Piece(key + "/scale", (1, 1), (ZERO, ZERO), scale.reshape(1, 1).copy())]
        else:
            out = []
        decl = self.store.by_name[name + ".weight"].decl.shape              # W (K_in, K_out)
        if role == "w":
            rows, cols = (np.asarray(ix) for ix in self.store.by_name[name + ".weight"].index)
            first, second = (cols, rows) if gemm == "forward" else (rows, cols)
            shape = (int(decl[1]), int(decl[0])) if gemm == "forward" else (int(decl[0]), int(decl[1]))
        elif index is None or (index.expert and name.rpartition(".")[0] not in self.placed):
            return out
        else:
            cols, width = (index.x_cols, decl[0]) if role == "x" else (index.dy_cols, decl[1])
            n = q.q.shape[1 if gemm == "wgrad" else 0]
            rows = index.x_rows if role == "x" else index.dy_rows
            if index.expert:                                  # its rows, then the layout's zero padding
                tokens, N = (self.mid if rows[0] == "mid" else self.placed)[name.rpartition(".")[0]]
            else:
                tokens = self.tokens(rows)
                _, b, replicas = self.micro_batch()
                N = replicas * b * self.T                     # a micro-batch's tokens over every replica
            if n != len(tokens) and not (index.expert and n > len(tokens)):   # a layout's bookkeeping
                raise RuntimeError(f"trace --fp8: {key} has {n} token rows on this rank, its index {len(tokens)}")
            first, second = (np.asarray(cols), tokens) if gemm == "wgrad" else (tokens, np.asarray(cols))
            shape = (int(width), N) if gemm == "wgrad" else (N, int(width))
        local = q.host_bytes()[:len(first), :len(second)].copy()          # a short last tile's padding dropped
        out.append(Piece(key + "/bytes", shape, (first, second), local))
        if q.group == "tensor":
            return out
        if q.group == "row":
            sindex, gshape = (first, ZERO), (shape[0], 1)
        elif q.group[0] == "block":
            b = q.group[1]
            sindex, gshape = (first[::b] // b, second[::b] // b), (-(-shape[0] // b), -(-shape[1] // b))
        else:                                                 # 1 x b tiles or MX blocks along the contraction
            b = q.group[1]
            sindex, gshape = (first, second[::b] // b), (shape[0], -(-shape[1] // b))
        out.append(Piece(key + "/scale", gshape, sindex, scale[:len(sindex[0]), :len(sindex[1])].copy()))
        return out


def unwrapped(piece):
    """A model piece without the trace's ``Observed`` wrappers."""
    while isinstance(piece, Observed):
        piece = piece.inner
    return piece
