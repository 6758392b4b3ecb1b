"""Hugging Face DeepseekV3 tensors <-> mpicube's names: the table both
directions run through (``sources``, the same contract as
``hf_llama.sources``: the HF tensors whose columns, in mpicube's
orientation, are concatenated into an mpicube tensor, and whether they
are stored (out, in)), the shapes it implies (``param_shapes``), a whole
directory read (``read_tensors``) and written (``write``).

mpicube's linears are x @ W, (in, out): every nn.Linear weight is read
transposed. Per layer i (``h.{i}.``), with p = ``model.layers.{i}.``:

    ln_1.weight / ln_2.weight        (C,)   input_ / post_attention_layernorm
    attn.q_down.weight      (C, rq)         self_attn.q_a_proj^T        \\ q_lora_rank > 0
    attn.q_norm.weight      (rq,)           self_attn.q_a_layernorm      |
    attn.q_up.weight        (rq, nh qk)     self_attn.q_b_proj^T        /
    attn.q_proj.weight      (C, nh qk)      self_attn.q_proj^T            q_lora_rank = 0
    attn.kv_down.weight     (C, rkv + dr)   self_attn.kv_a_proj_with_mqa^T
    attn.kv_norm.weight     (rkv,)          self_attn.kv_a_layernorm
    attn.kv_up.weight       (rkv, nh (dn + dv))  self_attn.kv_b_proj^T
    attn.c_proj.weight      (nh dv, C)      self_attn.o_proj^T
    mlp.c_fc.weight         (C, 2 F)        [mlp.gate_proj^T | mlp.up_proj^T]   dense layers (< first_k_dense)
    mlp.c_proj.weight       (F, C)          mlp.down_proj^T
    moe.router.weight       (C, E)          mlp.gate.weight^T                   MoE layers
    moe.router.score_bias   (E,)            mlp.gate.e_score_correction_bias    (not trained: the bias update's)
    moe.experts.{e}.c_fc.weight (C, 2 Fm)   [mlp.experts.{e}.gate_proj^T | up_proj^T]
    moe.experts.{e}.c_proj.weight (Fm, C)   mlp.experts.{e}.down_proj^T
    moe.shared.c_fc.weight  (C, 2 Fm ns)    [mlp.shared_experts.gate_proj^T | up_proj^T]   n_shared_experts > 0
    moe.shared.c_proj.weight (Fm ns, C)     mlp.shared_experts.down_proj^T

Head columns are kept as stored: q_up's and kv_up's columns are
head-contiguous ([q_nope | q_pe] and [k_nope | v] per head), and the
rotary columns stay interleaved when ``rope_interleave`` says so
(``ops.mla`` de-interleaves as transformers does).

MTP module k (0-based; DeepSeek's checkpoint stores it as layer
L + k = ``model.layers.{L+k}.``, which transformers' DeepseekV3 skips on
load): its block is mpicube's ``h.{L+k}.`` (the layer table above, as
the model names it: model/mtp.py), its own tensors ``mtp.{k}.``:

    enorm.weight / hnorm.weight (C,)        enorm / hnorm
    proj.weight             (2C, C)         eh_proj^T (rows [embedding | hidden])
    ln_f.weight             (C,)            shared_head.norm

plus ``embed_tokens.weight`` and ``shared_head.head.weight``, copies of
the shared embedding and head: read only to check they equal wte and
lm_head, written as copies.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from . import hf_llama
from .base import FormatError, check_shapes
from .hf import CONFIG, write_files
from .hf_deepseek_config import DeepseekV3Shape, config_json, read_config

MODEL = "model."


def _block_names(d: DeepseekV3Shape, layer: int) -> dict:
    """{suffix: shape} of one transformer block's tensors (``layer`` decides dense or MoE)."""
    C, nh = d.n_embd, d.n_head
    s = {"ln_1.weight": (C,)}
    if d.q_lora_rank:
        s.update({"attn.q_down.weight": (C, d.q_lora_rank), "attn.q_norm.weight": (d.q_lora_rank,),
                  "attn.q_up.weight": (d.q_lora_rank, nh * d.qk_head_dim)})
    else:
        s["attn.q_proj.weight"] = (C, nh * d.qk_head_dim)
    s.update({"attn.kv_down.weight": (C, d.kv_lora_rank + d.qk_rope_head_dim),
              "attn.kv_norm.weight": (d.kv_lora_rank,),
              "attn.kv_up.weight": (d.kv_lora_rank, nh * (d.qk_nope_head_dim + d.v_head_dim)),
              "attn.c_proj.weight": (nh * d.v_head_dim, C), "ln_2.weight": (C,)})
    if not d.is_moe(layer):
        s.update({"mlp.c_fc.weight": (C, 2 * d.ffn_hidden), "mlp.c_proj.weight": (d.ffn_hidden, C)})
        return s
    s.update({"moe.router.weight": (C, d.n_routed_experts), "moe.router.score_bias": (d.n_routed_experts,)})
    for e in range(d.n_routed_experts):
        s.update({f"moe.experts.{e}.c_fc.weight": (C, 2 * d.moe_ffn_hidden),
                  f"moe.experts.{e}.c_proj.weight": (d.moe_ffn_hidden, C)})
    if d.n_shared_experts:
        Fs = d.moe_ffn_hidden * d.n_shared_experts
        s.update({"moe.shared.c_fc.weight": (C, 2 * Fs), "moe.shared.c_proj.weight": (Fs, C)})
    return s


def param_shapes(d: DeepseekV3Shape, mtp_depth: int = None) -> dict:
    """{mpicube name: shape} of the whole model in mpicube's order, with the
    first ``mtp_depth`` MTP modules (default: the configuration's)."""
    C = d.n_embd
    mtp_depth = d.mtp_depth if mtp_depth is None else mtp_depth
    shapes = {"wte": (d.vocab_size, C)}
    for i in range(d.n_layer):
        shapes.update({f"h.{i}.{k}": v for k, v in _block_names(d, i).items()})
    shapes["ln_f.weight"] = (C,)
    if not d.tie_embeddings:
        shapes["lm_head"] = (d.vocab_size, C)
    for k in range(mtp_depth):              # the model's order: the depth's block, then its own tensors
        shapes.update({f"h.{d.n_layer + k}.{s}": v for s, v in _block_names(d, d.n_layer + k).items()})
        shapes.update({f"mtp.{k}.enorm.weight": (C,), f"mtp.{k}.hnorm.weight": (C,),
                       f"mtp.{k}.proj.weight": (2 * C, C), f"mtp.{k}.ln_f.weight": (C,)})
    return shapes


def _block_sources(d: DeepseekV3Shape, p: str, suffix: str) -> tuple:
    a, m = p + "self_attn.", p + "mlp."
    C, nh = d.n_embd, d.n_head
    table = {
        "ln_1.weight": ([(p + "input_layernorm.weight", None)], False),
        "ln_2.weight": ([(p + "post_attention_layernorm.weight", None)], False),
        "attn.q_down.weight": ([(a + "q_a_proj.weight", d.q_lora_rank)], True),
        "attn.q_norm.weight": ([(a + "q_a_layernorm.weight", None)], False),
        "attn.q_up.weight": ([(a + "q_b_proj.weight", nh * d.qk_head_dim)], True),
        "attn.q_proj.weight": ([(a + "q_proj.weight", nh * d.qk_head_dim)], True),
        "attn.kv_down.weight": ([(a + "kv_a_proj_with_mqa.weight", d.kv_lora_rank + d.qk_rope_head_dim)], True),
        "attn.kv_norm.weight": ([(a + "kv_a_layernorm.weight", None)], False),
        "attn.kv_up.weight": ([(a + "kv_b_proj.weight", nh * (d.qk_nope_head_dim + d.v_head_dim))], True),
        "attn.c_proj.weight": ([(a + "o_proj.weight", C)], True),
        "mlp.c_fc.weight": ([(m + "gate_proj.weight", d.ffn_hidden), (m + "up_proj.weight", d.ffn_hidden)], True),
        "mlp.c_proj.weight": ([(m + "down_proj.weight", C)], True),
        "moe.router.weight": ([(m + "gate.weight", d.n_routed_experts)], True),
        "moe.router.score_bias": ([(m + "gate.e_score_correction_bias", None)], False),
    }
    if suffix in table:
        return table[suffix]
    Fs = d.moe_ffn_hidden * d.n_shared_experts
    if suffix.startswith("moe.shared."):
        pe, F = m + "shared_experts.", Fs
    else:                                                       # "moe.experts.{e}.c_fc.weight"
        pe, F = f"{m}experts.{suffix.split('.')[2]}.", d.moe_ffn_hidden
    if suffix.endswith("c_fc.weight"):
        return [(pe + "gate_proj.weight", F), (pe + "up_proj.weight", F)], True
    return [(pe + "down_proj.weight", C)], True


def sources(d: DeepseekV3Shape, name: str) -> tuple:
    """(parts, transposed) for mpicube's ``name``: [(HF name, width in
    mpicube's columns, None for a vector)], and whether the HF tensors
    are stored (out, in). A KeyError for a name the model has not."""
    if name == "wte":
        return [(MODEL + "embed_tokens.weight", d.n_embd)], False
    if name == "lm_head":
        return [("lm_head.weight", d.n_embd)], False
    if name == "ln_f.weight":
        return [(MODEL + "norm.weight", None)], False
    head, index, suffix = name.split(".", 2)                    # "h.{i}.<suffix>" or "mtp.{k}.<suffix>"
    layer = int(index) + (d.n_layer if head == "mtp" else 0)
    p = f"{MODEL}layers.{layer}."
    if head == "mtp":
        extra = {"enorm.weight": ([(p + "enorm.weight", None)], False),
                 "hnorm.weight": ([(p + "hnorm.weight", None)], False),
                 "proj.weight": ([(p + "eh_proj.weight", d.n_embd)], True),        # width: mpicube's columns (C)
                 "ln_f.weight": ([(p + "shared_head.norm.weight", None)], False)}
        if suffix in extra:
            return extra[suffix]
    return _block_sources(d, p, suffix)


def mtp_copies(d: DeepseekV3Shape, mtp_depth: int) -> list:
    """[(HF name, mpicube name)] of the MTP modules' stored copies of the
    shared embedding and head."""
    head = "wte" if d.tie_embeddings else "lm_head"
    return [(f"{MODEL}layers.{d.n_layer + k}.{what}", ours) for k in range(mtp_depth)
            for what, ours in (("embed_tokens.weight", "wte"), ("shared_head.head.weight", head))]


def hf_tensors(d: DeepseekV3Shape, tensors: dict, mtp_depth: int = None) -> list:
    """[(HF name, array)] of mpicube's whole ``tensors`` ({name: array}),
    the table run backwards; MTP modules with their embedding/head copies."""
    mtp_depth = d.mtp_depth if mtp_depth is None else mtp_depth
    named = hf_llama.hf_tensors(d, tensors, sources, names=param_shapes(d, mtp_depth))
    return named + [(fname, tensors[ours]) for fname, ours in mtp_copies(d, mtp_depth)]


def stored_mtp_depth(d: DeepseekV3Shape, names) -> int:
    """How many of the configuration's MTP modules the file holds (their
    projections present), e.g. 0 for a directory transformers saved."""
    have = set(names)
    return sum(1 for k in range(d.mtp_depth) if f"{MODEL}layers.{d.n_layer + k}.eh_proj.weight" in have)


def read_tensors(path) -> tuple:
    """(DeepseekV3Shape, {mpicube name: whole array}) of a DeepseekV3
    directory (one model.safetensors or an index and its shards), the MTP
    modules where stored. A FormatError names a missing, misshapen or
    stray tensor, or an MTP copy that differs from the shared one."""
    from safetensors.numpy import load_file

    path = Path(path)
    d = read_config(path)
    index = path / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() \
        else ["model.safetensors"]
    raw = {}
    for f in files:
        raw.update(load_file(str(path / f)))
    depth = stored_mtp_depth(d, raw)
    shapes = param_shapes(d, depth)
    tensors, used = {}, set()
    for name, shape in shapes.items():
        parts, transposed = sources(d, name)
        pieces = []
        for fname, width in parts:
            if fname not in raw:
                raise FormatError(f"{path}: missing tensor {fname!r} (mpicube's {name})")
            used.add(fname)
            pieces.append(raw[fname].T if transposed else raw[fname])
        tensors[name] = pieces[0] if len(pieces) == 1 else np.concatenate(pieces, axis=1)
    check_shapes(path, {n: t.shape for n, t in tensors.items()}, shapes)
    for fname, ours in mtp_copies(d, depth):
        if fname in raw:
            used.add(fname)
            if not np.array_equal(raw[fname], tensors[ours]):
                raise FormatError(f"{path}: tensor {fname!r} differs from the shared {ours} it should copy")
    for fname in raw:
        if fname not in used:
            raise FormatError(f"{path}: unexpected tensor {fname!r}: mpicube's DeepSeek-V3 has no such parameter")
    return d, tensors


def write(dst, tensors: dict, d: DeepseekV3Shape, mtp_depth: int = None, max_shard_bytes: int = None) -> list:
    """Write a ``DeepseekV3ForCausalLM`` directory ``dst`` from {mpicube
    name: whole tensor}; returns the files written."""
    from dataclasses import replace

    dst = Path(dst)
    mtp_depth = d.mtp_depth if mtp_depth is None else mtp_depth
    check_shapes(dst, {n: t.shape for n, t in tensors.items()}, param_shapes(d, mtp_depth))
    dtypes = sorted({str(t.dtype) for t in tensors.values()})
    doc = config_json(replace(d, mtp_depth=mtp_depth), dtypes[-1])
    return write_files(dst, hf_tensors(d, tensors, mtp_depth), doc, max_shard_bytes)


__all__ = ["CONFIG", "DeepseekV3Shape", "hf_tensors", "mtp_copies", "param_shapes", "read_tensors", "sources",
           "stored_mtp_depth", "write"]
