"""The dense MLP of a block: the column-parallel c_fc, an activation, the
row-parallel c_proj (``DenseMLP``), and GPT-2's activation (``Gelu``;
Llama's ``SwiGLU`` is here too, as both are only an op pair). A mixture of
experts (``moe.MoE``) stands in the MLP's place with the same calls:
``forward(h, ctx)`` and ``backward(dy, saved)``.
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import ops
from ..parallel.layouts.base import COLUMN, ROW, Layout
from ..parallel.params import ParamStore
from .tape import Micro, Saved


class Gelu:
    """GPT-2's MLP activation between c_fc and c_proj."""

    forward = staticmethod(ops.gelu_forward)         # (B_m, T, 4 C_m) -> (B_m, T, 4 C_m)
    backward = staticmethod(ops.gelu_backward)


class SwiGLU:
    """Llama's activation between c_fc ([gate | up]) and c_proj: silu(gate) * up."""

    forward = staticmethod(ops.swiglu_forward)      # (B_m, T, 2 F_m) -> (B_m, T, F_m)
    backward = staticmethod(ops.swiglu_backward)


@dataclass
class MLPTape(Saved):
    """What ``DenseMLP`` keeps for backward."""

    c_fc: object            # c_fc's saved input (B_c, T, C_c), or its row shard
    act: object             # the activation's (its input, (B_m, T, 4 C_m) or 2 F_m)
    c_proj: object          # c_proj's saved input (B_m, T, 4 C_m) or F_m


class DenseMLP:
    """h (B_c, T, C_c) -> c_fc -> act -> c_proj -> (B_c, T, C_c)."""

    def __init__(self, layout: Layout, store: ParamStore, prefix: str, act, bias: bool):
        self.c_fc = layout.linear(store, prefix + ".c_fc", COLUMN, bias=bias)
        self.c_proj = layout.linear(store, prefix + ".c_proj", ROW, bias=bias)
        self.act = act

    def forward(self, h, ctx: Micro):
        """h (B_c, T, C_c) -> (y (B_c, T, C_c), MLPTape)."""
        f, s_fc = self.c_fc.forward(h)                                        # (B_m, T, 4 C_m) or 2 F_m
        g, s_act = self.act.forward(f)                                        # (B_m, T, 4 C_m) or F_m
        y, s_proj = self.c_proj.forward(g)                                    # (B_c, T, C_c)
        return y, MLPTape(s_fc, s_act, s_proj)

    def backward(self, dy, saved: MLPTape):
        """dy (B_c, T, C_c) -> dh (B_c, T, C_c)."""
        dg = self.c_proj.backward(dy, saved.c_proj)
        return self.c_fc.backward(self.act.backward(dg, saved.act), saved.c_fc)
