"""Hugging Face Mixtral directories (``MixtralForCausalLM``), read: Llama's
reader (``hf_llama``) with the mixture of experts' tensors in the MLP's
place, in the hub's per-expert form (what transformers 5 also writes with
``save_pretrained``; its in-memory fused ``gate_up_proj`` is not a file
format):

    model.layers.{i}.block_sparse_moe.gate.weight          (E, h)  -> h.{i}.moe.router.weight^T
    model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight (F, h) \\
    model.layers.{i}.block_sparse_moe.experts.{e}.w3.weight (F, h)  -> h.{i}.moe.experts.{e}.c_fc.weight
                                                                       columns [w1^T | w3^T] (gate | up)
    model.layers.{i}.block_sparse_moe.experts.{e}.w2.weight (h, F)  -> h.{i}.moe.experts.{e}.c_proj.weight^T

``num_local_experts``, ``num_experts_per_tok`` and ``router_aux_loss_coef``
become the configuration's E, K and aux coefficient. A configuration of a
mixture this build does not compute (shared experts, another router's
scoring or grouping, router jitter, another family's MoE) is refused in
one line naming the field.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from ...core.config import ModelConfig, float_problem
from .base import FormatError, check_shapes, gpt2_shapes
from .hf import CONFIG, _shown, read_json, write_files
from .hf_llama import MODEL, LlamaHFModel, hf_tensors
from .hf_llama import config_json as llama_json
from .hf_llama import parse_config as llama_config
from .hf_llama import sources as llama_sources

# fields of other mixtures (Qwen-MoE, DeepSeek, ...) whose nonzero values mean shared experts
SHARED = ("shared_expert_intermediate_size", "n_shared_experts", "num_shared_experts",
          "moe_shared_expert_intermediate_size")


def is_mixtral_dir(path: Path) -> bool:
    """Whether the directory's config.json describes a mixture of experts
    (Mixtral, or another family's, which ``parse_config`` then refuses)."""
    try:
        doc = read_json(path / CONFIG, "a model configuration")
    except FormatError:
        return False
    return isinstance(doc, dict) and (doc.get("model_type") == "mixtral" or "num_local_experts" in doc
                                      or "num_experts" in doc or any(doc.get(k) for k in SHARED))


def parse_config(path: Path, doc) -> ModelConfig:
    """The ModelConfig of a Mixtral ``config.json``, or a FormatError naming the field."""
    where = path / CONFIG
    if not isinstance(doc, dict):
        raise FormatError(f"{where}: not a JSON object")
    for key in SHARED:
        if doc.get(key):
            raise FormatError(f"{where}: {key} = {_shown(doc[key])} is not supported: mpicube's mixture of "
                              f"experts has no shared experts")
    router = [("scoring_func", doc.get("scoring_func", "softmax") != "softmax", "mpicube's router is a softmax"),
              ("topk_method", doc.get("topk_method", "greedy") not in ("greedy", None),
               "mpicube's router takes the plain top-k"),
              ("n_group", doc.get("n_group") not in (None, 0, 1), "mpicube's router does not group experts"),
              ("router_jitter_noise", doc.get("router_jitter_noise", 0.0) not in (0, 0.0, None),
               "mpicube's router adds no noise"),
              ("model_type", doc.get("model_type") != "mixtral",
               "mpicube reads Mixtral's mixture of experts (model_type mixtral) only")]
    for key, refused, why in router:
        if refused:
            raise FormatError(f"{where}: {key} = {_shown(doc.get(key))} is not supported: {why}")
    cfg = llama_config(path, doc)
    E, K = doc.get("num_local_experts"), doc.get("num_experts_per_tok", 2)
    if isinstance(E, bool) or not isinstance(E, int) or E < 1:
        raise FormatError(f"{where}: num_local_experts = {_shown(E)} is not a positive integer")
    if isinstance(K, bool) or not isinstance(K, int) or not 1 <= K <= E:
        raise FormatError(f"{where}: num_experts_per_tok = {_shown(K)} must be from 1 to num_local_experts {E}")
    coef = doc.get("router_aux_loss_coef", 0.02)
    if why := float_problem("router_aux_loss_coef", coef):
        raise FormatError(f"{where}: router_aux_loss_coef = {_shown(coef)} is not supported: it {why}")
    return replace(cfg, n_experts=E, top_k=K, norm_topk=True, router_aux_loss_coef=float(coef))


def sources(cfg: ModelConfig, name: str) -> tuple:
    """Llama's ``sources``, with the router's and experts' tensors."""
    if ".moe." not in name:
        return llama_sources(cfg, name)
    layer, suffix = name[2:].split(".", 1)                    # "h.{i}.moe.<...>"
    p = f"{MODEL}layers.{layer}.block_sparse_moe."
    if suffix == "moe.router.weight":
        return [(p + "gate.weight", cfg.n_experts)], True
    _, _, e, linear, _ = suffix.split(".")                    # "moe.experts.{e}.c_fc.weight"
    pe = f"{p}experts.{e}."
    if linear == "c_fc":
        return [(pe + "w1.weight", cfg.ffn), (pe + "w3.weight", cfg.ffn)], True
    return [(pe + "w2.weight", cfg.n_embd)], True


def config_json(cfg: ModelConfig, dtype: str = "float32") -> dict:
    """Llama's config.json with Mixtral's name and mixture, which
    transformers loads as ``MixtralForCausalLM`` and ``parse_config`` reads
    back as ``cfg``. Mixtral's router always renormalises and never drops:
    a model with --no-norm-topk is refused (a FormatError), and a capacity
    factor, which no Mixtral config holds, is left behind (``write``'s
    caller notes it)."""
    if not cfg.norm_topk:
        raise FormatError("a model with --no-norm-topk has no MixtralForCausalLM form (Mixtral renormalises "
                          "the top-k weights)")
    doc = {k: v for k, v in llama_json(cfg, dtype).items() if k not in ("mlp_bias",)}
    doc.update(architectures=["MixtralForCausalLM"], model_type="mixtral", num_local_experts=cfg.n_experts,
               num_experts_per_tok=cfg.top_k, router_aux_loss_coef=cfg.router_aux_loss_coef,
               output_router_logits=False, router_jitter_noise=0.0, sliding_window=None)
    return doc


def write(dst, tensors: dict, cfg: ModelConfig, max_shard_bytes: int | None = None) -> list:
    """Write a Hugging Face ``MixtralForCausalLM`` directory ``dst`` (hub
    per-expert tensors) from {mpicube name: whole tensor}: the reader's
    table run backwards, as ``hf_llama.write``. Returns the files written."""
    dst = Path(dst)
    check_shapes(dst, {n: t.shape for n, t in tensors.items()}, gpt2_shapes(cfg))
    dtypes = sorted({str(t.dtype) for t in tensors.values()})
    return write_files(dst, hf_tensors(cfg, tensors, sources), config_json(cfg, dtypes[-1]), max_shard_bytes)


class MixtralHFModel(LlamaHFModel):
    """A ``MixtralForCausalLM`` directory as a ModelFile."""

    parse = staticmethod(parse_config)
    table = staticmethod(sources)

    def describe(self) -> str:
        return super().describe().replace("Hugging Face Llama", "Hugging Face Mixtral")
