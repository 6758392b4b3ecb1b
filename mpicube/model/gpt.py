"""GPT-2, Llama and Mixtral, written once against the layout protocol
(layouts/base.py) and the family protocol (``families``).

Nothing here knows which layout it runs on: the layout supplies the linears,
the tied embedding / LM head and the communicator of the hidden split; the
model only strings them together with local ops from ``mpicube.ops``. Nor
which family: ``families.family_of`` picks the family object once, and its
pieces (norms, attention, MLP, parameter list) are all the model asks of it.
Shapes use the layout's local sizes: B_c/C_c canonical rows/columns,
B_m/C_m between paired linears, V_l local vocabulary.
"""

from __future__ import annotations

from . import kvcache
from .. import ops
from ..core import memory
from ..core.config import ModelConfig
from ..parallel.layouts.base import Layout
from ..parallel.layouts.modules import Panel
from ..parallel.params import ParamStore
from .block import Block, Dropout, positions
from .families import Family, family_of
from .mtp import MultiTokenPrediction, mtp_blocks
from .tape import Micro, Tape


def param_names(cfg: ModelConfig):
    """The names of ``gpt_params(cfg)``, in order, one at a time: a
    file reader walks them to find the first one a file lacks without
    building a list as long as its header claims."""
    yield from family_of(cfg).param_names(cfg)


def gpt_params(cfg: ModelConfig) -> list:
    """Every logical parameter of ``cfg``'s family under mpicube's names
    (GPT-2's where a tensor plays the same part), with its init. Every
    model and shape list is built here, so this is where a model whose
    tensor list alone cannot fit in memory is refused (one line), instead
    of minutes of building and a MemoryError."""
    memory.require_tensors(cfg.n_layer)
    return family_of(cfg).params(cfg)


class Embeddings:
    """The front of the model: token lookup (the layout's tied embedding),
    plus GPT-2's position table read at each row's global position (Llama
    has none: its positions are rotary, in attention), then dropout.
    ``forward`` takes token ids (B_dp, T_l), already cut by the step driver
    to this rank's positions."""

    def __init__(self, layout: Layout, store: ParamStore, embedding, dropout: Dropout, family: Family):
        self.embedding, self.dropout, self.xp = embedding, dropout, layout.backend.xp
        self.wpe = self.dwpe = None
        if family.position_table:
            self.wpe, self.dwpe = store.work["wpe"], store.grad["wpe"]      # (n_ctx, C_c)

    def forward(self, idx, tape: Tape):
        """idx (B_dp, T_l) -> (x (B_c, T_c, C_c), saved)."""
        x, s_lookup = self.embedding.embed(self.xp.asarray(idx), tape.panel)   # (B_c, T_c, C_c)
        T = x.shape[1]                                                      # this rank's canonical positions
        pos = slice(0, T) if tape.ctx.positions is None else self.xp.asarray(positions(tape.ctx, T))
        if self.wpe is not None:
            x = x + self.wpe[pos]
        keep = self.dropout.canonical(tape.ctx, "emb", T)
        if keep is not None:
            x *= keep
        return x, (s_lookup, pos, keep)

    def backward(self, dx, saved, tape: Tape):
        """dx (B_c, T_c, C_c): into dwpe and dwte; nothing below it."""
        s_lookup, pos, keep = saved
        if keep is not None:
            dx = dx * keep
        B, T, C = dx.shape
        if self.dwpe is not None:
            self.dwpe[pos] += dx.sum(0) if dx.dtype == self.dwpe.dtype else ops.column_sums(
                dx.reshape(B, T * C)).reshape(T, C)                         # 16-bit dx: summed in float32+
        self.embedding.embed_backward(dx, s_lookup, tape.panel)


class Head:
    """The back of the model: the final norm, then the layout's LM head and
    cross-entropy (``Layout.loss_head``) over ``embedding``: the tied wte,
    or an untied model's ``lm_head`` (whose gathered panel is the tape's
    ``head_panel``). ``forward`` returns this rank's share of the loss;
    with multi-token prediction (``mtp``, model/mtp.py) the depths run on
    the final-normed state right after, and the share is (1 + D,): the
    main cross-entropy sum, then each depth's."""

    def __init__(self, layout: Layout, store: ParamStore, embedding, family: Family, mtp=None):
        self.ln_f = family.norm(store, "ln_f", layout)
        self.loss = layout.loss_head(embedding)
        self.tied = layout.cfg.tied
        self.mtp = mtp
        self.xp = layout.backend.xp

    def panel(self, tape: Tape) -> Panel:
        return tape.panel if self.tied else tape.head_panel

    def forward(self, x, tape: Tape):
        """x (B_c, T_c, C_c) -> (loss share (1,) or (1 + D,), saved)."""
        h, s_ln = self.ln_f.forward(x)                                      # (B_c, T_c, C_c)
        share, s_loss = self.loss.forward(h, tape.targets, self.panel(tape), tape.ctx.n_tokens)
        s_mtp = None
        if self.mtp is not None:
            depths, s_mtp = self.mtp.forward(h, tape, self.panel(tape))      # (D,)
            share = self.xp.concatenate([share, depths])                    # (1 + D,)
        return share, (s_ln, s_loss, s_mtp)

    @staticmethod
    def logits(tape: Tape):
        """The logits (B_l, T, V_l) the head saved in ``tape`` (its entry is
        (norm's, (logits, ...), MTP's): ``LossHead.forward``), for an observer."""
        return tape.back[0][1][0]

    def backward(self, loss_scale: float, saved, tape: Tape):
        """The gradient of loss_scale x (mean loss) -> dx (B_c, T_c, C_c)."""
        s_ln, s_loss, s_mtp = saved
        dh = self.loss.backward(loss_scale, s_loss, self.panel(tape))       # (B_c, T_c, C_c)
        if s_mtp is not None:
            dh = dh + self.mtp.backward(loss_scale, s_mtp, tape, self.panel(tape))
        return self.ln_f.backward(dh, s_ln)


class GPT:
    """The whole model on one rank's share of the layout, or one pipeline
    chunk of it: the blocks ``layers`` (a contiguous range, default all),
    with the embeddings in ``front`` when ``first`` and the final norm and
    loss head in ``back`` when ``last``. A chunk is the same code as the
    whole model with the ends left out, so a pipeline cannot drift from the
    serial model. Modules hold parameter views only; activations go to the
    micro-batch's ``Tape``. Only the chunk's parameters are touched: the
    store needs to hold nothing else.

    ``blocks`` may be wrapped from outside (``Recomputed``, an observer's
    recorder): anything with ``forward(x, ctx) -> (y, saved)`` and
    ``backward(dy, saved) -> dx``."""

    def __init__(self, cfg: ModelConfig, layout: Layout, store: ParamStore, attention, dropout: Dropout,
                 layers: range = None, first: bool = True, last: bool = True):
        self.cfg, self.layout, self.store, self.xp = cfg, layout, store, layout.backend.xp
        self.dropout = dropout                   # the masks' rule, for an observer that draws them again
        self.family = family = family_of(cfg)    # chosen once: the blocks, embeddings and head take its pieces
        self.layers = range(cfg.n_layer) if layers is None else layers
        self.first, self.last = first, last
        # the tied wte serves the lookup (first chunk) and the head (last chunk);
        # an untied model's head is a second embedding over lm_head, used only as a head;
        # multi-token prediction looks tokens up on the last chunk too (model/mtp.py)
        self.embedding = layout.tied_embedding(store) if first or (last and (cfg.tied or cfg.mtp_depth)) else None
        self.head_embedding = None
        if last:
            self.head_embedding = self.embedding if cfg.tied else layout.tied_embedding(store, "lm_head")
        self.front = [Embeddings(layout, store, self.embedding, dropout, family)] if first else []
        self.blocks = [Block(layout, store, i, attention, dropout, family) for i in self.layers]
        mtp = None
        self.n_main = len(self.blocks)           # the main blocks; MTP depths' blocks follow them in ``blocks``
        if last and cfg.mtp_depth:
            self.blocks += [Block(layout, store, i, attention, dropout, family) for i in mtp_blocks(cfg)]
            mtp = MultiTokenPrediction(layout, store, family, self.embedding, layout.loss_head(self.head_embedding),
                                       [], self.n_main)
        self.mtp = mtp
        self.back = [Head(layout, store, self.head_embedding, family, mtp)] if last else []
        untied_head = None if cfg.tied else self.head_embedding
        self.tied = [e for e in (self.embedding, untied_head) if e is not None]   # each finishes its backward
        self.sites = [f"h.{i}" for i in self.layers] + [f"h.{i}" for i in (mtp_blocks(cfg) if mtp else ())]
        self.has_ends = first or last            # the store streams the ends' parameters only for such a chunk

    def forward(self, inputs, targets, ctx: Micro):
        """inputs: token ids (B_dp, T_l) on a chunk with the embeddings, else
        the previous chunk's output (B_c, T_c, C_c); targets (B_dp, T_l) or
        None. Returns (out, tape): on a chunk with the head, this rank's
        share of the loss summed over its rows ((1,), on the device; (1 +
        D,) with D multi-token prediction depths: the main sum, then each
        depth's), else the chunk's output (B_c, T_c, C_c)."""
        self.store.refresh_work()            # the 16-bit working copy, after an optimizer step or a load
        resident = self.store.layers("forward", self.sites, self.has_ends)   # the store brings each block's weights in
        tape, x = Tape(ctx, targets), inputs
        if self.mtp is not None:                 # the depths' blocks, as wrapped now, streamed after the main ones
            self.mtp.blocks, self.mtp.resident = self.blocks[self.n_main:], resident
        for piece in self.front:
            x, saved = piece.forward(x, tape)
            tape.front.append(saved)
        for k, block in enumerate(self.blocks[:self.n_main]):
            resident.enter(k)
            x, saved = block.forward(x, ctx)                    # (B_c, T_c, C_c)
            resident.leave(k)
            tape.blocks.append(saved)
        for piece in self.back:
            x, saved = piece.forward(x, tape)
            tape.back.append(saved)
        return x, tape

    def backward(self, dout, tape: Tape):
        """Adds the gradient of every parameter into the store's gradient
        buffer (before any gradient synchronisation). ``dout`` is the loss
        scale (a float) on a chunk with the head (float16 gradients of
        activations would underflow at their true size: the trainer divides
        the float32 parameter gradients back), else the gradient of the
        chunk's output (B_c, T_c, C_c). Returns the gradient of the chunk's
        input (B_c, T_c, C_c), or None on a chunk with the embeddings."""
        resident = self.store.layers("backward", self.sites, self.has_ends)  # the store sends each block's gradients
        dx = dout
        if self.mtp is not None:
            self.mtp.blocks, self.mtp.resident = self.blocks[self.n_main:], resident
        for piece in reversed(self.back):
            dx = piece.backward(dx, tape.back.pop(), tape)
        for k in reversed(range(self.n_main)):
            resident.enter(k)                                   # a rerun shares the backward's gather
            dx = self.blocks[k].backward(dx, tape.blocks.pop())
            resident.leave(k)
        for piece in reversed(self.front):
            dx = piece.backward(dx, tape.front.pop(), tape)
        for embedding in self.tied:
            embedding.finish_backward(tape.panel if embedding is self.embedding else tape.head_panel)
        resident.finish()
        self.store.settle()
        return dx

    @property
    def ln_f(self):
        """The final LayerNorm (None on a chunk without the head)."""
        return self.back[0].ln_f if self.back else None

    def new_caches(self, positions: int = None) -> list:
        """An empty key/value cache per block for this rank's sequences
        and kv heads (``Block.n_local_kv``: under grouped-query attention
        fewer than its query heads), over ``positions`` positions: what a
        generation will use (the prompt plus the new tokens), the whole
        context when not given. Sized from the context, a Llama declaring
        2**26 positions would take gigabytes to write two tokens."""
        cfg, layout = self.cfg, self.layout
        n = cfg.n_ctx if positions is None else min(int(positions), cfg.n_ctx)
        return [block.new_cache(self.xp, n, self.layout.backend.dtype) for block in self.blocks[:self.n_main]]

    def decode(self, idx, pos: int, caches: list):
        """Logits of positions pos .. pos+t-1 given their tokens idx (B_dp, t)
        and the caches holding positions before pos: (B_l, t, V_l), this
        rank's rows ``embedding.logit_seqs`` and vocabulary block. On a
        pipeline chunk, as ``forward``: the previous chunk's output in,
        this chunk's output (B_c, t, C_c) out unless it is ``last``."""
        self.store.refresh_work()
        resident = self.store.layers("forward", self.sites, self.has_ends)
        t = idx.shape[1]
        panel = Panel()
        if self.first:
            x = self.embedding.embed(self.xp.asarray(idx), panel)[0]          # (B_c, t, C_c)
            if self.front[0].wpe is not None:
                x = x + self.front[0].wpe[pos:pos + t]
        else:
            x = idx
        for k, (block, cache) in enumerate(zip(self.blocks, caches)):
            resident.enter(k)
            x = block.decode(x, cache, pos)
            resident.leave(k)
        if not self.last:
            return x
        head_panel = panel if self.cfg.tied else Panel()
        return self.head_embedding.logits(self.ln_f.forward(x)[0], head_panel)[0]   # (B_l, t, V_l)
