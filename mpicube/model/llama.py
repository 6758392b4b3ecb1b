"""What the Llama family changes in the shared block (``block.py``), as
pieces the block plugs in: its parameter list, the attention core with
rotary embeddings and grouped-query attention, and the SwiGLU activation.
Norms are the layout's (``layouts/modules.make_norm``); the linears are the
layout's too, declared without biases.

Grouped-query attention: c_attn's output columns are [q | k | v] with
n_head, n_kv_head and n_kv_head heads of head_dim columns, declared with
those three group sizes (``ParamDecl.groups``), so every layout's split of
the columns gives each rank the same share of each: whole query heads and
the kv heads they read (query head i reads kv head i // (n_head /
n_kv_head)). A split finer than the kv heads (``heads`` on the decl)
gives each rank its whole query heads and a copy of the one kv head they
read, shared with the other ranks whose queries read it: the layout sums
those columns' gradients over exactly those ranks (``params.SharedColumns``).
"""

from __future__ import annotations

import math

import numpy as np

from .. import ops
from ..core.config import ModelConfig
from ..core.errors import ConfigError
from ..device.arrays import array_module
from ..parallel.layouts.base import check_head_split
from ..parallel.params import ParamDecl
from .moe import expert_names, moe_params

LAYER_PARAMS = ("ln_1.weight", "attn.c_attn.weight", "attn.c_proj.weight", "ln_2.weight", "mlp.c_fc.weight",
                "mlp.c_proj.weight")         # each block's, in llama_params' order
MLP_PARAMS = LAYER_PARAMS[-2:]               # a mixture of experts has moe.expert_names instead


def check_config(cfg: ModelConfig) -> None:
    """ConfigError naming the setting a Llama configuration gets wrong."""
    if cfg.n_embd % cfg.n_head:
        raise ConfigError(f"--n-embd {cfg.n_embd} must be divisible by --n-head {cfg.n_head}")
    if cfg.head_dim % 2:
        raise ConfigError(f"rotary embeddings need an even head size; n_embd / n_head = {cfg.head_dim}")
    if cfg.n_head % cfg.kv_heads:
        raise ConfigError(f"--n-kv-head {cfg.kv_heads} must divide --n-head {cfg.n_head}")


def param_names(cfg: ModelConfig):
    """The names of ``llama_params(cfg)``, in order, one at a time."""
    yield "wte"
    for i in range(cfg.n_layer):
        for suffix in LAYER_PARAMS[:-2]:
            yield f"h.{i}.{suffix}"
        for suffix in (expert_names(cfg, i) if cfg.moe else MLP_PARAMS):
            yield f"h.{i}.{suffix}"
    yield "ln_f.weight"
    if not cfg.tied:
        yield "lm_head"


def llama_params(cfg: ModelConfig) -> list:
    """Every logical parameter of a Llama model under mpicube's names (GPT-2's
    where the tensor plays the same part), with GPT-2's init rule: N(0, 0.02),
    residual projections scaled by 1/sqrt(2 n_layer), norm weights 1."""
    check_config(cfg)
    h, std, F, hd = cfg.n_embd, 0.02, cfg.ffn, cfg.head_dim
    resid_std = std / math.sqrt(2 * cfg.n_layer)
    qkv = (cfg.n_head * hd, cfg.kv_heads * hd, cfg.kv_heads * hd)    # [q | k | v] column groups
    decls = [ParamDecl("wte", (cfg.vocab_size, h), "wte", "normal", std)]
    for i in range(cfg.n_layer):
        p = f"h.{i}."
        decls += [
            ParamDecl(p + "ln_1.weight", (h,), "norm", "ones"),
            ParamDecl(p + "attn.c_attn.weight", (h, sum(qkv)), "w_first", "normal", std, decay=True, groups=qkv,
                      heads=(cfg.n_head, cfg.kv_heads, cfg.kv_heads)),
            ParamDecl(p + "attn.c_proj.weight", (h, h), "w_second", "normal", resid_std, decay=True),
            ParamDecl(p + "ln_2.weight", (h,), "norm", "ones"),
        ]
        if cfg.moe:                           # a router and n_experts SwiGLU MLPs (model/moe.py)
            decls += moe_params(cfg, i, std, resid_std)
            continue
        decls += [
            ParamDecl(p + "mlp.c_fc.weight", (h, 2 * F), "w_first", "normal", std, decay=True, groups=2),  # [gate|up]
            ParamDecl(p + "mlp.c_proj.weight", (F, h), "w_second", "normal", resid_std, decay=True),
        ]
    decls.append(ParamDecl("ln_f.weight", (h,), "norm", "ones"))
    if not cfg.tied:
        decls.append(ParamDecl("lm_head", (cfg.vocab_size, h), "wte", "normal", std))
    return decls


class SwiGLU:
    """The MLP activation between c_fc ([gate | up]) and c_proj: silu(gate) * up."""

    forward = staticmethod(ops.swiglu_forward)      # (B_m, T, 2 F_m) -> (B_m, T, F_m)
    backward = staticmethod(ops.swiglu_backward)


class RotaryAttention:
    """Causal attention with rotary embeddings on q and k and grouped-query
    heads, around any of the block's attention ops (T x T, blockwise, the
    context-parallel ring): q and k are rotated at their rows' global
    positions, each kv head is repeated for the query heads that read it,
    and the op runs on the ordinary [q | k | v] of n_local_heads heads. Its
    backward sums the repeats' gradients into their kv head and rotates
    back. ``n_local_heads`` query heads and their ``n_local_kv`` kv heads
    are this rank's (``layout.head_ids``)."""

    def __init__(self, cfg: ModelConfig, attention, head_ids):
        nh = len(head_ids)
        split = cfg.n_head // nh
        check_head_split(cfg, split)
        self.attention, self.n_local_heads = attention, nh
        self.n_local_kv = max(1, cfg.kv_heads // split)   # one shared kv head when the split exceeds them
        self.hd, self.theta = cfg.head_dim, cfg.rope_theta
        self.scaling = None if cfg.rope_scaling is None else cfg.rope_scaling.as_tuple()   # Llama 3's
        self._tables = {}                                 # positions -> (cos, sin) on the device

    def tables(self, positions, like):
        """(cos, sin) (T, hd) in like's format and array module, for ``positions`` (T,)."""
        key = (tuple(np.asarray(positions).tolist()), like.dtype)
        if key not in self._tables:
            xp = array_module(like)
            self._tables[key] = tuple(xp.asarray(t, dtype=like.dtype)
                                      for t in ops.rope_tables(positions, self.hd, self.theta, self.scaling))
        return self._tables[key]

    def rotate(self, qkv, positions):
        """qkv (B, T, (nh + 2 nkv) hd) -> the same columns with q and k rotated
        (kv heads not repeated: what the KV cache stores)."""
        xp = array_module(qkv)
        B, T, _ = qkv.shape
        nh, nkv, hd = self.n_local_heads, self.n_local_kv, self.hd
        q = qkv[..., :nh * hd].reshape(B, T, nh, hd)                        # (B, T, nh, hd)
        k = qkv[..., nh * hd:(nh + nkv) * hd].reshape(B, T, nkv, hd)        # (B, T, nkv, hd)
        cos, sin = self.tables(positions, qkv)                              # (T, hd) each
        q, k = ops.rope_forward(q, cos, sin), ops.rope_forward(k, cos, sin)
        return xp.concatenate([q.reshape(B, T, nh * hd), k.reshape(B, T, nkv * hd), qkv[..., (nh + nkv) * hd:]],
                              axis=-1)

    def pack(self, qkv, positions):
        """qkv (B, T, (nh + 2 nkv) hd) -> (B, T, 3 nh hd): q and k rotated, k and v repeated."""
        xp = array_module(qkv)
        B, T, _ = qkv.shape
        nh, nkv, hd = self.n_local_heads, self.n_local_kv, self.hd
        rotated = self.rotate(qkv, positions)
        q = rotated[..., :nh * hd]                                          # (B, T, nh hd)
        k = rotated[..., nh * hd:(nh + nkv) * hd].reshape(B, T, nkv, hd)    # (B, T, nkv, hd)
        v = rotated[..., (nh + nkv) * hd:].reshape(B, T, nkv, hd)           # (B, T, nkv, hd)
        rep = nh // nkv
        k, v = xp.repeat(k, rep, axis=2), xp.repeat(v, rep, axis=2)         # (B, T, nh, hd): head i reads i // rep
        return xp.concatenate([q, k.reshape(B, T, nh * hd), v.reshape(B, T, nh * hd)], axis=-1)

    def unpack_backward(self, dpacked, positions):
        """dpacked (B, T, 3 nh hd) -> dqkv (B, T, (nh + 2 nkv) hd)."""
        xp = array_module(dpacked)
        B, T, _ = dpacked.shape
        nh, nkv, hd = self.n_local_heads, self.n_local_kv, self.hd
        rep = nh // nkv
        dq, dk, dv = (dpacked[..., g * nh * hd:(g + 1) * nh * hd].reshape(B, T, nh, hd) for g in range(3))
        dk = dk.reshape(B, T, nkv, rep, hd).sum(3)                          # (B, T, nkv, hd)
        dv = dv.reshape(B, T, nkv, rep, hd).sum(3)
        cos, sin = self.tables(positions, dpacked)
        dq, dk = ops.rope_backward(dq, cos, sin), ops.rope_backward(dk, cos, sin)
        return xp.concatenate([dq.reshape(B, T, nh * hd), dk.reshape(B, T, nkv * hd), dv.reshape(B, T, nkv * hd)],
                              axis=-1)

    def attention_forward(self, qkv, positions, mask, keep_prob):
        """qkv (B_m, T, (nh + 2 nkv) hd) -> (y (B_m, T, nh hd), saved)."""
        y, s_core = self.attention.attention_forward(self.pack(qkv, positions), self.n_local_heads, mask, keep_prob)
        return y, (s_core, positions)

    def attention_backward(self, dy, saved):
        """dy (B_m, T, nh hd) -> dqkv (B_m, T, (nh + 2 nkv) hd)."""
        s_core, positions = saved
        return self.unpack_backward(self.attention.attention_backward(dy, s_core), positions)
