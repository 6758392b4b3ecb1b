"""A Hugging Face ``DeepseekV3ForCausalLM`` directory as a model file of
``--arch deepseek_v3`` (read by ``eval``, ``train --init-from`` and
``convert --from hf`` through ``formats.open_model``), and the directory
``convert --to hf`` writes: the config reader (``hf_deepseek_config``)
and the name table (``hf_deepseek.sources``) joined to the ModelConfig.

Layers from ``first_k_dense_replace`` on are DeepSeekMoE (``moe.MoE``
with the sigmoid router); each router's ``e_score_correction_bias`` is
the model's bias buffer ``h.{i}.moe.router.score_bias`` (``buffer``,
which ``load_params`` reads), written back by ``write``. The MTP modules
(``num_nextn_predict_layers``) are read where the file stores them
(their ``eh_proj`` present; transformers' own saves hold none, and the
model then has none: ``stored_config``), their copies of the embedding
and head accepted by shape and not read (the model shares wte and
lm_head), and written with those copies.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np

from ...core.config import ModelConfig
from ...core.deepseek_moe import bias_names
from .base import FormatError, check_shapes, gpt2_shapes
from .hf import CONFIG, write_files
from .hf_deepseek import mtp_copies, sources as deepseek_sources, stored_mtp_depth
from .hf_deepseek_config import DeepseekV3Shape, config_json, is_deepseek_dir, parse_config as parse_shape
from .hf_llama import LlamaHFModel, hf_tensors


def config_of(d: DeepseekV3Shape, where) -> ModelConfig:
    """The ModelConfig of a DeepseekV3Shape: MLA on every layer, DeepSeekMoE
    (the sigmoid router, its groups, shared experts) from layer
    ``first_k_dense`` on, none where every layer is dense."""
    moe = {} if d.first_k_dense >= d.n_layer else dict(
        n_experts=d.n_routed_experts, top_k=d.top_k, norm_topk=d.norm_topk, router="sigmoid", n_groups=d.n_groups,
        topk_groups=d.topk_groups, routed_scaling_factor=d.routed_scaling_factor,
        n_shared_experts=d.n_shared_experts, moe_ffn_hidden=d.moe_ffn_hidden, first_k_dense=d.first_k_dense,
        seq_aux_loss_coef=d.seq_aux_loss_coef, router_aux_loss_coef=0.0, router_z_loss_coef=0.0)
    return ModelConfig(vocab_size=d.vocab_size, n_ctx=d.n_ctx, n_layer=d.n_layer, n_head=d.n_head, n_embd=d.n_embd,
                       arch="deepseek_v3", ffn_hidden=d.ffn_hidden, rope_theta=d.rope_theta, rms_eps=d.rms_eps,
                       tie_embeddings=d.tie_embeddings, rope_scaling=d.rope_scaling, q_lora_rank=d.q_lora_rank,
                       kv_lora_rank=d.kv_lora_rank, qk_rope_head_dim=d.qk_rope_head_dim,
                       qk_nope_head_dim=d.qk_nope_head_dim, v_head_dim=d.v_head_dim,
                       rope_interleave=d.rope_interleave, mtp_depth=d.mtp_depth, **moe)


def shape_of(cfg: ModelConfig) -> DeepseekV3Shape:
    """The DeepseekV3Shape of a deepseek_v3 ModelConfig. Without experts
    every layer is dense (``first_k_dense`` = n_layer) and the routing
    fields are inert placeholders that the config reader accepts (two
    experts in one group). A FormatError for a mixture transformers'
    DeepseekV3 does not compute (the softmax router)."""
    if cfg.moe and cfg.router != "sigmoid":
        raise FormatError(f"a deepseek_v3 model with --router {cfg.router} has no Hugging Face DeepseekV3 form "
                          "(its router is the sigmoid one)")
    moe = dict(n_routed_experts=cfg.n_experts, moe_ffn_hidden=cfg.moe_ffn, n_shared_experts=cfg.n_shared_experts,
               first_k_dense=min(cfg.first_k_dense, cfg.n_layer), top_k=cfg.top_k, n_groups=cfg.n_groups,
               topk_groups=cfg.topk_groups, norm_topk=cfg.norm_topk, routed_scaling_factor=cfg.routed_scaling_factor,
               seq_aux_loss_coef=cfg.seq_aux_loss_coef) if cfg.moe else \
        dict(n_routed_experts=2, moe_ffn_hidden=1, n_shared_experts=0, first_k_dense=cfg.n_layer, top_k=1, n_groups=1,
             topk_groups=1, norm_topk=True, routed_scaling_factor=1.0, seq_aux_loss_coef=0.0)
    return DeepseekV3Shape(
        vocab_size=cfg.vocab_size, n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd, ffn_hidden=cfg.ffn,
        n_ctx=cfg.n_ctx, q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank,
        qk_rope_head_dim=cfg.qk_rope_head_dim, qk_nope_head_dim=cfg.qk_nope_head_dim, v_head_dim=cfg.v_head_dim,
        mtp_depth=cfg.mtp_depth, rope_theta=cfg.rope_theta, rope_interleave=cfg.rope_interleave, rms_eps=cfg.rms_eps,
        tie_embeddings=cfg.tied, rope_scaling=cfg.rope_scaling, **moe)


def parse_config(path: Path, doc) -> ModelConfig:
    """The ModelConfig of a DeepseekV3 ``config.json``, or a FormatError naming the field."""
    return config_of(parse_shape(path, doc), Path(path) / CONFIG)


def sources(cfg: ModelConfig, name: str) -> tuple:
    """``hf_deepseek.sources`` of a ModelConfig (the table both directions run through)."""
    return deepseek_sources(shape_of(cfg), name)


def write(dst, tensors: dict, cfg: ModelConfig, max_shard_bytes: int | None = None, buffers: dict = None) -> list:
    """Write a ``DeepseekV3ForCausalLM`` directory ``dst`` from {mpicube name:
    whole tensor} and the routers' biases ``buffers`` ({buffer name: (E,)};
    zeros for one not given, as a fresh model's); returns the files written."""
    dst = Path(dst)
    check_shapes(dst, {n: t.shape for n, t in tensors.items()}, gpt2_shapes(cfg))
    d = shape_of(cfg)
    dtypes = sorted({str(t.dtype) for t in tensors.values()})
    biases = [(sources(cfg, name)[0][0][0], np.asarray((buffers or {}).get(name, np.zeros(cfg.n_experts)),
                                                       dtype=dtypes[-1])) for name in bias_names(cfg)]
    copies = [(fname, tensors[ours]) for fname, ours in mtp_copies(d, cfg.mtp_depth)]   # the MTP layers' own copies
    return write_files(dst, hf_tensors(cfg, tensors, sources) + biases + copies, config_json(d, dtypes[-1]),
                       max_shard_bytes)


class DeepseekHFModel(LlamaHFModel):
    """A ``DeepseekV3ForCausalLM`` directory as a ModelFile, the routers'
    ``e_score_correction_bias`` its buffers."""

    parse = staticmethod(parse_config)
    table = staticmethod(sources)

    def stored_config(self, cfg: ModelConfig) -> ModelConfig:
        """The MTP depths the file stores (a transformers save: none, whatever its config says)."""
        return replace(cfg, mtp_depth=stored_mtp_depth(shape_of(cfg), self._map)) if cfg.mtp_depth else cfg

    def copies(self, cfg: ModelConfig) -> dict:
        head = (cfg.vocab_size, cfg.n_embd)
        return {fname: head for fname, _ in mtp_copies(shape_of(cfg), cfg.mtp_depth)}

    def buffer_sources(self) -> dict:
        cfg = self.config
        return {name: (sources(cfg, name)[0][0][0], (cfg.n_experts,)) for name in bias_names(cfg)}

    def describe(self) -> str:
        return super().describe().replace("Hugging Face Llama", "Hugging Face DeepseekV3")


__all__ = ["DeepseekHFModel", "config_of", "is_deepseek_dir", "parse_config", "shape_of", "sources", "write"]
