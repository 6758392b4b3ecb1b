"""Model families: one object per family, one file each, chosen once
from the configuration (``family_of``). A family supplies what differs
between GPT-2, Llama and Mixtral - the parameter declarations and their
names, the norm, the attention branch, the MLP - and the block, the
embeddings and the head take those pieces from it without asking which
family it is (docs/model.md, "Model families"). A new family is a new
file here plus its entry in ``family_of``.
"""

from __future__ import annotations

from ...core.config import ModelConfig
from .base import Family
from .deepseek_v3 import DeepseekV3
from .gpt2 import GPT2
from .llama import Llama
from .mixtral import Mixtral

__all__ = ["DeepseekV3", "Family", "GPT2", "Llama", "Mixtral", "family_of"]


def family_of(cfg: ModelConfig) -> Family:
    """The family of ``cfg``: its ``arch``, and for a Llama with experts
    (``--arch mixtral``, or --n-experts) Mixtral; deepseek_v3 its own."""
    if cfg.arch == "deepseek_v3":
        return DeepseekV3()
    if cfg.arch == "llama":
        return Mixtral() if cfg.moe else Llama()
    return GPT2()
