"""Llama: RMSNorm, rotary positions in attention with grouped-query heads
(``rotary.RotaryAttention``), a SwiGLU MLP, no biases, an untied LM head
unless --tie-embeddings. Parameters under GPT-2's names where the tensor
plays the same part, with GPT-2's init rule."""

from __future__ import annotations

import math

from ...core.config import ModelConfig
from ...core.errors import ConfigError
from ...parallel.layouts.modules import RMSNorm
from ...parallel.params import ParamDecl
from ..attention import SelfAttention
from ..mlp import DenseMLP, SwiGLU
from ..rotary import RotaryAttention
from .base import Family

ATTENTION_PARAMS = ("ln_1.weight", "attn.c_attn.weight", "attn.c_proj.weight", "ln_2.weight")   # each block's
MLP_PARAMS = ("mlp.c_fc.weight", "mlp.c_proj.weight")          # then these, or a mixture's (families/mixtral.py)
LAYER_PARAMS = ATTENTION_PARAMS + MLP_PARAMS


def check_config(cfg: ModelConfig) -> None:
    """ConfigError naming the setting a Llama configuration gets wrong."""
    if cfg.n_embd % cfg.n_head:
        raise ConfigError(f"--n-embd {cfg.n_embd} must be divisible by --n-head {cfg.n_head}")
    if cfg.head_dim % 2:
        raise ConfigError(f"rotary embeddings need an even head size; n_embd / n_head = {cfg.head_dim}")
    if cfg.n_head % cfg.kv_heads:
        raise ConfigError(f"--n-kv-head {cfg.kv_heads} must divide --n-head {cfg.n_head}")


class Llama(Family):
    name = "llama"
    hf_map = "hf_llama"

    def check(self, cfg):
        check_config(cfg)

    def mlp_names(self, cfg: ModelConfig, i: int):
        """Block i's MLP parameter suffixes (after ``h.{i}.``), in order."""
        return MLP_PARAMS

    def mlp_params(self, cfg: ModelConfig, i: int, std: float, resid_std: float) -> list:
        """Block i's MLP: c_fc [gate | up] (h, 2F) and c_proj (F, h)."""
        h, F, p = cfg.n_embd, cfg.ffn, f"h.{i}."
        return [
            ParamDecl(p + "mlp.c_fc.weight", (h, 2 * F), "w_column", "normal", std, decay=True, groups=2),  # [gate|up]
            ParamDecl(p + "mlp.c_proj.weight", (F, h), "w_row", "normal", resid_std, decay=True),
        ]

    def param_names(self, cfg):
        yield "wte"
        for i in range(cfg.n_layer):
            for suffix in ATTENTION_PARAMS:
                yield f"h.{i}.{suffix}"
            for suffix in self.mlp_names(cfg, i):
                yield f"h.{i}.{suffix}"
        yield "ln_f.weight"
        if not cfg.tied:
            yield "lm_head"

    def params(self, cfg):
        """N(0, 0.02), residual projections scaled by 1/sqrt(2 n_layer), norm weights 1."""
        check_config(cfg)
        h, std, hd = cfg.n_embd, 0.02, cfg.head_dim
        resid_std = std / math.sqrt(2 * cfg.n_layer)
        qkv = (cfg.n_head * hd, cfg.kv_heads * hd, cfg.kv_heads * hd)    # [q | k | v] column groups
        decls = [ParamDecl("wte", (cfg.vocab_size, h), "wte", "normal", std)]
        for i in range(cfg.n_layer):
            p = f"h.{i}."
            decls += [
                ParamDecl(p + "ln_1.weight", (h,), "norm", "ones"),
                ParamDecl(p + "attn.c_attn.weight", (h, sum(qkv)), "w_column", "normal", std, decay=True, groups=qkv,
                          heads=(cfg.n_head, cfg.kv_heads, cfg.kv_heads)),
                ParamDecl(p + "attn.c_proj.weight", (h, h), "w_row", "normal", resid_std, decay=True),
                ParamDecl(p + "ln_2.weight", (h,), "norm", "ones"),
            ]
            decls += self.mlp_params(cfg, i, std, resid_std)
        decls.append(ParamDecl("ln_f.weight", (h,), "norm", "ones"))
        if not cfg.tied:
            decls.append(ParamDecl("lm_head", (cfg.vocab_size, h), "wte", "normal", std))
        return decls

    def norm(self, store, prefix, layout):
        cfg = layout.cfg
        return RMSNorm(store, prefix, cfg.n_embd, layout.hidden_comm, cfg.rms_eps)

    def attention(self, layout, store, i, attention, dropout):
        core = RotaryAttention(layout.cfg, attention, layout.head_ids)
        return SelfAttention(layout, store, f"h.{i}.attn", core, attention, dropout, f"h.{i}", bias=False)

    def mlp(self, layout, store, i):
        return DenseMLP(layout, store, f"h.{i}.mlp", SwiGLU, bias=False)
