"""One transformer block and the wrapper that recomputes a block in
backward, written against the layout protocol (layouts/base.py) as the
GPT that strings the blocks together (``gpt.py``) is. What differs between
model families (the norm, the attention branch, the MLP or mixture of
experts) the block takes from its family object (``families``), chosen
once from the configuration; the block itself never asks which family it
runs. The dropout masks are ``dropout``'s.
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import ops  # noqa: F401 (block.ops: tests reach the mask op through it)
from ..parallel.layouts.base import Layout
from ..parallel.params import ParamStore
from .dropout import Dropout, positions  # noqa: F401 (re-exported: block.Dropout, block.positions)
from .tape import Micro, Saved


@dataclass
class BlockTape(Saved):
    """What ``Block`` keeps for backward, in the order forward made it."""

    ln_1: object                    # the first norm's (normalised rows and statistics)
    attn: object                    # the attention branch's (``attention.AttentionTape``, or a family's own)
    keep_resid_attn: object         # (B_c, T, C_c) residual dropout mask after attention, or None
    ln_2: object                    # the second norm's
    mlp: object                     # the MLP's (``mlp.MLPTape``) or the mixture of experts'
    keep_resid_mlp: object          # (B_c, T, C_c) residual dropout mask after the MLP, or None


class Block:
    """Pre-norm transformer block: x += attn(norm_1(x)); x += mlp(norm_2(x)),
    one skeleton for every family, whose pieces the ``family`` supplies:
    the norm (``family.norm``: LayerNorm, RMSNorm), the attention branch
    (``family.attention``: c_attn, a core, c_proj) and the MLP
    (``family.mlp``: a dense MLP or a mixture of experts).

    ``attention`` is the op pair the build chose (``ops`` for the one that
    holds T x T, ``ops.attention_blocks``, or a ring over the sequence's
    chunks: the same calls). Forward returns its output and the tape entry
    backward takes (``BlockTape``)."""

    def __init__(self, layout: Layout, store: ParamStore, i: int, attention, dropout: Dropout, family):
        p = f"h.{i}."
        self.site = f"h.{i}"
        self.ln_1 = family.norm(store, p + "ln_1", layout)
        self.attn = family.attention(layout, store, i, attention, dropout)
        self.ln_2 = family.norm(store, p + "ln_2", layout)
        self.mlp = family.mlp(layout, store, i)             # a dense MLP, or a mixture of experts in its place
        self.n_local_kv = self.attn.n_local_kv              # the kv heads a KV cache holds (GQA: fewer)
        self.dropout = dropout

    def forward(self, x, ctx: Micro):
        """x (B_c, T, C_c) -> (y (B_c, T, C_c), BlockTape)."""
        T = x.shape[1]                      # canonical rows: T/tp under --sequence-parallel
        drop = self.dropout
        keep_resid_attn = drop.canonical(ctx, self.site + ".resid_attn", T)
        keep_resid_mlp = drop.canonical(ctx, self.site + ".resid_mlp", T)

        h, s_ln1 = self.ln_1.forward(x)                                       # (B_c, T, C_c)
        y, s_attn = self.attn.forward(h, ctx)                                 # (B_c, T, C_c)
        if keep_resid_attn is not None:
            y *= keep_resid_attn
        x = x + y
        h, s_ln2 = self.ln_2.forward(x)                                       # (B_c, T, C_c)
        y, s_mlp = self.mlp.forward(h, ctx)                                   # (B_c, T, C_c)
        if keep_resid_mlp is not None:
            y *= keep_resid_mlp
        return x + y, BlockTape(s_ln1, s_attn, keep_resid_attn, s_ln2, s_mlp, keep_resid_mlp)

    def backward(self, dx, saved: BlockTape):
        """dx (B_c, T, C_c) -> (B_c, T, C_c)."""
        dy = dx if saved.keep_resid_mlp is None else dx * saved.keep_resid_mlp
        dx = dx + self.ln_2.backward(self.mlp.backward(dy, saved.mlp), saved.ln_2)
        dy = dx if saved.keep_resid_attn is None else dx * saved.keep_resid_attn
        return dx + self.ln_1.backward(self.attn.backward(dy, saved.attn), saved.ln_1)

    def new_cache(self, xp, positions: int, dtype):
        """An empty generation cache of ``positions`` positions for this
        block's attention branch (its own kind: keys and values, or MLA's latent)."""
        return self.attn.new_cache(xp, positions, dtype)

    def decode(self, x, cache, pos: int):
        """Inference on positions pos .. pos+t-1 with a key/value cache
        (mpicube.model.kvcache), no dropout: x (B_c, t, C_c) -> (B_c, t, C_c)."""
        x = x + self.attn.decode(self.ln_1.forward(x)[0], cache, pos)
        return x + self.mlp.forward(self.ln_2.forward(x)[0], None)[0]


class Recomputed:
    """``--recompute blocks``: a block whose tape entry is only its input
    (as the layout keeps it: ``save_block_input``, a row shard on 1-D);
    backward reruns its forward with the same ``Micro`` (so the same
    dropout masks, from the same hash) and then its backward. ``probe``,
    when set by an observer, sees each rebuilt tape entry (the memory a
    rerun holds at its peak)."""

    def __init__(self, block: Block, layout: Layout):
        self.block, self.layout = block, layout
        self.site, self.n_local_kv = block.site, block.n_local_kv
        self.probe = None

    def forward(self, x, ctx: Micro):
        """x (B_c, T, C_c) -> (y, (the kept input, ctx))."""
        return self.block.forward(x, ctx)[0], (self.layout.save_block_input(x), ctx)

    def backward(self, dx, saved):
        kept, ctx = saved
        _, rebuilt = self.block.forward(self.layout.load_block_input(kept), ctx)
        if self.probe is not None:
            self.probe(rebuilt)
        return self.block.backward(dx, rebuilt)

    def new_cache(self, xp, positions: int, dtype):
        return self.block.new_cache(xp, positions, dtype)

    def decode(self, x, cache, pos: int):
        return self.block.decode(x, cache, pos)
