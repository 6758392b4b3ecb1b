"""GPT-2, written once against the layout protocol (layouts/base.py).

Nothing here knows which layout it runs on: the layout supplies the linears,
the tied embedding / LM head and the communicator of the hidden split; the
model only strings them together with local ops from ``mpicube.ops``.
Shapes use the layout's local sizes: B_c/C_c canonical rows/columns,
B_m/C_m between paired linears, V_l local vocabulary.
"""

from __future__ import annotations

import math

import numpy as np

from . import kvcache
from .. import ops
from ..device import precision
from ..core import memory
from ..core.config import ModelConfig
from ..parallel import context
from ..parallel.layouts.base import Layout, LayerNorm
from ..parallel.params import ParamDecl, ParamStore
from .block import Block, Dropout


LAYER_PARAMS = ("ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias", "attn.c_proj.weight",
                "attn.c_proj.bias", "ln_2.weight", "ln_2.bias", "mlp.c_fc.weight", "mlp.c_fc.bias",
                "mlp.c_proj.weight", "mlp.c_proj.bias")     # each block's, in gpt_params' order


def param_names(cfg: ModelConfig):
    """The GPT-2 names of ``gpt_params(cfg)``, in order, one at a time: a
    file reader walks them to find the first one a file lacks without
    building a list as long as its header claims."""
    yield "wte"
    yield "wpe"
    for i in range(cfg.n_layer):
        for suffix in LAYER_PARAMS:
            yield f"h.{i}.{suffix}"
    yield "ln_f.weight"
    yield "ln_f.bias"


def gpt_params(cfg: ModelConfig) -> list:
    """Every logical parameter under its GPT-2 name, with GPT-2's init.
    Every model and shape list is built here, so this is where a model
    whose tensor list alone cannot fit in memory is refused (one line),
    instead of minutes of building and a MemoryError."""
    memory.require_tensors(cfg.n_layer)
    h, std = cfg.n_embd, 0.02
    resid_std = std / math.sqrt(2 * cfg.n_layer)   # residual projections
    decls = [
        ParamDecl("wte", (cfg.vocab_size, h), "wte", "normal", std),
        ParamDecl("wpe", (cfg.n_ctx, h), "wpe", "normal", std),
    ]
    for i in range(cfg.n_layer):
        p = f"h.{i}."
        decls += [
            ParamDecl(p + "ln_1.weight", (h,), "norm", "ones"),
            ParamDecl(p + "ln_1.bias", (h,), "norm", "zeros"),
            ParamDecl(p + "attn.c_attn.weight", (h, 3 * h), "w_first", "normal", std, decay=True, groups=3),
            ParamDecl(p + "attn.c_attn.bias", (3 * h,), "b_first", "zeros", groups=3),
            ParamDecl(p + "attn.c_proj.weight", (h, h), "w_second", "normal", resid_std, decay=True),
            ParamDecl(p + "attn.c_proj.bias", (h,), "b_second", "zeros"),
            ParamDecl(p + "ln_2.weight", (h,), "norm", "ones"),
            ParamDecl(p + "ln_2.bias", (h,), "norm", "zeros"),
            ParamDecl(p + "mlp.c_fc.weight", (h, 4 * h), "w_first", "normal", std, decay=True),
            ParamDecl(p + "mlp.c_fc.bias", (4 * h,), "b_first", "zeros"),
            ParamDecl(p + "mlp.c_proj.weight", (4 * h, h), "w_second", "normal", resid_std, decay=True),
            ParamDecl(p + "mlp.c_proj.bias", (h,), "b_second", "zeros"),
        ]
    decls += [ParamDecl("ln_f.weight", (h,), "norm", "ones"), ParamDecl("ln_f.bias", (h,), "norm", "zeros")]
    return decls


class GPT:
    """The whole model on one rank's share of the layout, or one pipeline
    chunk of it: the blocks ``layers`` (a contiguous range, default all),
    with the embeddings when ``first`` and the final LayerNorm and LM head
    when ``last``. A chunk is the same code as the whole model with the ends
    left out (mpicube.parallel.pipeline runs chunks), so a pipeline cannot
    drift from the serial model. Only the chunk's parameters are touched:
    the store needs to hold nothing else."""

    def __init__(self, cfg: ModelConfig, layout: Layout, store: ParamStore, dropout: float = 0.0, seed: int = 0,
                 grad_accum: int = 1, layers: range = None, first: bool = True, last: bool = True):
        self.cfg, self.layout, self.store = cfg, layout, store
        # The layout runs one micro-batch; a step is ``grad_accum`` of them
        # (mpicube.training.accum), and the loss is the mean over the whole step.
        self.grad_accum = grad_accum
        self.xp = layout.backend.xp
        self.layers = range(cfg.n_layer) if layers is None else layers
        self.first, self.last = first, last
        # the tied wte serves the lookup (first chunk) and the head (last chunk)
        self.embedding = layout.tied_embedding(store) if first or last else None
        if first:
            self.wpe, self.dwpe = store.work["wpe"], store.grad["wpe"]    # (n_ctx, C_c)
        self.blocks = [Block(layout, store, i) for i in self.layers]
        self.sites = [block.site for block in self.blocks]
        self.ln_f = LayerNorm(store, "ln_f", cfg.n_embd, layout.hidden_comm) if last else None
        self.dropout = Dropout(dropout, seed, layout, grad_accum)
        # The loss is summed over these ranks; None: each rank returns its own
        # share (a pipeline sums the shares of its last stage once per step).
        self.loss_comm = layout.axes.world
        # --recompute blocks: the largest set of one block's caches right after
        # its rerun in the last backward (elements, bytes); 0 otherwise.
        self.recompute_peak_elements = self.recompute_peak_bytes = 0
        # Opt-in (mpicube.analysis.trace): a dict that forward fills with this rank's
        # canonical blocks of "emb", "h.{i}" and "ln_f"; None costs nothing.
        self.capture = None

    def forward(self, idx, targets, step: int = 0, micro: int = 0):
        """idx, targets (B_dp, T): this data-parallel replica's rows of
        micro-batch ``micro`` of the step (the whole step's rows when it has
        one). Returns this micro-batch's cross-entropy summed and divided by
        the whole step's token count, so the micro-batches' returns (and
        gradients) add up to the step's mean (and its gradient).
        On a chunk that is not ``first``, ``idx`` is the previous chunk's
        output (B_c, T, C_c); on one that is not ``last`` the return is
        this chunk's output (B_c, T, C_c) and ``targets`` is unused."""
        xp, layout = self.xp, self.layout
        self.store.refresh_work()                # the 16-bit working copy, after an optimizer step or a load
        # --zero 3 gathers each block's parameters just before it runs (parallel.fsdp); else no-ops
        layers = self.store.layers("forward", self.sites)
        T = idx.shape[1]
        self.dropout.micro = micro
        self.n_tokens = layout.batch_size * self.grad_accum * T            # N, global, of the whole step
        ring = layout.axes.cp
        if ring.size > 1:                   # --cp: this rank's two chunks of every sequence (parallel.context)
            # (grid.plan refuses --cp with --pp: this chunk is the whole model, first and last)
            pos = context.local_positions(T, ring.size, ring.rank)         # (T_l,) global positions
            idx, targets = np.asarray(idx)[:, pos], np.asarray(targets)[:, pos]
            self.dropout.global_positions = pos
            self.pos = xp.asarray(pos)
        elif layout.seq_positions(T) is not None:   # --sequence-parallel: canonical rows a run of T/tp positions
            pos = layout.seq_positions(T)                                   # (T_c,) global positions
            self.dropout.global_positions = pos
            self.pos = xp.asarray(pos)
        else:
            self.pos = slice(0, T)
        capture = self.capture
        if self.first:
            idx = xp.asarray(idx)
            x = self.embedding.embed(idx)                                   # (B_c, T_l, C_c)
            T = x.shape[1]                                                  # T_l: this rank's canonical positions
            x = x + self.wpe[self.pos]
            self.keep_emb = self.dropout.canonical(step, "emb", T)
            if self.keep_emb is not None:
                x *= self.keep_emb
            if capture is not None:
                capture["emb"] = x.copy()                                   # (B_c, T, C_c)
        else:
            x = idx                                                         # (B_c, T, C_c) received
        for k, (i, block) in enumerate(zip(self.layers, self.blocks)):   # k: this chunk's k-th block, layer i
            layers.enter(k)
            x = block.forward(x, self.dropout, step)
            layers.leave(k)
            if capture is not None:
                capture[f"h.{i}"] = x.copy()                                # (B_c, T, C_c)
        if not self.last:
            return x
        x = self.ln_f.forward(x)
        if capture is not None:
            capture["ln_f"] = x.copy()                                      # (B_c, T, C_c)
        logits = self.embedding.logits(x)                                   # (B_l, T, V_l)
        self.logits = logits
        emb = self.embedding
        rows = xp.asarray(emb.logit_seqs)
        tgt = xp.asarray(targets)[rows].reshape(-1)                         # (B_l*T,)
        comm = emb.vocab_comm
        allmax = (lambda a: comm.allreduce(a, "max")) if comm is not None else ops.identity
        allsum = comm.allreduce if comm is not None else ops.identity
        row_loss, self.ce_cache = ops.cross_entropy_forward(
            logits.reshape(-1, logits.shape[-1]), tgt, emb.vocab_start, self.cfg.vocab_size, allmax, allsum)
        local = row_loss.sum(dtype=xp.float64).reshape(1) / emb.row_replicas   # (1,) on the device
        if self.loss_comm is None:
            return float(layout.backend.to_host(local)[0]) / self.n_tokens
        return float(self.loss_comm.allreduce(local)[0]) / self.n_tokens

    def named_modules(self) -> list:
        """(GPT-2 name, layer or None, module, methods) of every module whose
        calls a profile times (``mpicube.analysis.profile``): the tied
        embedding, each block and its layers, ln_f. Listed here, beside the
        code that calls them, so a profile names what really ran."""
        out = [("wte", None, self.embedding, ("embed", "logits", "logits_backward", "embed_backward"))]
        for i, block in zip(self.layers, self.blocks):
            out.append((block.site, i, block, ("forward", "backward")))
            for attr, name in (("ln_1", "ln_1"), ("c_attn", "attn.c_attn"), ("c_proj", "attn.c_proj"),
                               ("ln_2", "ln_2"), ("c_fc", "mlp.c_fc"), ("mlp_proj", "mlp.c_proj")):
                out.append((f"{block.site}.{name}", i, getattr(block, attr), ("forward", "backward")))
        out.append(("ln_f", None, self.ln_f, ("forward", "backward")))
        return [entry for entry in out if entry[2] is not None]       # a pipeline chunk without the ends

    def new_caches(self) -> list:
        """An empty key/value cache per block for this rank's sequences
        and heads, over the whole context."""
        cfg, layout = self.cfg, self.layout
        return [kvcache.KVCache(self.xp, len(layout.mid_seqs), len(layout.head_ids), cfg.n_ctx, cfg.head_dim,
                                self.layout.backend.dtype) for _ in self.blocks]

    def decode(self, idx, pos: int, caches: list):
        """Logits of positions pos .. pos+t-1 given their tokens idx (B_dp, t)
        and the caches holding positions before pos: (B_l, t, V_l), this
        rank's rows ``embedding.logit_seqs`` and vocabulary block. On a
        pipeline chunk, as ``forward``: the previous chunk's output in,
        this chunk's output (B_c, t, C_c) out unless it is ``last``."""
        self.store.refresh_work()
        layers = self.store.layers("forward", self.sites)
        t = idx.shape[1]
        if self.first:
            x = self.embedding.embed(self.xp.asarray(idx)) + self.wpe[pos:pos + t]   # (B_c, t, C_c)
        else:
            x = idx
        for k, (block, cache) in enumerate(zip(self.blocks, caches)):
            layers.enter(k)
            x = block.decode(x, cache, pos)
            layers.leave(k)
        if not self.last:
            return x
        return self.embedding.logits(self.ln_f.forward(x))                  # (B_l, t, V_l)

    def saved_elements(self) -> int:
        """Floating-point elements this rank holds for backward right after
        forward: activations, gathered weight panels, dropout masks. Counted
        by walking every module's caches (each buffer once, parameters
        excluded), to check the analytic memory model against what the code
        really keeps. Under --recompute blocks, backward holds one rerun
        block's caches on top: ``recompute_peak_elements``."""
        return sum(a.size for a in self._saved_buffers())

    def saved_bytes(self) -> int:
        """The bytes of ``saved_elements`` (16-bit activations, float32
        statistics and gradient panels under mixed precision)."""
        return sum(a.nbytes for a in self._saved_buffers())

    def _saved_buffers(self, modules=None) -> list:
        """The distinct floating-point buffers behind every module's caches
        (of ``modules``, default the whole model's)."""
        params = self.store.buffers()
        seen = {}

        def visit(value):
            if isinstance(value, (tuple, list)):
                for item in value:
                    visit(item)
            elif hasattr(value, "dtype") and hasattr(value, "base") and precision.is_float(value.dtype):
                owner = value
                while owner.base is not None:
                    owner = owner.base
                if not any(owner is p for p in params):
                    seen[id(owner)] = owner

        if modules is None:
            modules = [m for m in (self, self.embedding, self.ln_f) if m is not None]
            for block in self.blocks:
                modules += block.modules()
        for module in modules:
            for value in vars(module).values():
                visit(value)
        return list(seen.values())

    def backward(self, loss_scale: float = 1.0, dy=None):
        """Adds d(mean loss)/d(parameter) into the store's gradient buffer
        (before any gradient synchronisation), times ``loss_scale``: float16
        gradients of activations would underflow at their true size, so
        dynamic loss scaling (mpicube.training.loss_scale) raises them and divides
        the float32 parameter gradients back afterwards. On a pipeline chunk
        that is not ``last``, ``dy`` (B_c, T, C_c) is the gradient of its
        output (already scaled); one that is not ``first`` returns the
        gradient of its input (B_c, T, C_c)."""
        # --zero 2/3: each block's gradients reduce-scattered as its backward ends (parallel.fsdp)
        layers = self.store.layers("backward", self.sites)
        if self.last:
            dlogits = ops.cross_entropy_backward(loss_scale / self.n_tokens, self.ce_cache)
            dlogits = dlogits.reshape(self.logits.shape)                   # (B_l, T, V_l)
            dx = self.embedding.logits_backward(dlogits)                   # (B_c, T, C_c)
            dx = self.ln_f.backward(dx)
            self.ce_cache = self.logits = None
        else:
            dx = dy
        self.recompute_peak_elements = self.recompute_peak_bytes = 0
        for i in reversed(range(len(self.blocks))):
            block = self.blocks[i]
            layers.enter(i)                                                # the rerun shares the backward's gather
            if block.replay is not None:                                   # --recompute blocks
                block.rerun()
                rebuilt = self._saved_buffers(block.modules())             # this block's caches
                self.recompute_peak_elements = max(self.recompute_peak_elements, sum(a.size for a in rebuilt))
                self.recompute_peak_bytes = max(self.recompute_peak_bytes, sum(a.nbytes for a in rebuilt))
            dx = block.backward(dx)
            layers.leave(i)
        if self.first:
            if self.keep_emb is not None:
                dx = dx * self.keep_emb
            B, T, C = dx.shape
            self.dwpe[self.pos] += dx.sum(0) if dx.dtype == self.dwpe.dtype else ops.column_sums(
                dx.reshape(B, T * C)).reshape(T, C)                        # 16-bit dx: summed in float32+
            self.embedding.embed_backward(dx)
            dx = None
        if self.embedding is not None:
            self.embedding.finish_backward()
        layers.finish()
        self.store.settle()
        return dx
