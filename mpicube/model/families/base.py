"""What a model family supplies (``Family``), with the defaults GPT-2,
Llama and Mixtral share. Each method is called once per module the model
builds; none branches on a layout, and the model never branches on a
family."""

from __future__ import annotations

from ...core.config import ModelConfig
from ...parallel.layouts.base import Layout
from ...parallel.params import ParamStore


class Family:
    """A model family. ``name`` is its ``--arch``; ``hf_map`` the name of
    ``check.namemaps``' map for its transformers class (the trace checker's
    name map); ``position_table``: GPT-2's learned ``wpe`` after the
    lookup (others put positions in attention)."""

    name = "base"
    hf_map = ""
    position_table = False

    def check(self, cfg: ModelConfig) -> None:
        """ConfigError naming the setting ``cfg`` gets wrong for this family."""

    def params(self, cfg: ModelConfig) -> list:
        """Every logical parameter (``ParamDecl``), in declaration order."""
        raise NotImplementedError

    def param_names(self, cfg: ModelConfig):
        """The names of ``params(cfg)``, in order, one at a time (a file
        reader walks them without building a list as long as a header claims)."""
        raise NotImplementedError

    def norm(self, store: ParamStore, prefix: str, layout: Layout):
        """The norm over the hidden size ``prefix.*`` (ln_1, ln_2, ln_f),
        split across ``layout.hidden_comm`` where the layout splits it."""
        raise NotImplementedError

    def attention(self, layout: Layout, store: ParamStore, i: int, attention, dropout):
        """Block i's attention branch: ``forward(h, ctx)``, ``backward``,
        ``decode`` and ``n_local_kv`` (``attention.SelfAttention``)."""
        raise NotImplementedError

    def mlp(self, layout: Layout, store: ParamStore, i: int):
        """Block i's MLP: ``forward(h, ctx)`` and ``backward`` (``mlp.DenseMLP``, ``moe.MoE``)."""
        raise NotImplementedError
