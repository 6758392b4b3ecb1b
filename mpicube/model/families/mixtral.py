"""Mixtral: Llama with a mixture of SwiGLU experts in each block's MLP
place (``moe.MoE``: a router and n_experts experts; docs/moe.md)."""

from __future__ import annotations

from ..moe import MoE, expert_names, moe_params
from .llama import Llama


class Mixtral(Llama):
    name = "mixtral"
    hf_map = "hf_mixtral_hub"

    def mlp_names(self, cfg, i):
        return expert_names(cfg, i)

    def mlp_params(self, cfg, i, std, resid_std):
        return moe_params(cfg, i, std, resid_std)

    def mlp(self, layout, store, i):
        return MoE(layout, store, i)
