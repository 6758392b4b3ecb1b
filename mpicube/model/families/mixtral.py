"""Mixtral: Llama with a mixture of SwiGLU experts in each block's MLP
place (``moe.MoE``: a router and n_experts experts; docs/moe.md), the
first ``first_k_dense`` blocks keeping Llama's dense MLP. The mixture's
DeepSeekMoE options (sigmoid router, groups, shared experts) are the
block's own, so any family with experts takes them as this one does."""

from __future__ import annotations

from ..moe import MoE, expert_names, moe_params
from .llama import Llama


class Mixtral(Llama):
    name = "mixtral"
    hf_map = "hf_mixtral_hub"

    def mlp_names(self, cfg, i):
        return expert_names(cfg, i) if cfg.is_moe(i) else super().mlp_names(cfg, i)

    def mlp_params(self, cfg, i, std, resid_std):
        return moe_params(cfg, i, std, resid_std) if cfg.is_moe(i) else super().mlp_params(cfg, i, std, resid_std)

    def mlp(self, layout, store, i):
        return MoE(layout, store, i) if layout.cfg.is_moe(i) else super().mlp(layout, store, i)
