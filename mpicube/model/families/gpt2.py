"""GPT-2: LayerNorm, a learned position table, biases on every linear,
plain multi-head attention, a GELU MLP of width 4h, the LM head tied to
the token embedding."""

from __future__ import annotations

import math

from ...core.config import ModelConfig
from ...parallel.layouts.modules import LayerNorm
from ...parallel.params import ParamDecl
from ..attention import PlainAttention, SelfAttention
from ..mlp import DenseMLP, Gelu
from .base import Family

LAYER_PARAMS = ("ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias", "attn.c_proj.weight",
                "attn.c_proj.bias", "ln_2.weight", "ln_2.bias", "mlp.c_fc.weight", "mlp.c_fc.bias",
                "mlp.c_proj.weight", "mlp.c_proj.bias")     # each block's, in params' order


class GPT2(Family):
    name = "gpt2"
    hf_map = "hf_gpt2"
    position_table = True

    def param_names(self, cfg: ModelConfig):
        yield "wte"
        yield "wpe"
        for i in range(cfg.n_layer):
            for suffix in LAYER_PARAMS:
                yield f"h.{i}.{suffix}"
        yield "ln_f.weight"
        yield "ln_f.bias"

    def params(self, cfg: ModelConfig) -> list:
        """Every logical parameter under its GPT-2 name, with GPT-2's init:
        N(0, 0.02), residual projections scaled by 1/sqrt(2 n_layer)."""
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
                ParamDecl(p + "attn.c_attn.weight", (h, 3 * h), "w_column", "normal", std, decay=True, groups=3),
                ParamDecl(p + "attn.c_attn.bias", (3 * h,), "b_column", "zeros", groups=3),
                ParamDecl(p + "attn.c_proj.weight", (h, h), "w_row", "normal", resid_std, decay=True),
                ParamDecl(p + "attn.c_proj.bias", (h,), "b_row", "zeros"),
                ParamDecl(p + "ln_2.weight", (h,), "norm", "ones"),
                ParamDecl(p + "ln_2.bias", (h,), "norm", "zeros"),
                ParamDecl(p + "mlp.c_fc.weight", (h, 4 * h), "w_column", "normal", std, decay=True),
                ParamDecl(p + "mlp.c_fc.bias", (4 * h,), "b_column", "zeros"),
                ParamDecl(p + "mlp.c_proj.weight", (4 * h, h), "w_row", "normal", resid_std, decay=True),
                ParamDecl(p + "mlp.c_proj.bias", (h,), "b_row", "zeros"),
            ]
        decls += [ParamDecl("ln_f.weight", (h,), "norm", "ones"), ParamDecl("ln_f.bias", (h,), "norm", "zeros")]
        return decls

    def norm(self, store, prefix, layout):
        return LayerNorm(store, prefix, layout.cfg.n_embd, layout.hidden_comm)

    def attention(self, layout, store, i, attention, dropout):
        core = PlainAttention(attention, len(layout.head_ids))
        return SelfAttention(layout, store, f"h.{i}.attn", core, attention, dropout, f"h.{i}", bias=True)

    def mlp(self, layout, store, i):
        return DenseMLP(layout, store, f"h.{i}.mlp", Gelu, bias=True)
