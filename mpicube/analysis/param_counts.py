"""Parameter counts ``info`` prints: the main model's, per block kind, the
parameters one token activates, and multi-token prediction's modules.

Why apart from ``ModelConfig.n_params``: a DeepSeek-V3 model has two
kinds of block (the first ``first_k_dense`` dense, the rest DeepSeekMoE),
so "L layers x one size" is wrong for it; a mixture activates only its
top-k routed experts per token (DeepSeek-V3's "37B activated of 671B");
and MTP's depths (``ModelConfig.mtp_depth``) are counted apart, as the
DeepSeek-V3 report counts them (671B main model + 14B MTP modules, the
latter with the checkpoint's own copies of the embedding and the head,
which mpicube shares with the main model instead of storing twice).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.config import ModelConfig
from ..model.gpt import gpt_params


@dataclass(frozen=True)
class ParamCounts:
    total: int          # the main model (embeddings, every block, the final norm, an untied head)
    embed: int          # wte, wpe and lm_head
    final: int          # the final norm
    dense_block: int    # one block with a dense MLP (0 if none)
    moe_block: int      # one block with a mixture (0 if none)
    n_dense: int        # blocks of each kind
    n_moe: int
    active: int         # what one token goes through: every routed expert but its top k left out
    mtp: int            # every MTP depth's own tensors and block (embedding and head shared)
    mtp_stored: int     # the same with a copy of the embedding and head per depth, as HF checkpoints store them


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def param_counts(cfg: ModelConfig) -> ParamCounts:
    """The counts of ``cfg`` from its parameter declarations (the main
    model's: blocks below n_layer) and, for MTP, one block of the kind
    block n_layer would be plus each depth's two input norms, its
    projection (2C, C) and its output norm."""
    blocks, embed, final = {}, 0, 0
    for decl in gpt_params(cfg):
        n = _numel(decl.shape)
        if decl.name.startswith("h."):
            i = int(decl.name.split(".")[1])
            if i < cfg.n_layer:
                blocks[i] = blocks.get(i, 0) + n
        elif decl.name in ("wte", "wpe", "lm_head"):
            embed += n
        elif decl.name.startswith("ln_f"):
            final += n
    dense = [blocks[i] for i in blocks if not cfg.is_moe(i)]
    moe = [blocks[i] for i in blocks if cfg.is_moe(i)]
    total = embed + final + sum(blocks.values())
    idle = (cfg.n_experts - cfg.top_k) * 3 * cfg.n_embd * cfg.moe_ffn     # routed experts a token skips
    active = total - len(moe) * idle
    h = cfg.n_embd
    one = moe[-1] if cfg.is_moe(cfg.n_layer) and moe else (dense[-1] if dense else 0)
    mtp = cfg.mtp_depth * (one + 3 * h + 2 * h * h)
    copies = cfg.mtp_depth * cfg.vocab_size * h * (1 if cfg.tied else 2)
    return ParamCounts(total, embed, final, dense[0] if dense else 0, moe[0] if moe else 0, len(dense), len(moe),
                       active, mtp, mtp + copies)


def params_line(cfg: ModelConfig, c: ParamCounts) -> str:
    """``info``'s parameters line: per block kind, and a mixture's active share."""
    blocks = []
    if c.n_dense:
        blocks.append(f"{c.n_dense} {'dense ' if c.n_moe else ''}layer{'s' if c.n_dense != 1 else ''} x {c.dense_block:,}")
    if c.n_moe:
        blocks.append(f"{c.n_moe} MoE layer{'s' if c.n_moe != 1 else ''} x {c.moe_block:,}")
    line = (f"parameters: {c.total:,} ({'embeddings and head' if cfg.llama and not cfg.tied else 'embeddings'} "
            f"{c.embed:,}, {', '.join(blocks)}, {'norm' if cfg.llama else 'ln_f'} {c.final:,})")
    if cfg.moe:
        line += f"; active per token {c.active:,} (top {cfg.top_k} of {cfg.n_experts} routed experts)"
    if cfg.mtp_depth:
        line += (f"\nmulti-token prediction: {cfg.mtp_depth} depth{'s' if cfg.mtp_depth > 1 else ''}, "
                 f"{c.mtp:,} parameters (a block, two input norms, the 2C x C projection and an output norm "
                 f"each; embedding and head shared), {c.mtp_stored:,} with the copies of the embedding and head "
                 f"a Hugging Face checkpoint stores")
    return line
