"""FP8 on every layout: a scale belongs to the logical tensor.

``ops/fp8_recipes.py`` quantizes an operand that one rank holds whole.
Here a linear's operands are shards, and the quantized values must be the
serial model's bit for bit, so:

* a tensor scale (tensorwise, delayed) comes from an amax all-reduced
  (max) over the pipeline stage's ranks: every rank holding a piece of
  x, W or dy (tp, cp, sequence-parallel and, so that every layout
  follows serial at the same global batch, dp; max over replicas is
  harmless: they hold the same values); an expert's under --ep > 1 over
  the ranks holding it only (its expert-data group and their tp ranks:
  ``Fp8Scaling.expert_parts``), which hold every row serial runs it on;
* a row scale (rowwise) from an amax all-reduced over the ranks that hold
  the other pieces of the row (``Splits``, the linear's own groups; on
  3-D a row of x, W or dy along K spans a line or a plane of the cube,
  and a column of x or dy along the tokens a plane and the replicas);
* a tile or block (blockwise, MXFP8) never straddles a shard: the layout
  refuses widths that are not whole tiles (``check_widths``), and each
  rank quantizes its tiles alone; an expert's tiles along its tokens
  hold serial's tokens only where one rank holds all its rows in serial's
  order (``expert_rows_whole``), elsewhere the plan is refused.

A linear asks its ``LinearFp8`` for the operands of each GEMM, in the
activation format (``Recipe.accumulate``): exact FP8 values times their
scales. NaN or inf reaching a quantizer stops the run with one line
naming the linear, the operand and the step (``Fp8NonFinite``).
``delayed`` scales come from an amax history per (linear, operand),
pushed once per step (``Fp8Scaling.begin_step``): the step's amax is the
max over its micro-batches and ranks, so the history is the same on
every layout.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from ..core.errors import ConfigError, UserError
from ..device.arrays import array_module
from ..ops.fp8 import NonFiniteError, current_scale, group_amax, quantize, require_finite
from ..ops.fp8_recipes import Quantized, Recipe, local_group, pad_tiles, quantize_with
from .comm import Comm

CANONICAL = {"x": "forward", "w": "forward", "dy": "dgrad"}   # the GEMM a tensor scale's quantization is named by
ROLE_WORDS = {"x": "input x", "w": "weight", "dy": "output gradient dy"}


class Fp8NonFinite(UserError):
    """NaN or inf reached an FP8 quantizer: the step diverged there, and
    the run stops as a non-finite loss stops it (exit 3, nothing saved
    from the step)."""

    exit_code = 3       # training.train.EXIT_DIVERGED (the layers above may not be imported here)


@dataclass
class Splits:
    """The groups holding the other pieces of each operand's rows along a
    GEMM's contraction (None: this rank holds whole rows): x's columns,
    W's rows (forward, contraction K_in), W's and dy's columns (dgrad,
    K_out), and the token rows (wgrad: other tokens of the same columns;
    dy's, ``dy_tokens``, are x's unless a layout holds them elsewhere, as
    3-D does)."""

    x_cols: Comm = None
    w_rows: Comm = None
    w_cols: Comm = None
    dy_cols: Comm = None
    tokens: Comm = None
    dy_tokens: Comm = None


@dataclass
class OperandIndex:
    """Where a linear's x and dy live in the logical tensors, for an
    observer (``trace --fp8`` reassembles their quantized bytes and scales
    as it does any traced tensor): the global K_in columns of this rank's
    x and K_out columns of its dy (each as the GEMM sees the block before
    it travels), and which token rows each holds, as the trace's
    ``Collector`` names them: (sequences "canonical" or "mid", positions
    "gathered" (every position of the rank's cp chunks) or "canonical"
    (the canonical form's: T/p of them under --sequence-parallel)). An
    expert's linear (``expert``) runs on the rows dispatched to it, which
    the observer places from the routing (analysis/trace_fp8.py; on 3-D
    its "mid" rows are another rank's: ``Layout.expert_mid_rows``)."""

    x_cols: object                       # (K_in_l,) global indices
    dy_cols: object                      # (K_out_l,) global indices
    x_rows: tuple = ("canonical", "gathered")
    dy_rows: tuple = ("canonical", "gathered")
    expert: bool = False                 # rows: the tokens routed to the expert, in the order it ran them


class Fp8Scaling:
    """One per layout: the recipe, the stage's communicator that tensor
    amaxes are reduced over, the step (for messages), ``delayed``'s
    histories, and an optional ``observer(name, role, gemm, Quantized,
    OperandIndex)`` (trace --fp8)."""

    def __init__(self, recipe: Recipe, stage: Comm, tokens: Comm, ep: Comm = None, more_tokens: tuple = ()):
        self.recipe, self.stage, self.tokens = recipe, stage, tokens
        # --ep > 1: an expert lives on the ranks of one ep rank (its expert-data group, with their tp ranks),
        # so its amaxes are reduced over the part of each group that holds it: id(group) -> that part.
        # Collective over each group, in the same order on every rank (stage, tokens, then the layout's others)
        self.expert_parts = {}
        if ep is not None and ep.size > 1:
            for group in (stage, tokens, *more_tokens):
                if id(group) not in self.expert_parts:
                    self.expert_parts[id(group)] = group.split("fp8", ep.rank, group.rank)
        self.step = 0
        self.recording = True               # off while evaluating: no amax joins delayed's history
        self.history = {}                   # "linear role" -> (L,) float64 amaxes, oldest first
        self.seen = {}                      # "linear role" -> this step's amax so far
        self.observer = None

    def begin_step(self, step: int) -> None:
        """Push the last step's amaxes into the histories (delayed), once per step."""
        if step == self.step:
            return
        for key, amax in self.seen.items():
            h = self.history.setdefault(key, np.zeros(self.recipe.history))
            h[:-1], h[-1] = h[1:].copy(), amax
        self.seen, self.step = {}, step

    def linear(self, name: str, splits: Splits = None, index: OperandIndex = None) -> "LinearFp8":
        """The FP8 seam of linear ``name``. An expert's (``index.expert``)
        under --ep > 1 reduces its tensor amax, and its wgrad token rows'
        amaxes, over the ranks holding that expert only (``expert_part``):
        the tokens dispatched to it from every replica of its ep group lie
        there, and the other ep ranks hold other experts, whose amaxes are
        not its own."""
        splits = splits or Splits(tokens=self.tokens)
        if index is None or not index.expert:
            return LinearFp8(self, name, splits, index)
        dy_tokens = splits.tokens if splits.dy_tokens is None else splits.dy_tokens
        expert_splits = replace(splits, tokens=self.expert_part(splits.tokens), dy_tokens=self.expert_part(dy_tokens))
        return LinearFp8(self, name, expert_splits, index, stage=self.expert_part(self.stage))

    def expert_part(self, group: Comm) -> Comm:
        """The ranks of ``group`` that hold this rank's experts (``group``
        itself without --ep or where it is not a token or stage group)."""
        return self.expert_parts.get(id(group), group) if group is not None else None

    def state(self, mpi_world) -> dict:
        """``delayed``'s histories as a checkpoint keeps them (collective
        over ``mpi_world``, an mpi4py communicator): every stage's linears (a pipeline stage knows its
        own only), the step they belong to and that step's amaxes not yet
        pushed. JSON numbers: Python writes a float64 so that it reads back
        the same bits, and the resumed run scales as the uninterrupted one."""
        merged = {"step": self.step, "length": self.recipe.history, "history": {}, "seen": {}}
        for part in mpi_world.allgather({"history": {k: [float(a) for a in h] for k, h in self.history.items()},
                                         "seen": dict(self.seen)}):
            merged["history"].update(part["history"])
            merged["seen"].update(part["seen"])
        return merged

    def restore(self, doc: dict) -> None:
        """The histories of ``state``; one saved with another
        --fp8-amax-history keeps its most recent amaxes (zeros before them:
        a zero is no amax)."""
        self.step, self.seen = int(doc["step"]), {k: float(v) for k, v in doc["seen"].items()}
        self.history = {}
        for key, saved in doc["history"].items():
            h = np.zeros(self.recipe.history)
            recent = np.asarray(saved, dtype=np.float64)[-self.recipe.history:]
            h[h.size - recent.size:] = recent
            self.history[key] = h

    def history_amax(self, key: str) -> float:
        """The amax delayed scales with: the history's max or its most recent (0: no history yet)."""
        h = self.history.get(key)
        if h is None:
            return 0.0
        return float(h.max() if self.recipe.history_rule == "max" else h[-1])


class LinearFp8:
    """The quantized operands of one linear's three GEMMs (table in
    ``ops/fp8_recipes.py``). Operands come and go in the linear's own
    shapes; each is quantized with its contraction on the last axis."""

    def __init__(self, scaling: Fp8Scaling, name: str, splits: Splits, index: OperandIndex = None,
                 stage: Comm = None):
        if splits.dy_tokens is None:                # dy's token rows are x's (a copy: the caller's stays as given)
            splits = replace(splits, dy_tokens=splits.tokens)
        self.s, self.name, self.splits = scaling, name, splits
        self.index = index              # x's and dy's place in the logical tensors (an observer's), or None
        self.stage = stage if stage is not None else scaling.stage   # the ranks holding pieces of x, W, dy

    # the three GEMMs ---------------------------------------------------------
    def forward(self, x, w):
        """x (..., K_in), w (K_in, K_out) -> their quantized values, same shapes."""
        xv = self.operand(x.reshape(-1, x.shape[-1]), "x", "forward", self.splits.x_cols).reshape(x.shape)
        wv = self.operand(w.T, "w", "forward", self.splits.w_rows).T
        return xv, wv

    def dgrad(self, dy, w):
        """dy (..., K_out), w (K_in, K_out) -> their values for dx = dy w^T."""
        dyv = self.operand(dy.reshape(-1, dy.shape[-1]), "dy", "dgrad", self.splits.dy_cols).reshape(dy.shape)
        return dyv, self.operand(w, "w", "dgrad", self.splits.w_cols)

    def wgrad(self, x2, dy2):
        """x2 (n, K_in), dy2 (n, K_out) -> their values for dW = x2^T dy2."""
        xv = self.operand(x2.T, "x", "wgrad", self.splits.tokens).T
        dyv = self.operand(dy2.T, "dy", "wgrad", self.splits.dy_tokens).T
        return xv, dyv

    # one operand as one GEMM quantizes it, in the operand's own shape --------------
    TRANSPOSED = {("w", "forward"), ("x", "wgrad"), ("dy", "wgrad")}    # contraction on the first axis
    SPLIT_OF = {("x", "forward"): "x_cols", ("w", "forward"): "w_rows", ("dy", "dgrad"): "dy_cols",
                ("w", "dgrad"): "w_cols", ("x", "wgrad"): "tokens", ("dy", "wgrad"): "dy_tokens"}

    @property
    def tensor_scaled(self) -> bool:
        """Whether one quantization serves all three GEMMs (a tensor scale
        has no orientation); otherwise each GEMM quantizes along its own
        contraction (``oriented``)."""
        return self.s.recipe.name in ("tensorwise", "delayed")

    def oriented(self, a, role: str, gemm: str):
        """a in the linear's own shape (x, dy: (..., K); w: (K_in, K_out))
        -> its values as ``gemm`` quantizes it (the table in
        ``ops/fp8_recipes.py``), same shape. For the layouts whose GEMMs see
        broadcast or gathered panels (2-D, 2.5-D, 3-D): each rank quantizes
        the shard it owns before it travels, so a panel carries the serial
        model's values (a tile never straddles a shard; a row's amax is
        reduced over ``Splits``)."""
        a2 = a.reshape(-1, a.shape[-1])                                    # (n, K)
        split = getattr(self.splits, self.SPLIT_OF[(role, gemm)])
        if (role, gemm) in self.TRANSPOSED:
            return self.operand(a2.T, role, gemm, split).T.reshape(a.shape)
        return self.operand(a2, role, gemm, split).reshape(a.shape)

    def tensor(self, a, role: str):
        """a (x, dy: (..., K); w: (K_in, K_out)) under a tensor scale, for
        the layouts whose GEMMs see gathered panels (2-D, 2.5-D, 3-D):
        tensorwise and delayed quantize every orientation alike, so one
        quantization at entry serves all three GEMMs. It is named and
        oriented as the first GEMM that uses it quantizes it (``CANONICAL``:
        x and W^T for forward, dy for dgrad), as serial's are, so an
        observer sees the same operands on every layout."""
        if role == "w":
            return self.operand(a.T, "w", "forward", None).T
        return self.operand(a.reshape(-1, a.shape[-1]), role, CANONICAL[role], None).reshape(a.shape)

    # one operand ----------------------------------------------------------------
    def operand(self, a2, role: str, gemm: str, split: Comm):
        """a2 (n, K), contraction along K -> its quantized values (n, K)."""
        r = self.s.recipe
        what = f"{self.name} {ROLE_WORDS[role]} ({gemm} GEMM) at step {self.s.step}"
        try:
            require_finite(a2, what)
        except NonFiniteError as exc:
            raise Fp8NonFinite(f"training diverged: --fp8 {r.name}: {exc}; stopped without saving this state "
                               f"(try a lower --lr or a longer --warmup)") from None
        group, fmt = r.group(role, gemm), r.format(role)
        if group == "tensor":
            q = self.tensor_quantized(a2, role, fmt)
        else:
            padded = pad_tiles(a2, group)                       # an expert's tokens: a short last tile
            amax = group_amax(padded, local_group(group))      # a tile or block never straddles a shard
            if group == "row" and split is not None and split.size > 1:
                amax = split.allreduce(amax, op="max")
            q = quantize_with(padded, amax, group, fmt, r)
        if self.s.observer is not None:
            self.s.observer(self.name, role, gemm, q, self.index)
        return q.values(a2.dtype)[:, :a2.shape[1]]

    def tensor_quantized(self, a2, role, fmt) -> Quantized:
        """A tensor scale: the amax of the whole logical tensor (the max
        over the stage, or over an expert's holders in it), current (tensorwise) or from the history (delayed)."""
        amax = self.stage.allreduce(group_amax(a2, "tensor"), op="max")     # (1, 1)
        r = self.s.recipe
        if r.name == "delayed":
            key = f"{self.name} {role}"
            xp = array_module(a2)
            if self.s.recording:                                # the history is host numbers: one comes back
                seen = float(amax.max()) if xp is np else float(xp.asnumpy(amax).max())
                self.s.seen[key] = max(self.s.seen.get(key, 0.0), seen)
            past = self.s.history_amax(key)
            scale = current_scale(xp.full((1, 1), past), fmt) if past > 0 else xp.ones((1, 1), xp.float32)
            return Quantized(quantize(a2, scale, "tensor", fmt), scale, "tensor", fmt)
        return quantize_with(a2, amax, "tensor", fmt, r)


def index_runs(index) -> list:
    """(start, length) of each run of consecutive global indices."""
    index = np.asarray(index)
    if index.size == 0:
        return []
    cuts = np.flatnonzero(np.diff(index) != 1) + 1
    return [(int(run[0]), len(run)) for run in np.split(index, cuts)]


def check_shard(recipe: Recipe, name: str, rows, cols) -> None:
    """ConfigError unless weight ``name``'s block (global ``rows``,
    ``cols`` indices) is made of whole tiles and blocks of the recipe: x's
    tiles run along W's rows, dy's along its columns, W's blocks along
    both, so every run of consecutive indices must start and end on a
    multiple of the block."""
    b = recipe.block
    if not b:
        return
    for axis, index in (("rows", rows), ("columns", cols)):
        for start, length in index_runs(index):
            if start % b or length % b:
                fits = [d for d in (1, 2, 4, 8, 16, 32, 64, 128) if d < b and start % d == 0 and length % d == 0]
                raise ConfigError(f"--fp8 {recipe.name}: this layout gives a rank {length} {axis} of {name} "
                                  f"(from index {start}), not whole {b}-element "
                                  f"{'tiles' if recipe.name == 'blockwise' else 'blocks'} (a tile may not straddle "
                                  f"a shard): use sizes whose shards are multiples of {b}"
                                  + (f", or --fp8-block {fits[-1]}" if fits else ""))


def latent_widths(cfg, split: int, columns: int, rows: int) -> dict:
    """Multi-head latent attention's widths a tile runs along on a rank,
    the heads split ``split`` ways: q_up's (q_proj's) query columns
    (dn + dr a head), kv_up's (dn + dv a head), c_proj's input (dv a
    head); the latents q_up and kv_up read, split ``columns`` ways as
    the hidden size (2-D, 2.5-D, 3-D: the REPLICATED down-projections'
    outputs are whole, their last tile padded); and on 3-D the weight
    rows, ``rows`` ways, of q_up, kv_up and c_proj."""
    nh, dn, dr, dv = cfg.n_head, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    out = {f"a rank's query columns (n_head / {split} x (qk_nope + qk_rope))": nh // split * (dn + dr),
           f"a rank's kv_up columns (n_head / {split} x (qk_nope + v_head_dim))": nh // split * (dn + dv),
           f"a rank's c_proj input columns (n_head / {split} x v_head_dim)": nh // split * dv}
    latents = {"--q-lora-rank": cfg.q_lora_rank, "--kv-lora-rank": cfg.kv_lora_rank}
    for option, rank in latents.items():
        if rank and columns > 1:
            out[f"a rank's latent columns ({option} / {columns})"] = rank // columns
        if rank and rows > columns:
            out[f"a rank's weight rows ({option} / {rows})"] = rank // rows
    if rows > columns:
        out[f"a rank's c_proj weight rows (n_head x v_head_dim / {rows})"] = nh * dv // rows
    return out


def expert_rows_whole(cls, dp: int, cp: int, ep: int) -> bool:
    """Whether each expert's token rows are whole on the ranks that run it,
    in the serial model's order, so that a tile along its tokens (wgrad)
    holds serial's tokens: a layout that does not split the tokens over
    tp, no --cp (the ring's chunks interleave a sequence's positions
    across ranks), and one ep group spanning every replica (--ep equal to
    --dp: an expert then lives on one ep rank, which receives its rows
    from replicas 0, 1, ... in turn, the global batch's token order)."""
    return not cls.token_split and cp == 1 and ep == dp


def check_plan(recipe: Recipe, cfg, cls, tp: int, depth: int, cp: int, dp: int = 1, cp_kind: str = "ring",
               ep: int = 1) -> None:
    """The pure half of the checks (``planning.resolve``, before any file
    or collective): kv heads replicated over ranks
    (each then holds a partial sum of their columns' dy, which no scale
    may see), and the widths a tile runs along on a rank (the layout's
    ``fp8_widths``: the hidden size, a rank's query, kv and MLP columns
    (DeepSeek-V3's: ``latent_widths``),
    a 3-D weight's rows; serial is 1-D on one rank), a rank's consecutive
    positions, and an expert's token rows (whole, in the serial model's
    order, on one 1-D replica, or under --ep equal to --dp without --cp
    on the ep rank that holds the expert: ``expert_rows_whole``).
    The layouts check their real shards again when they build
    (``check_shard``)."""
    if recipe is None:
        return
    split = cls.head_coords(tp, depth, 0)[0]
    if split > cfg.kv_heads:
        raise ConfigError(f"--fp8 {recipe.name}: layout {cls.name} splits the heads {split} ways over "
                          f"{cfg.kv_heads} kv heads, so each rank would hold a partial sum of the kv columns' "
                          f"output gradient, which a scale may not see; use a head split that divides --n-kv-head")
    b = recipe.block
    if not b:
        return
    if cp > 1 and cp_kind != "ring":
        raise ConfigError(f"--fp8 {recipe.name} with --cp-kind {cp_kind}: the tiles along a rank's positions are "
                          f"checked for the ring's chunks only so far; use --cp-kind ring, or tensorwise, delayed "
                          f"or rowwise")
    if cfg.moe and not expert_rows_whole(cls, dp, cp, ep):
        where = (f"the token blocks of layout {cls.name}" if cls.token_split else
                 f"--dp {dp} --cp {cp} --ep {ep}")
        raise ConfigError(f"--fp8 {recipe.name} with a mixture of experts on {where}: an expert's token rows are "
                          f"spread over ranks (or come in another order than serial's), so its weight gradient's "
                          f"tiles along the tokens would straddle them; use layout 1d with --ep equal to --dp and "
                          f"--cp 1 (--dp 1 --ep 1 among them), or tensorwise, delayed or rowwise")
    widths = {**cls.fp8_widths(cfg, tp, depth),
              "a rank's consecutive positions of a sequence" + (f" (--seq-len / {2 * cp})" if cp > 1 else
                                                                " (--seq-len)"): cfg.n_ctx // (2 * cp if cp > 1 else 1)}
    for what, width in widths.items():
        if width % b:
            fits = [d for d in range(1, b) if all(w % d == 0 for w in widths.values())]
            raise ConfigError(f"--fp8 {recipe.name}: {what} is {width}, not a multiple of the {b}-element "
                              f"{'tile' if recipe.name == 'blockwise' else 'block'} (a tile may not straddle a "
                              f"shard): choose sizes whose shards are multiples of {b}"
                              + (f", or --fp8-block {fits[-1]} for a small model" if fits[-1] > 1 else ""))
