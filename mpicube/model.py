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

from . import kvcache, ops, precision, rng
from .config import ModelConfig
from .layouts.base import Layout, LayerNorm
from .params import ParamDecl, ParamStore


def gpt_params(cfg: ModelConfig) -> list:
    """Every logical parameter under its GPT-2 name, with GPT-2's init."""
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


class Dropout:
    """Masks that are a pure function of (seed, step, site, global index), so
    every layout drops the same elements (DESIGN.md section 2). They are
    drawn where the activations live: on a GPU the hash runs on the device
    and nothing is copied per step but a few small index vectors, once."""

    def __init__(self, p: float, seed: int, layout: Layout):
        self.p, self.seed, self.layout = p, seed, layout
        self.keep = 1.0 - p
        cfg = layout.cfg
        first_seq = layout.axes.dp.rank * layout.local_batch
        self.canonical_seqs = first_seq + layout.canonical_seqs   # global sequence ids
        self.mid_seqs = first_seq + layout.mid_seqs
        self.canonical_shape = (layout.batch_size, cfg.n_ctx, cfg.n_embd)
        self._indices = {}                                        # (kind, T) -> index vectors on the device

    def _mask(self, step, site, global_shape, kind, T, index):
        """(block shape) keep mask: 1.0 where kept, 0.0 where dropped."""
        backend = self.layout.backend
        if (kind, T) not in self._indices:
            self._indices[kind, T] = tuple(backend.xp.asarray(ix, dtype=np.uint64) for ix in index)
        counter = rng.flat_index(global_shape, self._indices[kind, T], backend.xp)   # (block shape) uint64
        return ops.keep_mask(rng.make_key(self.seed, "dropout", step, site), counter, self.p, backend.dtype)

    def canonical(self, step, site, T):
        """(B_c, T, C_c) keep mask for an activation in canonical form, or None."""
        if self.p == 0.0:
            return None
        index = (self.canonical_seqs, np.arange(T), self.layout.canonical_cols)
        mask = self._mask(step, site, self.canonical_shape, "canonical", T, index)
        mask *= 1.0 / self.keep
        return mask

    def attention(self, step, site, T):
        """(B_m, nh, T, T) keep mask on attention probabilities, or None."""
        if self.p == 0.0:
            return None
        cfg = self.layout.cfg
        shape = (self.layout.batch_size, cfg.n_head, cfg.n_ctx, cfg.n_ctx)
        index = (self.mid_seqs, self.layout.head_ids, np.arange(T), np.arange(T))
        return self._mask(step, site, shape, "attention", T, index)


class Block:
    """Pre-LN transformer block: x += attn(ln_1(x)); x += mlp(ln_2(x))."""

    def __init__(self, layout: Layout, store: ParamStore, i: int):
        p, h = f"h.{i}.", layout.cfg.n_embd
        self.site = f"h.{i}"
        self.ln_1 = LayerNorm(store, p + "ln_1", h, layout.hidden_comm)
        self.c_attn = layout.linear(store, p + "attn.c_attn", "first")
        self.c_proj = layout.linear(store, p + "attn.c_proj", "second")
        self.ln_2 = LayerNorm(store, p + "ln_2", h, layout.hidden_comm)
        self.c_fc = layout.linear(store, p + "mlp.c_fc", "first")
        self.mlp_proj = layout.linear(store, p + "mlp.c_proj", "second")
        self.n_local_heads = len(layout.head_ids)

    def forward(self, x, dropout: Dropout, step: int):
        """x (B_c, T, C_c) -> (B_c, T, C_c)."""
        T = x.shape[1]
        self.keep_attn = dropout.attention(step, self.site + ".attn", T)
        self.keep_resid_attn = dropout.canonical(step, self.site + ".resid_attn", T)
        self.keep_resid_mlp = dropout.canonical(step, self.site + ".resid_mlp", T)

        qkv = self.c_attn.forward(self.ln_1.forward(x))                       # (B_m, T, 3 C_m)
        a, self.attn_cache = ops.attention_forward(qkv, self.n_local_heads, self.keep_attn, dropout.keep)
        y = self.c_proj.forward(a)                                             # (B_c, T, C_c)
        if self.keep_resid_attn is not None:
            y *= self.keep_resid_attn
        x = x + y
        f = self.c_fc.forward(self.ln_2.forward(x))                           # (B_m, T, 4 C_m)
        g, self.gelu_cache = ops.gelu_forward(f)
        y = self.mlp_proj.forward(g)                                           # (B_c, T, C_c)
        if self.keep_resid_mlp is not None:
            y *= self.keep_resid_mlp
        return x + y

    def backward(self, dx):
        """dx (B_c, T, C_c) -> (B_c, T, C_c)."""
        dy = dx if self.keep_resid_mlp is None else dx * self.keep_resid_mlp
        dg = self.mlp_proj.backward(dy)
        df = ops.gelu_backward(dg, self.gelu_cache)
        dx = dx + self.ln_2.backward(self.c_fc.backward(df))
        dy = dx if self.keep_resid_attn is None else dx * self.keep_resid_attn
        da = self.c_proj.backward(dy)
        dqkv = ops.attention_backward(da, self.attn_cache)
        dx = dx + self.ln_1.backward(self.c_attn.backward(dqkv))
        self.attn_cache = self.gelu_cache = None
        return dx

    def decode(self, x, cache, pos: int):
        """Inference on positions pos .. pos+t-1 with a key/value cache
        (mpicube.kvcache), no dropout: x (B_c, t, C_c) -> (B_c, t, C_c)."""
        qkv = self.c_attn.forward(self.ln_1.forward(x))                       # (B_m, t, 3 C_m)
        x = x + self.c_proj.forward(kvcache.cached_attention(qkv, self.n_local_heads, cache, pos))
        g, _ = ops.gelu_forward(self.c_fc.forward(self.ln_2.forward(x)))      # (B_m, t, 4 C_m)
        return x + self.mlp_proj.forward(g)


class GPT:
    """The whole model on one rank's share of the layout."""

    def __init__(self, cfg: ModelConfig, layout: Layout, store: ParamStore, dropout: float = 0.0, seed: int = 0):
        self.cfg, self.layout, self.store = cfg, layout, store
        self.xp = layout.backend.xp
        self.embedding = layout.tied_embedding(store)
        self.wpe, self.dwpe = store.work["wpe"], store.grad["wpe"]    # (n_ctx, C_c)
        self.blocks = [Block(layout, store, i) for i in range(cfg.n_layer)]
        self.ln_f = LayerNorm(store, "ln_f", cfg.n_embd, layout.hidden_comm)
        self.dropout = Dropout(dropout, seed, layout)
        # Opt-in (mpicube.trace): a dict that forward fills with this rank's
        # canonical blocks of "emb", "h.{i}" and "ln_f"; None costs nothing.
        self.capture = None

    def forward(self, idx, targets, step: int = 0) -> float:
        """idx, targets (B_dp, T): this data-parallel replica's batch.
        Returns the mean cross-entropy over the whole global batch."""
        xp, layout = self.xp, self.layout
        self.store.refresh_work()                # the 16-bit working copy, after an optimizer step or a load
        idx = xp.asarray(idx)
        B, T = idx.shape
        self.n_tokens = layout.batch_size * T                               # N, global
        x = self.embedding.embed(idx)                                       # (B_c, T, C_c)
        x = x + self.wpe[:T]
        self.keep_emb = self.dropout.canonical(step, "emb", T)
        if self.keep_emb is not None:
            x *= self.keep_emb
        capture = self.capture
        if capture is not None:
            capture["emb"] = x.copy()                                       # (B_c, T, C_c)
        for i, block in enumerate(self.blocks):
            x = block.forward(x, self.dropout, step)
            if capture is not None:
                capture[f"h.{i}"] = x.copy()                                # (B_c, T, C_c)
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
        return float(layout.axes.world.allreduce(local)[0]) / self.n_tokens

    def new_caches(self) -> list:
        """An empty key/value cache per block for this rank's sequences
        and heads, over the whole context."""
        cfg, layout = self.cfg, self.layout
        return [kvcache.KVCache(self.xp, len(layout.mid_seqs), len(layout.head_ids), cfg.n_ctx, cfg.head_dim,
                                self.layout.backend.dtype) for _ in self.blocks]

    def decode(self, idx, pos: int, caches: list):
        """Logits of positions pos .. pos+t-1 given their tokens idx (B_dp, t)
        and the caches holding positions before pos: (B_l, t, V_l), this
        rank's rows ``embedding.logit_seqs`` and vocabulary block."""
        self.store.refresh_work()
        idx = self.xp.asarray(idx)
        t = idx.shape[1]
        x = self.embedding.embed(idx) + self.wpe[pos:pos + t]              # (B_c, t, C_c)
        for block, cache in zip(self.blocks, caches):
            x = block.decode(x, cache, pos)
        return self.embedding.logits(self.ln_f.forward(x))                  # (B_l, t, V_l)

    def saved_elements(self) -> int:
        """Floating-point elements this rank holds for backward right after
        forward: activations, gathered weight panels, dropout masks. Counted
        by walking every module's caches (each buffer once, parameters
        excluded), to check the analytic memory model against what the code
        really keeps."""
        return sum(a.size for a in self._saved_buffers())

    def saved_bytes(self) -> int:
        """The bytes of ``saved_elements`` (16-bit activations, float32
        statistics and gradient panels under mixed precision)."""
        return sum(a.nbytes for a in self._saved_buffers())

    def _saved_buffers(self) -> list:
        """The distinct floating-point buffers behind every module's caches."""
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

        modules = [self, self.embedding, self.ln_f]
        for block in self.blocks:
            modules += [block, block.ln_1, block.c_attn, block.c_proj, block.ln_2, block.c_fc, block.mlp_proj]
        for module in modules:
            for value in vars(module).values():
                visit(value)
        return list(seen.values())

    def backward(self, loss_scale: float = 1.0) -> None:
        """Adds d(mean loss)/d(parameter) into the store's gradient buffer
        (before any gradient synchronisation), times ``loss_scale``: float16
        gradients of activations would underflow at their true size, so
        dynamic loss scaling (mpicube.loss_scale) raises them and divides
        the float32 parameter gradients back afterwards."""
        dlogits = ops.cross_entropy_backward(loss_scale / self.n_tokens, self.ce_cache)
        dlogits = dlogits.reshape(self.logits.shape)                       # (B_l, T, V_l)
        dx = self.embedding.logits_backward(dlogits)                       # (B_c, T, C_c)
        dx = self.ln_f.backward(dx)
        for block in reversed(self.blocks):
            dx = block.backward(dx)
        if self.keep_emb is not None:
            dx = dx * self.keep_emb
        B, T, C = dx.shape
        self.dwpe[:T] += dx.sum(0) if dx.dtype == self.dwpe.dtype else ops.column_sums(
            dx.reshape(B, T * C)).reshape(T, C)                            # 16-bit dx: summed in float32+
        self.embedding.embed_backward(dx)
        self.embedding.finish_backward()
        self.store.settle()
        self.ce_cache = self.logits = None
