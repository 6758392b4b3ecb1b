"""The layout protocol, and the small helpers every layout's linears share
(GEMMs over all leading rows, the accumulation format, bias views). The
modules built from them that several layouts or the model use (the dense
linear, the row shard, the embedding panel, the norms) are in ``modules``.

A layout says, for one rank, which block of every parameter and activation
it holds, and supplies the distributed primitives the model is written
against. The model (``mpicube.model``) never asks which layout it runs on;
it only uses what is defined here.

Activations move between two forms:

* *canonical* - between blocks, at residual adds and LayerNorms:
  (B_c, T, C_c), the sequences ``canonical_seqs`` and hidden columns
  ``canonical_cols``;
* *intermediate* - between the two linears of a pair (c_attn -> c_proj,
  c_fc -> mlp.c_proj), where attention and GELU run: (B_m, T, C_m), the
  sequences ``mid_seqs`` and, for attention, the heads ``head_ids``.

Sequence indices refer to the data-parallel replica's batch; a whole
sequence always sits on one rank so attention needs no communication.

Precision: layers compute with the store's working copy (``store.work``,
16-bit under mixed precision) and add into its float32 gradients. Every
GEMM goes through ``matmul_rows``/``precision.matmul`` (float32
accumulation); a GEMM whose result is summed over ranks or gets a bias
returns float32 (``dtype=acc``), which is reduced, biased and only then
rounded to the activation format (``narrow``), once.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from ... import ops
from ...device import precision
from ..comm import Comm
from ..fp8 import Fp8Scaling, OperandIndex, Splits, check_shard, latent_widths
from ...core.config import ModelConfig
from ...core.errors import ConfigError
from ..params import ParamDecl, ParamSpec, ParamStore, shared_columns, split_decl, split_index
from .head import LossHead


@dataclass
class Axes:
    """The communicators every layout has, one per axis of the GridSpec
    (grid.build_layout makes them; an unused axis has size 1)."""

    world: Comm
    dp: Comm      # data-parallel replicas of this rank's (stage, context, tensor-parallel) position
    tp: Comm      # this rank's tensor-parallel group
    pp: Comm      # this rank's pipeline: the same position in every stage (size 1 without stages)
    cp: Comm      # this rank's context-parallel ring (size 1 without context parallelism)
    ep: Comm = None    # this rank's expert-parallel group, taken from dp (x cp under --cp; parallel/experts.py)
    edp: Comm = None   # the ranks that hold the same experts (dp cp / ep of them); dp itself with ep 1
    dp_shard: Comm = None   # --hsdp: this rank's ZeRO-3 shard group (dp/R consecutive replicas), else None
    dp_replica: Comm = None  # --hsdp: the R ranks of its shard position in the other groups, else None
    cp_group: Comm = None   # --cp-kind ulysses/hybrid: this rank's Ulysses group (U consecutive cp ranks), else None
    cp_ring: Comm = None    # ... and the ring over the groups (the cp ranks with its Ulysses rank)


RECOMPUTE_MODES = ("none", "gathers", "blocks")

# The kinds of linear a model asks a layout for (``Layout.linear``), named as
# megatron-core's layer specs name them (docs/model.md, "Linear kinds"); a
# weight's ParamDecl role is "w_" + its kind (biases "b_column", "b_row").
COLUMN = "column"         # column-parallel: canonical -> intermediate (c_attn, c_fc)
ROW = "row"               # row-parallel: intermediate -> canonical (c_proj, mlp.c_proj)
REPLICATED = "replicated"  # un-sharded: every tp rank holds the whole (small) weight; canonical rows -> every
                          # output column (MLA's low-rank latent projections); its gradient summed over the
                          # ranks that share it
LINEAR_KINDS = (COLUMN, ROW, REPLICATED)


class Layout:
    """Base class; subclasses fill in sharding and the linear/embedding maps.

    ``recompute`` trades memory for communication and arithmetic:
    "gathers" makes the layout's linears and tied embedding let go of the
    panels they gathered or broadcast (or, in 1-D, of most of a replicated
    input) after the forward GEMM and gather them again in backward;
    "blocks" makes the model keep only each block's input (through
    ``save_block_input``) and rerun the block's forward inside backward.

    ``overlap`` (the plan's; the command line reads MPICUBE_OVERLAP=0 into
    it) overlaps collectives with GEMMs; the blocking path stays, to
    measure what overlap hides and to check it bit for bit. ``attention``
    is the plan's attention kind, which the model's blocks read here."""

    name = "base"
    token_split = False         # True: tp splits the tokens too (2-D, 2.5-D, 3-D; an expert's rows spread)

    def __init__(self, cfg: ModelConfig, axes: Axes, batch_size: int, depth: int = 1, recompute: str = "none",
                 overlap: bool = True, attention: str = "blocks", fp8=None):
        if recompute not in RECOMPUTE_MODES:
            raise ConfigError(f"unknown recompute mode {recompute!r}; choose one of {', '.join(RECOMPUTE_MODES)}")
        self.recompute = recompute
        self.overlap = overlap
        self.attention_kind = attention               # "blocks" or "full" (gridspec.ATTENTION_KINDS)
        self.cfg = cfg
        self.axes = axes
        self.backend = axes.tp.backend
        self.batch_size = batch_size                  # global sequences per step
        self.local_batch = batch_size // axes.dp.size  # sequences per dp replica
        self.vocab_padded = cfg.vocab_size
        self.fp8 = None if fp8 is None else self.fp8_scaling(fp8)

    def fp8_scaling(self, recipe) -> Fp8Scaling:
        """``--fp8``'s scaling state (``parallel/fp8.py``), with the groups
        its amaxes are reduced over: the pipeline stage's ranks (a tensor
        scale), and the ranks holding the other tokens of this
        tensor-parallel rank's columns (a wgrad row scale: dp x cp).
        Collective over the world; the plan was checked for the recipe by
        ``planning.resolve`` (``fp8.check_plan``)."""
        world, pp, tp = self.axes.world, self.axes.pp, self.axes.tp
        stage = world.split("fp8", pp.rank, world.rank)
        tokens = world.split("fp8", pp.rank * tp.size + tp.rank, world.rank)
        return Fp8Scaling(recipe, stage, tokens, self.axes.ep)

    def fp8_linear(self, store: ParamStore, prefix: str, splits: Splits = None, index: OperandIndex = None):
        """The FP8 operands of linear ``prefix`` (``LinearFp8``), or None
        without --fp8; refuses a weight shard that is not whole tiles.
        ``index``: where its x and dy lie (for trace --fp8); by default
        x's columns are W's rows and dy's W's columns, on the canonical
        sequences at every position of the rank's cp chunks (serial, 1-D
        with or without --sequence-parallel, whose linears see the
        gathered sequence); an expert's rows are the tokens routed to it
        (``OperandIndex.expert``)."""
        if self.fp8 is None:
            return None
        spec = store.by_name[prefix + ".weight"]
        check_shard(self.fp8.recipe, prefix + ".weight", *spec.index)
        if splits is not None and splits.tokens is None:
            splits.tokens = self.fp8.tokens
        if index is None:
            index = OperandIndex(np.asarray(spec.index[0]), np.asarray(spec.index[1]))
        if spec.expert:
            index = replace(index, expert=True)
        return self.fp8.linear(prefix, splits, index)

    # --- what every layout provides (overridden) -------------------------
    canonical_seqs: np.ndarray      # (B_c,) sequences held in canonical form
    canonical_cols: np.ndarray      # (C_c,) global hidden columns held
    mid_seqs: np.ndarray            # (B_m,) sequences held between paired linears
    head_ids: np.ndarray            # (nh,) global attention heads held
    hidden_comm = None              # Comm splitting the canonical hidden size, or None
    kv_comm = None                  # Comm of the ranks sharing this rank's kv head (split > n_kv), or None
    token_comm = None               # Comm of the tp ranks holding the replica's other sequences at these hidden
                                    # columns, ranked in sequence order (2-D, 2.5-D, 3-D), or None
    sequence_comm = None            # Comm splitting the canonical sequence (1-D --sequence-parallel), or None
    head_comm = None                # Comm of the ranks holding the same rows and the other heads (1-D: tp), or
                                    # None: what a gradient shared by every head (MLA's k_pe) is summed over

    @classmethod
    def head_coords(cls, tp: int, depth: int, rank: int) -> tuple:
        """(split, block, line) of tensor-parallel rank ``rank``: the heads
        are split ``split`` ways and this rank holds block ``block``; the
        ranks of one ``line`` hold the same rows of every first linear's
        weight and differ in their head block (so those of them that read
        the same kv head hold the same kv columns). Pure: ``__init__``
        builds ``head_ids`` and ``kv_comm`` from it, and
        ``analysis.heads`` draws the placement from it without MPI."""
        return 1, 0, 0

    @classmethod
    def fp8_widths(cls, cfg: ModelConfig, tp: int, depth: int) -> dict:
        """{what: width} of the shard widths an FP8 tile or block runs along
        on this layout (``parallel/fp8.check_plan`` refuses a width that is
        not whole tiles): the hidden size, a rank's query, kv and MLP
        columns as the heads and columns are split. Pure (no MPI)."""
        return {**cls.fp8_head_widths(cfg, tp, depth), f"a rank's MLP hidden columns ({cfg.ffn} / {tp})": cfg.ffn // tp}

    @classmethod
    def fp8_head_widths(cls, cfg: ModelConfig, tp: int, depth: int) -> dict:
        """The hidden size and a rank's query and kv columns (``fp8_widths``;
        DeepSeek-V3's: ``fp8.latent_widths``)."""
        split = cls.head_coords(tp, depth, 0)[0]
        if cfg.mla:
            return {"--n-embd": cfg.n_embd, **latent_widths(cfg, split, *cls.fp8_latent_splits(tp, depth))}
        return {"--n-embd": cfg.n_embd,
                f"a rank's query columns (n_head / {split} x head_dim)": cfg.n_head // split * cfg.head_dim,
                f"a rank's key and value columns (kv heads / {split} x head_dim)": cfg.kv_heads // split * cfg.head_dim}

    @classmethod
    def fp8_latent_splits(cls, tp: int, depth: int) -> tuple:
        """(ways the hidden columns of an activation are split, ways a
        weight's rows are split) on this layout: whole on serial and 1-D."""
        return 1, 1

    @classmethod
    def validate(cls, cfg: ModelConfig, tp: int, local_batch: int, depth: int, recompute: str = "none") -> None:
        """Raise ConfigError if the sizes do not fit; pure, no MPI, so every
        rank reaches the same verdict before any collective."""

    def shard(self, decl: ParamDecl) -> ParamSpec:
        raise NotImplementedError

    def linear(self, store: ParamStore, prefix: str, kind: str, bias: bool = True):
        """Module for ``prefix.weight``/``prefix.bias`` of linear kind ``kind``
        (``LINEAR_KINDS``): COLUMN maps canonical -> intermediate, ROW
        intermediate -> canonical, REPLICATED canonical rows -> all of the
        (small) output's columns (the same module on every layout:
        ``modules.replicated_linear``); ``bias`` False: the
        linear has no bias (``prefix.bias`` is not declared)."""
        raise NotImplementedError

    def replicated_spec(self, decl: ParamDecl, shared: bool) -> ParamSpec:
        """A "w_replicated" weight: whole on every tensor-parallel rank.
        ``shared`` False (serial, 1-D: every rank holds the same canonical
        block, so each computes the whole gradient): counted once, no sum;
        True: the ranks hold different canonical blocks (rows, columns or
        both), so their partial gradients are summed over the whole
        tensor-parallel group."""
        full = tuple(np.arange(n) for n in decl.shape)
        tp = self.axes.tp
        return ParamSpec(decl, full, grad_comm=tp if shared and tp.size > 1 else None, replicas=tp.size,
                         writer=tp.rank == 0)

    def tied_embedding(self, store: ParamStore, name: str = "wte"):
        """The vocabulary-parallel embedding over parameter ``name`` (role
        "wte"): the token lookup and the LM head. An untied model (Llama)
        makes a second one over its ``lm_head`` and uses only its head."""
        raise NotImplementedError

    def loss_head(self, embedding):
        """The LM head over ``embedding`` (this layout's tied embedding) and
        the vocabulary-parallel cross-entropy (layouts/head.py)."""
        return LossHead(embedding, self.cfg.vocab_size, self.backend.xp)

    def expert_rows(self, held):
        """A mixture of experts' seam (model/moe.py): (rows, every) for
        this rank's local experts, given ``held`` (E_l,), the token rows of
        each that this rank received. ``rows`` (E_l,) is how many rows each
        expert's linears run on (``held`` plus zero padding where the
        layout's collectives need equal shapes on ranks holding different
        tokens); ``every`` says whether an expert with no rows must still
        run (its linears' collectives span ranks that may hold rows). Here
        (serial, 1-D) every collective joins ranks holding the same
        tokens: the rows as held, an empty expert skipped, unless --fp8's
        amax reductions span other tokens (``fp8_every``)."""
        return held, self.fp8_every()

    def expert_mid_rows(self):
        """Where an expert's intermediate rows (between its two linears)
        lie, for an observer (trace --fp8): None, the rows it ran on here
        (serial, 1-D, 2-D, 2.5-D), or (comm, r): those rank r of ``comm``
        ran it on (3-D)."""
        return None

    def fp8_every(self) -> bool:
        """Whether --fp8 makes every expert run, with no rows too: on every
        layout, serial included. Its scales' amaxes are reduced over the
        stage (dp, cp), whose other ranks may hold rows of it, so on such a
        layout it must run; and an expert that got no token anywhere then
        quantizes its W (and pushes delayed's histories) there, so serial
        runs it too, and the layouts' FP8 operands and histories stay
        serial's, expert by expert."""
        return self.fp8 is not None

    def expert_linear(self, store: ParamStore, prefix: str, position: str):
        """A mixture of experts' seam (model/moe.py): the (bias-free) linear
        of one expert, which runs on its token rows (m_e, 1, C_c) as an
        MLP's linear runs on canonical activations. Here the layout's own.
        Where the canonical form splits the sequence (``sequence_comm``)
        the mixture gathers its input and reduce-scatters its output once
        around all the experts, as a sequence-parallel MLP does around its
        two linears; the layout then returns linears that take and give
        partial sums over that group (no collective of their own)."""
        return self.linear(store, prefix, position, bias=False)

    def save_block_input(self, x):
        """What a block keeps of its input x (B_c, T, C_c) under
        ``--recompute blocks``: x itself, unless the layout replicates it
        (1-D keeps a row shard)."""
        return x

    def load_block_input(self, saved):
        """The block input (B_c, T, C_c) back from ``save_block_input``."""
        return saved

    # --- shared helpers ---------------------------------------------------
    def place_heads(self, depth: int) -> tuple:
        """(split, block) of this rank's heads (``head_coords``); sets
        ``head_ids`` and, under grouped-query attention with a head split
        finer than the kv heads, ``kv_comm``: the ranks of this rank's line
        whose query heads read its kv head (split / n_kv consecutive
        blocks), derived once here from the tensor-parallel group
        (collective over it: every rank builds its layout). The layouts'
        ``shard`` hands it to ``first_columns``."""
        tp = self.axes.tp
        split, block, line = self.head_coords(tp.size, depth, tp.rank)
        self.head_ids = split_index(self.cfg.n_head, split, block)
        self.head_split = (split, block)
        nkv = self.cfg.kv_heads
        if split > nkv:                      # only grouped-query attention has fewer kv heads than query heads
            share = split // nkv
            self.kv_comm = tp.split("kv", line * nkv + block // share, block)
        return split, block

    def first_columns(self, decl: ParamDecl) -> tuple:
        """(global indices, ``SharedColumns`` or None) of this rank's head
        block of ``decl``'s last dimension (a first linear's columns, a
        bias): whole query heads with their kv heads (params.split_decl)."""
        split, block = self.head_split
        return split_decl(decl, split, block), shared_columns(decl, split, block, self.kv_comm)

    def canonical_block(self, n: int):
        """(n_c,) the columns of an n-wide canonical activation this rank
        holds, split as the hidden size is (``canonical_cols``, over
        ``hidden_comm``): all n where the canonical form holds every
        column (serial, 1-D). MLA's latents come out of a REPLICATED
        linear whole; a COLUMN up-projection takes this block of them."""
        return np.arange(n)

    def shared_key(self, k):
        """k (B_c, T_c, w), a per-token tensor every head reads (MLA's rotary
        key k_pe), on the canonical rows -> (B_m, T, w) on the rows this
        rank's heads attend over: as it is, or all-gathered along the
        sequence under 1-D's --sequence-parallel (3-D moves rows: cube.py)."""
        if self.sequence_comm is not None:
            return self.sequence_comm.allgather(self.backend.xp.ascontiguousarray(k), axis=1)
        return k

    def shared_key_backward(self, dk):
        """dk (B_m, T, w), summed over this rank's heads only -> (B_c, T_c, w),
        summed over every head, on every rank holding those canonical rows:
        all-reduced over ``head_comm`` (the ranks holding the same rows and
        the other heads), or reduce-scattered along the sequence under
        --sequence-parallel (the same sum, each rank keeping its positions)."""
        dk = self.backend.xp.ascontiguousarray(dk)
        if self.sequence_comm is not None:
            return self.sequence_comm.reduce_scatter(dk, axis=1)
        if self.head_comm is not None:
            return self.head_comm.allreduce(dk)
        return dk

    def seq_positions(self, T: int):
        """(T_c,) global positions of the canonical rows of a T-long
        sequence, or None when the canonical form holds all T (every layout
        but 1-D under --sequence-parallel, ``layouts/seqpar.py``)."""
        return None

    def describe(self) -> dict:
        """JSON-able description (saved in checkpoints and config.json)."""
        axes = {"layout": self.name, "tp": self.axes.tp.size, "dp": self.axes.dp.size}
        axes.update({n: getattr(self.axes, n).size for n in ("pp", "cp", "ep")
                     if getattr(self.axes, n) is not None and getattr(self.axes, n).size != 1})
        return axes

    @staticmethod
    def pad_to(n: int, multiple: int) -> int:
        return -(-n // multiple) * multiple

    @classmethod
    def require(cls, ok: bool, message: str) -> None:
        if not ok:
            raise ConfigError(f"layout {cls.name}: {message}")

    @classmethod
    def require_multiple(cls, what: str, value: int, divisor: int, why: str, suggest_step: int = 0) -> None:
        """ConfigError unless ``divisor`` divides ``value``, suggesting the
        nearest multiples of ``suggest_step`` (default: of ``divisor``)."""
        cls.require(value % divisor == 0, f"{what} {value} must be divisible by {why}: "
                                          f"use {nearest_multiples(value, suggest_step or divisor)}")


def check_head_split(cfg: ModelConfig, split: int) -> None:
    """ConfigError unless a head split ``split`` ways gives every rank
    whole kv groups: ``split`` divides the kv heads (each rank holds whole
    kv heads and their queries) or the kv heads divide ``split`` (each kv
    head shared by split / n_kv ranks whose queries all read it)."""
    nkv = cfg.kv_heads
    if nkv % split and split % nkv:
        raise ConfigError(f"--n-kv-head {nkv}: the layout splits the heads {split} ways, which must divide the "
                          f"{nkv} kv heads or be a multiple of them (a rank's query heads must read whole kv heads)")


def nearest_multiples(value: int, multiple: int) -> str:
    """The multiples of ``multiple`` just below and above ``value``, for
    error messages that suggest a valid size."""
    below = value // multiple * multiple
    above = below + multiple
    return " or ".join(str(v) for v in (below, above) if v > 0)


def matmul_rows(x, w, dtype=None):
    """x (..., K) @ w (K, M) -> (..., M) as one 2-D GEMM over all leading
    rows (NumPy would otherwise run one GEMM per leading index), accumulated
    in float32 or better; the result in ``dtype`` (default x's)."""
    y = precision.matmul(x.reshape(-1, x.shape[-1]), w, dtype=dtype)
    return y.reshape(x.shape[:-1] + (w.shape[-1],))


def acc(a):
    """The format a GEMM result that will be reduced or biased is kept in:
    float32 for 16-bit activations, else their own format."""
    return precision.compute_dtype(a.dtype)


def bias_views(store: ParamStore, prefix: str, bias: bool):
    """(b, db): the working bias and its gradient of linear ``prefix``, or
    (None, None) for a linear without one (Llama's): no zero bias stands
    in, so parameter counts match the model's own."""
    if not bias:
        return None, None
    return store.work[prefix + ".bias"], store.grad[prefix + ".bias"]


def add_bias(y, b):
    """y (..., C) += b (C,) when the linear has a bias; returns y."""
    if b is not None:
        y += b
    return y


def add_bias_grad(db, dy2):
    """db (C,) += the column sums of dy2 (n, C) when the linear has a bias."""
    if db is not None:
        db += ops.column_sums(dy2)
