"""A Hugging Face ``DeepseekV3ForCausalLM`` directory as a model file of
``--arch deepseek_v3`` (read by ``eval``, ``train --init-from`` and
``convert --from hf`` through ``formats.open_model``), and the directory
``convert --to hf`` writes: the config reader (``hf_deepseek_config``)
and the name table (``hf_deepseek.sources``) joined to the ModelConfig.

What the model builds so far is multi-head latent attention with a dense
SwiGLU MLP on every layer; a file with mixture-of-experts layers
(``first_k_dense_replace`` below ``num_hidden_layers``) is refused by
that field. MTP modules a file stores are refused as stray tensors
(transformers' own saves hold none).
"""

from __future__ import annotations

from pathlib import Path

from ...core.config import ModelConfig
from .base import FormatError, check_shapes, gpt2_shapes
from .hf import CONFIG, write_files
from .hf_deepseek import sources as deepseek_sources
from .hf_deepseek_config import DeepseekV3Shape, config_json, is_deepseek_dir, parse_config as parse_shape
from .hf_llama import LlamaHFModel, hf_tensors


def config_of(d: DeepseekV3Shape, where) -> ModelConfig:
    """The ModelConfig of a DeepseekV3Shape, or a FormatError naming the
    field this build does not compute yet (MoE layers)."""
    if d.first_k_dense < d.n_layer:
        raise FormatError(f"{where}: first_k_dense_replace = {d.first_k_dense} is below num_hidden_layers "
                          f"{d.n_layer}: mpicube's deepseek_v3 builds dense layers only so far (no DeepSeekMoE)")
    return ModelConfig(vocab_size=d.vocab_size, n_ctx=d.n_ctx, n_layer=d.n_layer, n_head=d.n_head, n_embd=d.n_embd,
                       arch="deepseek_v3", ffn_hidden=d.ffn_hidden, rope_theta=d.rope_theta, rms_eps=d.rms_eps,
                       tie_embeddings=d.tie_embeddings, rope_scaling=d.rope_scaling, q_lora_rank=d.q_lora_rank,
                       kv_lora_rank=d.kv_lora_rank, qk_rope_head_dim=d.qk_rope_head_dim,
                       qk_nope_head_dim=d.qk_nope_head_dim, v_head_dim=d.v_head_dim,
                       rope_interleave=d.rope_interleave)


def shape_of(cfg: ModelConfig) -> DeepseekV3Shape:
    """The DeepseekV3Shape of a dense deepseek_v3 ModelConfig: every layer
    dense (``first_k_dense`` = n_layer), so the routing fields are inert
    placeholders that the config reader accepts (two experts in one group)."""
    return DeepseekV3Shape(
        vocab_size=cfg.vocab_size, n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd, ffn_hidden=cfg.ffn,
        n_ctx=cfg.n_ctx, q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank,
        qk_rope_head_dim=cfg.qk_rope_head_dim, qk_nope_head_dim=cfg.qk_nope_head_dim, v_head_dim=cfg.v_head_dim,
        n_routed_experts=2, moe_ffn_hidden=1, n_shared_experts=0, first_k_dense=cfg.n_layer, top_k=1, n_groups=1,
        topk_groups=1, norm_topk=True, routed_scaling_factor=1.0, seq_aux_loss_coef=0.0, mtp_depth=0,
        rope_theta=cfg.rope_theta, rope_interleave=cfg.rope_interleave, rms_eps=cfg.rms_eps,
        tie_embeddings=cfg.tied, rope_scaling=cfg.rope_scaling)


def parse_config(path: Path, doc) -> ModelConfig:
    """The ModelConfig of a DeepseekV3 ``config.json``, or a FormatError naming the field."""
    return config_of(parse_shape(path, doc), Path(path) / CONFIG)


def sources(cfg: ModelConfig, name: str) -> tuple:
    """``hf_deepseek.sources`` of a ModelConfig (the table both directions run through)."""
    return deepseek_sources(shape_of(cfg), name)


def write(dst, tensors: dict, cfg: ModelConfig, max_shard_bytes: int | None = None) -> list:
    """Write a ``DeepseekV3ForCausalLM`` directory ``dst`` from {mpicube name:
    whole tensor} (every layer dense); returns the files written."""
    dst = Path(dst)
    check_shapes(dst, {n: t.shape for n, t in tensors.items()}, gpt2_shapes(cfg))
    dtypes = sorted({str(t.dtype) for t in tensors.values()})
    return write_files(dst, hf_tensors(cfg, tensors, sources), config_json(shape_of(cfg), dtypes[-1]),
                       max_shard_bytes)


class DeepseekHFModel(LlamaHFModel):
    """A ``DeepseekV3ForCausalLM`` directory (every layer dense) as a ModelFile."""

    parse = staticmethod(parse_config)
    table = staticmethod(sources)

    def describe(self) -> str:
        return super().describe().replace("Hugging Face Llama", "Hugging Face DeepseekV3")


__all__ = ["DeepseekHFModel", "config_of", "is_deepseek_dir", "parse_config", "shape_of", "sources", "write"]

