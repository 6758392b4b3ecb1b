"""DeepSeek-V3: Llama's skeleton (RMSNorm, SwiGLU, no biases, an untied
head) with multi-head latent attention (``latent_attention.LatentAttention``,
``ops.mla``). Parameters under the names ``files.formats.hf_deepseek``
maps to Hugging Face's DeepseekV3, with their linear kinds: q_down and
kv_down REPLICATED (small low-rank projections every tp rank holds whole),
q_up / q_proj and kv_up COLUMN by heads (each head's columns contiguous),
c_proj ROW.

The MLP: Llama's dense SwiGLU on the first ``first_k_dense`` blocks
(every block without --n-routed-experts), DeepSeekMoE after them: the
mixture block ``moe.MoE`` with its sigmoid router (this family's default,
``core.config.family_fields``), groups and shared experts, plugged in as
Mixtral's is.
"""

from __future__ import annotations

import math

from ...core.config import ModelConfig
from ...core.errors import ConfigError
from ...parallel.params import ParamDecl
from ..latent_attention import LatentAttention
from ..mtp import MTP_OWN, mtp_blocks, own_params
from .mixtral import Mixtral


def attention_names(cfg: ModelConfig) -> tuple:
    """Block i's attention suffixes (after ``h.{i}.``), in hf_deepseek's order."""
    q = ("attn.q_down.weight", "attn.q_norm.weight", "attn.q_up.weight") if cfg.q_lora_rank else \
        ("attn.q_proj.weight",)
    return ("ln_1.weight",) + q + ("attn.kv_down.weight", "attn.kv_norm.weight", "attn.kv_up.weight",
                                   "attn.c_proj.weight", "ln_2.weight")


class DeepseekV3(Mixtral):
    name = "deepseek_v3"
    hf_map = ""                 # no trace-checker name map for HF DeepseekV3 yet

    def check(self, cfg):
        if cfg.v_head_dim > cfg.qk_nope_head_dim + cfg.qk_rope_head_dim:
            raise ConfigError(f"--v-head-dim {cfg.v_head_dim} must be at most --qk-nope-head-dim + "
                              f"--qk-rope-head-dim {cfg.qk_nope_head_dim + cfg.qk_rope_head_dim}")

    def param_names(self, cfg):
        yield "wte"
        for i in range(cfg.n_layer):
            for suffix in attention_names(cfg) + tuple(self.mlp_names(cfg, i)):
                yield f"h.{i}.{suffix}"
        yield "ln_f.weight"
        if not cfg.tied:
            yield "lm_head"
        for j, i in enumerate(mtp_blocks(cfg)):      # the MTP depths: a block each, then their own tensors
            for suffix in attention_names(cfg) + tuple(self.mlp_names(cfg, i)):
                yield f"h.{i}.{suffix}"
            for suffix in MTP_OWN:
                yield f"mtp.{j}.{suffix}"

    def attention_params(self, cfg: ModelConfig, i: int, std: float, resid_std: float) -> list:
        """Block i's MLA projections and latent norms (ops/mla.py's shapes)."""
        h, nh, p = cfg.n_embd, cfg.n_head, f"h.{i}.attn."
        qk, kv_head, rq, rkv = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.qk_nope_head_dim + cfg.v_head_dim, \
            cfg.q_lora_rank, cfg.kv_lora_rank
        if rq:
            decls = [ParamDecl(p + "q_down.weight", (h, rq), "w_replicated", "normal", std, decay=True),
                     ParamDecl(p + "q_norm.weight", (rq,), "norm", "ones"),
                     ParamDecl(p + "q_up.weight", (rq, nh * qk), "w_column", "normal", std, decay=True)]
        else:
            decls = [ParamDecl(p + "q_proj.weight", (h, nh * qk), "w_column", "normal", std, decay=True)]
        return decls + [
            ParamDecl(p + "kv_down.weight", (h, rkv + cfg.qk_rope_head_dim), "w_replicated", "normal", std,
                      decay=True),
            ParamDecl(p + "kv_norm.weight", (rkv,), "norm", "ones"),
            ParamDecl(p + "kv_up.weight", (rkv, nh * kv_head), "w_column", "normal", std, decay=True),
            ParamDecl(p + "c_proj.weight", (nh * cfg.v_head_dim, h), "w_row", "normal", resid_std, decay=True),
        ]

    def params(self, cfg):
        """N(0, 0.02), residual projections scaled by 1/sqrt(2 n_layer), norm weights 1 (Llama's rule)."""
        self.check(cfg)
        h, std = cfg.n_embd, 0.02
        resid_std = std / math.sqrt(2 * cfg.n_layer)
        decls = [ParamDecl("wte", (cfg.vocab_size, h), "wte", "normal", std)]
        for i in range(cfg.n_layer):
            decls += self.block_params(cfg, i, std, resid_std)
        decls.append(ParamDecl("ln_f.weight", (h,), "norm", "ones"))
        if not cfg.tied:
            decls.append(ParamDecl("lm_head", (cfg.vocab_size, h), "wte", "normal", std))
        for j, i in enumerate(mtp_blocks(cfg)):          # after the main model: older files' order unchanged
            decls += self.block_params(cfg, i, std, resid_std) + own_params(cfg, j, std)
        return decls

    def block_params(self, cfg: ModelConfig, i: int, std: float, resid_std: float) -> list:
        """Block i's norms, MLA and MLP (a main block, or an MTP depth's at i >= n_layer)."""
        h = cfg.n_embd
        return ([ParamDecl(f"h.{i}.ln_1.weight", (h,), "norm", "ones")] + self.attention_params(cfg, i, std, resid_std)
                + [ParamDecl(f"h.{i}.ln_2.weight", (h,), "norm", "ones")] + self.mlp_params(cfg, i, std, resid_std))

    def attention(self, layout, store, i, attention, dropout):
        return LatentAttention(layout, store, f"h.{i}.attn", attention, dropout, f"h.{i}")
