"""What a trace records from one rank: its blocks of the activations,
logits, dropout masks and parameters as pieces with their global indices
(``Collector``), gathered to rank 0 or kept per rank (``gather_pieces``);
and the observer that sees the model's activations without the model
knowing (``Observed``, ``record_outputs``). ``trace.py`` runs the trainer
with the recorder and writes the file."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..check import placements, shards
from ..model.gpt import Head
from ..parallel import context
from ..training.driver import rank_positions


# --------------------------------------------------------------------------- gathering blocks


@dataclass
class Piece:
    """One rank's block of a logical tensor: ``local[i0, i1, ...]`` is the
    element at ``(index[0][i0], index[1][i1], ...)``; indices at or past
    ``shape`` (vocabulary padding) are dropped."""

    name: str             # dataset path in the trace, e.g. "act/h.1"
    shape: tuple          # global logical shape
    index: tuple          # per dimension: global indices of the local block
    local: np.ndarray     # host array


MESH_AXES = ("pp", "dp", "cp", "tp")        # a sharded trace's mesh (check/placements.py): ep is taken from dp


def mesh_of(layout) -> tuple:
    """(axis names, sizes, this rank's coordinates) of the layout's mesh."""
    comms = [getattr(layout.axes, a) for a in MESH_AXES]
    return MESH_AXES, tuple(c.size for c in comms), tuple(c.rank for c in comms)


def gather_pieces(mpi_world, pieces: list, sharded: bool = False, mesh=None):
    """Rank 0: {name: full tensor} assembled from every rank's pieces; other
    ranks: None. Replicated blocks simply arrive more than once; an element
    no rank sent is a bug in a layout's bookkeeping, and raises. With
    ``sharded`` (--sharded) each rank's block is kept as it is, with its
    global index (check.shards), for compare to put together and to check
    the replicas of, and with ``mesh`` (``(sizes, every rank's coords)``)
    each block's placement on the mesh, inferred from the indices
    (check.placements.infer)."""
    received = mpi_world.gather(pieces, root=0)
    if received is None:
        return None
    if sharded:
        return _as_shards(received, mesh)
    full, seen = {}, {}
    for piece in (p for rank_pieces in received for p in rank_pieces):
        if piece.name not in full:
            full[piece.name] = np.zeros(piece.shape, dtype=piece.local.dtype)
            seen[piece.name] = np.zeros(piece.shape, dtype=bool)
        real = [np.flatnonzero(ix < n) for ix, n in zip(piece.index, piece.shape)]
        target = np.ix_(*[np.asarray(ix)[r] for ix, r in zip(piece.index, real)])
        full[piece.name][target] = piece.local[np.ix_(*real)]
        seen[piece.name][target] = True
    for name, mask in seen.items():
        if not mask.all():
            raise RuntimeError(f"trace: {int((~mask).sum())} elements of {name} were held by no rank")
    return full


def _as_shards(received: list, mesh=None) -> dict:
    """{name: Sharded} from every rank's pieces, vocabulary padding dropped;
    with ``mesh`` (sizes, coords by rank), their placements inferred."""
    out = {}
    for rank, rank_pieces in enumerate(received):
        for piece in rank_pieces:
            real = [np.flatnonzero(np.asarray(ix) < n) for ix, n in zip(piece.index, piece.shape)]
            index = tuple(np.asarray(ix)[r] for ix, r in zip(piece.index, real))
            block = piece.local[np.ix_(*real)] if real else piece.local
            out.setdefault(piece.name, shards.Sharded(piece.shape, [])).shards.append(
                shards.Shard(rank, index, block, coords=None if mesh is None else mesh[1][rank]))
    if mesh is not None:
        out = {name: placements.infer(tensor, mesh[0]) for name, tensor in out.items()}
    return out


class Collector:
    """Turns one rank's model state into pieces: global indices of its
    activation, logit, mask and parameter blocks. ``at(first)`` points it
    at a micro-batch whose first sequence is global sequence ``first``."""

    def __init__(self, parts, store_dtype, batch_size: int, sharded: bool = False):
        self.parts = parts
        self.sharded = sharded                               # every replica's copy, not one
        self.layout, self.store = parts.layout, parts.store
        self.dtype = np.dtype(store_dtype)
        self.B = batch_size                                  # global sequences per step
        self.cfg = parts.cfg
        self.cols = np.asarray(self.layout.canonical_cols)
        self.heads = np.asarray(self.layout.head_ids)
        self.param_writer = self.layout.axes.dp.rank == 0 and self.layout.axes.cp.rank == 0
        self.at(parts.micro_rows(0).start)

    @property
    def current(self):
        """(GPT, tape) of the forward that ran last: the model's, or under
        pipeline stages the chunk's (training.pipeline.Pipeline.current);
        each chunk gives the pieces of the tensors it computes, so rank 0
        assembles the same names as without stages."""
        pipe = self.parts.pipeline
        if pipe is not None:
            return pipe.current
        return self.parts.model.model, self.parts.model.tape

    def at(self, first: int) -> None:
        layout = self.layout
        self.first = first
        self.canonical_seqs = first + np.asarray(layout.canonical_seqs)
        self.mid_seqs = first + np.asarray(layout.mid_seqs)

    def positions(self, T: int) -> np.ndarray:
        """(T_l,) the global positions of this rank's rows of a T-long
        sequence: all of them, or a cp rank's two chunks."""
        ring = self.layout.axes.cp
        return context.local_positions(T, ring.size, ring.rank, context.ulysses_of(ring))

    def canonical_positions(self, T: int) -> np.ndarray:
        """(T_c,) the global positions of this rank's canonical rows: the
        step driver's (``driver.rank_positions``: a run of T/tp under
        --sequence-parallel, of the cp rank's positions under --cp too),
        else ``positions``."""
        pos = rank_positions(self.layout, T)
        return np.arange(T) if pos is None else pos

    def host(self, a, dtype=None) -> np.ndarray:
        return np.asarray(self.parts.backend.to_host(a)).astype(dtype or self.dtype)

    def canonical(self, name, block, T, dtype=None) -> Piece:
        """(B_c, T, C_c) block -> piece of the (B, T, h) tensor."""
        return Piece(name, (self.B, T, self.cfg.n_embd), (self.canonical_seqs, self.canonical_positions(T),
                                                             self.cols), self.host(block, dtype))

    def activations(self, capture: dict, T: int) -> list:
        """Pieces of the captured activations; a branch output inside a
        block ("h.{i}.attn", "h.{i}.mlp") gets its residual dropout here,
        the same multiplication by the same mask the block applies."""
        model, tape = self.current
        drop, ctx = model.dropout, tape.ctx
        pieces = []
        for key, block in capture.items():
            if key.endswith(ROUTER_KEY):                      # a mixture's router: ``router``
                continue
            site, _, part = key.rpartition(".")
            if part in RESIDUAL_MASK and site.startswith("h.") and drop.on(ctx):
                block = block * drop.canonical(ctx, f"{site}.{RESIDUAL_MASK[part]}", block.shape[1])
            pieces.append(self.canonical(f"act/{key}", block, T))
        return pieces

    def router(self, capture: dict, T: int) -> list:
        """Pieces of a mixture of experts' router decisions captured in
        block i (``_observe_router``): ``moe/h.{i}.logits`` (B, T, E),
        ``moe/h.{i}.experts`` (B, T, K) int32 and ``moe/h.{i}.weights``
        (B, T, K), a sigmoid router's ``moe/h.{i}.scores`` (B, T, E) and
        ``moe/h.{i}.bias`` (E,) (the bias it chose with: whole on every
        rank), on the rows the mixture ran on: the canonical rows, or
        under --sequence-parallel those the tp group holds together (the
        mixture routes the gathered sequences). Every column of E and K is
        on every rank (the logits are summed over the hidden group), so
        only the rows need their global indices."""
        pieces = []
        canonical, gathered = self.canonical_positions(T), self.positions(T)
        for key, captured in capture.items():
            if not key.endswith(ROUTER_KEY):
                continue
            site, (logits, chosen, weights, scores, bias) = key[:-len(ROUTER_KEY)], captured
            b = len(self.canonical_seqs)
            rows = (self.canonical_seqs, canonical if logits.shape[0] == b * len(canonical) else gathered)
            t = len(rows[1])
            parts = [("logits", logits, None), ("experts", chosen, np.int32), ("weights", weights, None)]
            if scores is not None:                           # the sigmoid router's (check/deepseek_names.py)
                parts.insert(1, ("scores", scores, None))
                E = bias.shape[0]
                pieces.append(Piece(f"moe/{site}.bias", (E,), (np.arange(E),), self.host(bias)))   # (E,) in use
            for part, value, dtype in parts:
                width = value.shape[-1]
                pieces.append(Piece(f"moe/{site}.{part}", (self.B, T, width), (*rows, np.arange(width)),
                                    self.host(value, dtype).reshape(b, t, width)))      # (B_c, T_c, width)
        return pieces

    def logits(self, T: int) -> list:
        """(B_l, T, V_l) -> piece of (B, T, V); padded vocabulary dropped
        (none from a pipeline chunk without the head)."""
        model, tape = self.current
        if not model.last:
            return []
        emb = model.head_embedding          # the tied wte or an untied lm_head (the only one on a last stage)
        local = Head.logits(tape)                              # (B_l, T, V_l)
        vocab = emb.vocab_start + np.arange(local.shape[-1])
        seqs = self.first + np.asarray(emb.logit_seqs)
        return [Piece("logits", (self.B, T, self.cfg.vocab_size), (seqs, self.positions(T), vocab),
                      self.host(local))]

    def masks(self, T: int, step: int) -> list:
        """Keep masks (1 kept, 0 dropped) as uint8, none without dropout.
        Drawn again from the micro-batch's context: they are a function of
        (seed, step, site, global index), so the second draw is the one
        forward applied (and a block that let go of its masks, under
        --recompute blocks, needs no special case)."""
        model, tape = self.current
        drop, ctx = model.dropout, tape.ctx
        if not drop.on(ctx):
            return []
        keep = lambda m: self.host(m != 0, np.uint8)           # noqa: E731 - scaled masks to 0/1
        pieces = []
        pos, rows = self.positions(T), self.canonical_positions(T)          # attention rows, canonical rows
        if model.first:
            pieces.append(Piece("dropout/emb", (self.B, T, self.cfg.n_embd),
                                (self.canonical_seqs, rows, self.cols), keep(drop.canonical(ctx, "emb", len(rows)))))
        for block in model.blocks:
            site = block.site
            by_blocks = drop.attention_blocks(ctx, site + ".attn", T)
            c = len(pos) // 2 if len(pos) != T else T          # rows: two contiguous chunks on a cp rank
            attn = np.concatenate([self.host(by_blocks(slice(int(p0), int(p0) + c), slice(0, T)))
                                   for p0 in pos[::c]], axis=2)
            shape = (self.B, self.cfg.n_head, T, T)
            index = (self.mid_seqs, self.heads, pos, np.arange(T))
            pieces.append(Piece(f"dropout/{site}.attn", shape, index, keep(attn)))
            for name in ("resid_attn", "resid_mlp"):
                mask = drop.canonical(ctx, f"{site}.{name}", len(rows))
                pieces.append(Piece(f"dropout/{site}.{name}", (self.B, T, self.cfg.n_embd),
                                    (self.canonical_seqs, rows, self.cols), keep(mask)))
        return pieces

    def params(self, prefix: str) -> list:
        """One copy of every parameter. ``full_master`` serves every mode
        (under a sharded 16-bit master it all-gathers over dp, so every
        rank calls this)."""
        return self._pieces(prefix, self.store.views(self.store.full_master()))

    def grads(self, divide: float = 1.0) -> list:
        """One copy of every summed gradient, ``divide`` = the loss scale it
        carries. Under --zero 1 a rank holds only its chunk of the sum, so
        the chunks are put together here with an uncounted object
        all-gather over dp (every rank calls this)."""
        store = self.store
        flat = self.host(store.flat_grad)                                    # (P_pad,)
        if store.partition.sharded:
            chunks = store.dp.mpi.allgather(flat[store.shard])   # dp x (C,) (--hsdp: the shard group)
            flat = store.partition.assemble(np, np.concatenate(chunks))     # (P_pad,) in buffer order
        if divide != 1.0:
            flat = flat / divide
        return self._pieces("grad", store.views(flat))

    def moments(self, adam) -> list:
        """One copy of AdamW's two moments of every parameter, as the
        parameters (``full_moments``: under --zero gathered over dp, so
        every rank calls this)."""
        m, v = adam.full_moments()                                            # (P_pad,) each
        return (self._pieces("state/exp_avg", self.store.views(m))
                + self._pieces("state/exp_avg_sq", self.store.views(v)))

    def _pieces(self, prefix: str, views: dict) -> list:
        return [Piece(f"{prefix}/{spec.name}", tuple(spec.decl.shape), spec.index, self.host(views[spec.name]))
                for spec in self.store.specs if self.sharded or self._writes(spec)]

    def _writes(self, spec) -> bool:
        """Whether this rank gives the gathered trace its copy of ``spec``:
        the tensor-parallel writer of the first replica, or for an expert
        (only its ep rank holds it: parallel/experts.py) the writer of its
        expert-data group's first replica."""
        return spec.writer and (self.param_writer or getattr(spec, "expert", False))


class Observed:
    """A model piece whose output is copied into ``sink[name]`` after each
    forward: how a trace sees the activations between blocks without the
    model knowing it is watched. Everything else passes to the piece.
    ``gate``, when given, is a list whose first item says whether to copy
    (a piece inside a block copies during the block's observed forward
    only, not in a --recompute blocks rerun during backward, which would
    overwrite another micro-batch's); a block's own observer opens the
    gate of the pieces inside it for the length of its forward."""

    def __init__(self, inner, name: str, sink: dict, gate: list = None, opens: list = None):
        self.inner, self.name, self.sink = inner, name, sink
        self.gate, self.opens = gate, opens

    def forward(self, x, *args):
        if self.opens is not None:
            self.opens[0] = True
        try:
            y, saved = self.inner.forward(x, *args)
        finally:
            if self.opens is not None:
                self.opens[0] = False
        if self.gate is None or self.gate[0]:
            self.sink[self.name] = y.copy()                 # (B_c, T_c, C_c)
        return y, saved

    def __getattr__(self, attr):
        return getattr(self.inner, attr)


# the pieces inside a block whose outputs a trace records (names.BLOCK_ACTS), by the block's attribute;
# the branches' (the attention, and the MLP or mixture of experts) are recorded before their residual
# dropout, which Collector applies
INSIDE = {"ln_1": "ln_1", "attn": "attn", "ln_2": "ln_2", "mlp": "mlp"}
RESIDUAL_MASK = {"attn": "resid_attn", "mlp": "resid_mlp"}


ROUTER_KEY = ".router"          # sink["h.{i}.router"]: (logits (n, E), chosen (n, K), weights (n, K), scores, bias)


def _observe_router(moe, site: str, sink: dict, gate: list) -> None:
    """A mixture of experts' router decisions (``MoE.observe``, called in
    its forward) copied into ``sink[site + ".router"]`` while ``gate`` is
    open (not in a --recompute rerun); a sigmoid router's scores (n, E)
    from its tape and the bias (E,) it chose with, else None for both."""
    def observed(logits, chosen, weights, route=None):
        if gate[0]:
            scores = getattr(route, "scores", None)
            bias = getattr(moe.router, "bias", None)
            sink[site + ROUTER_KEY] = (logits.copy(), chosen.copy(), weights.copy(),
                                       None if scores is None else scores.copy(), None if bias is None else bias.copy())
    moe.observe = observed


def record_outputs(model, sink: dict) -> None:
    """Wrap ``model``'s embeddings, blocks and final norm in ``Observed``:
    their outputs land in ``sink`` as "emb", "h.{i}" and "ln_f", and inside
    block i the norms' and the branches' as "h.{i}.ln_1", "h.{i}.attn",
    "h.{i}.ln_2", "h.{i}.mlp", in the order computed; a mixture of
    experts' router decisions as "h.{i}.router" (``Collector.router``)."""
    model.front = [Observed(piece, "emb", sink) for piece in model.front]
    blocks = []
    for block in model.blocks:
        inner = getattr(block, "block", block)               # a Recomputed block's Block
        gate = [False]
        if hasattr(inner.mlp, "observe"):                    # a mixture of experts offers its router's decisions
            _observe_router(inner.mlp, block.site, sink, gate)
        for attr, name in INSIDE.items():
            setattr(inner, attr, Observed(getattr(inner, attr), f"{block.site}.{name}", sink, gate=gate))
        blocks.append(Observed(block, block.site, sink, opens=gate))
    model.blocks = blocks
    for head in model.back:
        head.ln_f = Observed(head.ln_f, "ln_f", sink)
