"""Ulysses context parallelism (``--cp-kind ulysses``) and its hybrid with
the ring (``--cp-kind hybrid --ulysses U``).

The ring (``context.RingAttention``) keeps every head on every cp rank and
passes K/V round the sequence. Ulysses does the transpose: U ranks, each
holding T/U positions of every head, trade them by one all-to-all for all
T positions of nh/U heads, run ordinary attention on whole sequences, and
trade the output back (DeepSpeed-Ulysses, megatron-core's ``cp_comm_type``
"a2a"). Its traffic per rank does not grow with U (each all-to-all moves
(U-1)/U of the local activation), where the ring's K/V shifts grow as
(C-1); its limit is the heads: U must divide them.

Hybrid: the cp ranks form R = cp / U groups of U consecutive ranks. Group
g plays ring rank g (its positions are chunks g and 2R-1-g of 2R, as
``context.local_positions`` cuts them); inside it the U ranks each hold one
run of those positions. The all-to-all gives each rank the group's
positions for nh/U heads, and the ring over the R ranks with the same
Ulysses rank (the same heads) does the rest (megatron-core's "a2a+p2p").

Heads and grouped-query attention. The op receives the block's packed
[q | k | v] (Llama's kv heads already repeated for their query heads, as
``llama.RotaryAttention.pack`` gives every attention op), so a rank's nh/U
query heads arrive with the k and v they read: a kv head shared by more
Ulysses ranks than there are kv heads travels to each of them (replicated,
as tp > n_kv replicates it), and its gradient comes home summed by the
pack's backward. ``validate`` asks the same of U as the layouts ask of
their head split: U divides the rank's heads and the combined split
(layout's x U) holds whole kv groups.

Dropout and positions: the inner op sees global positions (the group's, in
order), and the keep mask of this rank's heads is the slice of the block
the model's callable draws for all of its heads (the model knows nothing
of Ulysses; the mask is a pure function of global indices, so the slice is
the serial run's mask at those heads).
"""

from __future__ import annotations

from ..core.errors import ConfigError
from ..ops import attention_blocks as ab
from .comm import Comm
from .comm_alltoall import alltoall
from .context import RingAttention


def validate(plan, cfg, head_split: int) -> None:
    """--cp-kind, --ulysses against cp and the heads: one line naming the
    option and the values that work."""
    from .gridspec import CP_KINDS

    if plan.cp_kind not in CP_KINDS:
        raise ConfigError(f"unknown --cp-kind {plan.cp_kind!r}; choose one of {', '.join(CP_KINDS)}")
    if plan.cp_kind != "hybrid" and plan.ulysses != 1:
        raise ConfigError(f"--ulysses {plan.ulysses} applies to --cp-kind hybrid only (--cp-kind {plan.cp_kind}): "
                          f"use --cp-kind hybrid, or drop --ulysses")
    U = plan.ulysses_size
    option = "--ulysses" if plan.cp_kind == "hybrid" else "--cp"
    if U < 1 or plan.cp % U:
        fits = [d for d in range(1, plan.cp + 1) if plan.cp % d == 0]
        raise ConfigError(f"--ulysses {U} must divide --cp {plan.cp}: use --ulysses one of {fits}")
    if U == 1:
        return
    heads = cfg.n_head // head_split                      # the heads a tensor-parallel rank holds
    nkv = cfg.kv_heads

    def fits(u):
        split = head_split * u
        return heads % u == 0 and (nkv % split == 0 or split % nkv == 0)
    if not fits(U):
        good = [u for u in range(1, plan.cp + 1) if plan.cp % u == 0 and fits(u)]
        kv = f" and hold whole kv groups of the {nkv} kv heads" if nkv != cfg.n_head else ""
        raise ConfigError(f"{option} {U} (the Ulysses size, --cp-kind {plan.cp_kind}) must divide the {heads} "
                          f"attention heads of each tensor-parallel rank (--n-head {cfg.n_head} / the layout's "
                          f"head split {head_split}){kv}: use {option} one of {good}")


def head_group(n_head: int, U: int, u: int) -> slice:
    """The heads (of a rank's ``n_head``) Ulysses rank u attends after the
    all-to-all: group u of U equal, contiguous groups."""
    n = n_head // U
    return slice(u * n, (u + 1) * n)


class _Blockwise:
    """``ops.attention_blocks`` with a chosen block size (the inner op when
    the Ulysses group is the whole cp axis)."""

    def __init__(self, block: int):
        self.block = block

    def attention_forward(self, qkv, n_head, keep_mask=None, keep_prob=1.0):
        return ab.attention_forward(qkv, n_head, keep_mask, keep_prob, block=self.block)

    def attention_backward(self, dy, cache):
        return ab.attention_backward(dy, cache)


class UlyssesAttention:
    """Causal attention of this rank's run of positions, all heads, by two
    all-to-alls over ``group`` (U ranks) around blockwise attention (or,
    with ``ring`` of R > 1 ranks, the ring over the groups); the same
    ``attention_forward`` / ``attention_backward`` calls as
    ``ops.attention_blocks``."""

    def __init__(self, group: Comm, ring: Comm, block: int = ab.BLOCK):
        self.group, self.U, self.u = group, group.size, group.rank
        self.inner = RingAttention(ring, block) if ring.size > 1 else _Blockwise(block)

    def _mask(self, keep_mask, n_head):
        """The keep-mask callable of this rank's heads (a slice of the block
        the model's callable draws for all of them), or None."""
        if keep_mask is None:
            return None
        mine = head_group(n_head, self.U, self.u)
        source = ab._mask_source(keep_mask)
        return lambda rows, cols: source(rows, cols)[:, mine]

    def attention_forward(self, qkv, n_head, keep_mask=None, keep_prob=1.0):
        """qkv (B, t, 3 nh hd), this rank's run of t = T_g/U positions ->
        y (B, t, nh hd)."""
        B, t, width = qkv.shape
        U, nu = self.U, n_head // self.U
        hd = width // (3 * n_head)
        send = qkv.reshape(B, t, 3, U, nu, hd).transpose(3, 0, 1, 2, 4, 5)          # (U, B, t, 3, nu, hd) by head group
        got = alltoall(self.group, send)                                            # (U, B, t, 3, nu, hd) by run
        qkv_g = got.transpose(1, 0, 2, 3, 4, 5).reshape(B, U * t, 3 * nu * hd)     # (B, T_g, 3 nu hd)
        y_g, cache = self.inner.attention_forward(qkv_g, nu, self._mask(keep_mask, n_head), keep_prob)
        back = alltoall(self.group, y_g.reshape(B, U, t, nu, hd).transpose(1, 0, 2, 3, 4))   # (U, B, t, nu, hd)
        y = back.transpose(1, 2, 0, 3, 4).reshape(B, t, n_head * hd)               # (B, t, nh hd) heads in order
        return y, (cache, n_head)

    def attention_backward(self, dy, saved):
        """dy (B, t, nh hd) -> dqkv (B, t, 3 nh hd): the forward's exchanges
        in reverse around the inner op's backward."""
        cache, n_head = saved
        B, t, width = dy.shape
        U, nu = self.U, n_head // self.U
        hd = width // n_head
        got = alltoall(self.group, dy.reshape(B, t, U, nu, hd).transpose(2, 0, 1, 3, 4))   # (U, B, t, nu, hd) by run
        dy_g = got.transpose(1, 0, 2, 3, 4).reshape(B, U * t, nu * hd)             # (B, T_g, nu hd)
        dqkv_g = self.inner.attention_backward(dy_g, cache)                         # (B, T_g, 3 nu hd)
        send = dqkv_g.reshape(B, U, t, 3, nu, hd).transpose(1, 0, 2, 3, 4, 5)     # (U, B, t, 3, nu, hd) by run
        back = alltoall(self.group, send)                                           # (U, B, t, 3, nu, hd) by head group
        return back.transpose(1, 2, 3, 0, 4, 5).reshape(B, t, 3 * n_head * hd)
