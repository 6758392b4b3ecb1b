"""DeepSeekMoE as options of the mixture of experts (model/routers.py,
model/moe.py, docs/moe.md "DeepSeekMoE"): the sigmoid router with its
bias, group-limited top-k and scaling, shared experts, dense first
blocks, the sequence-wise auxiliary loss, through the mixtral family:
whole-model gradients against finite differences, the model against the
serial NumPy reference built from the ops (tests/deepseek_reference.py),
the bias update, and the one-line refusals."""

import os
import sys

import numpy as np
import pytest

from mpicube.core.config import ModelConfig

sys.path.insert(0, os.path.dirname(__file__))
rng = np.random.default_rng(43)


def deepseek_moe(**kw) -> ModelConfig:
    base = dict(vocab_size=11, n_ctx=5, n_layer=2, n_head=2, n_embd=8, arch="llama", n_kv_head=1, ffn_hidden=6,
                n_experts=8, top_k=2, router="sigmoid", n_groups=4, topk_groups=2, routed_scaling_factor=2.5,
                n_shared_experts=1, moe_ffn_hidden=4, router_aux_loss_coef=0.0, router_z_loss_coef=0.0)
    return ModelConfig(**{**base, **kw})


def random_biases(store):
    """A non-zero bias in every mixture, so that it steers the choice."""
    for name, bias in store.persistent.items():
        bias[...] = rng.normal(0, 0.3, bias.shape)


@pytest.mark.parametrize("kw", [dict(),
                                dict(seq_aux_loss_coef=0.3, first_k_dense=1, n_shared_experts=2),
                                dict(norm_topk=False, n_groups=1, topk_groups=1, top_k=3, capacity_factor=0.8,
                                     n_shared_experts=0, seq_aux_loss_coef=0.1)],
                         ids=["groups-shared", "seq-aux-dense-first", "no-norm-capacity"])
def test_whole_deepseek_moe_gradient(kw):
    """Every parameter's gradient (router, routed and shared experts, the
    dense first block, attention) with a random bias, dropout and the
    sequence-wise auxiliary loss on, against central differences."""
    from test_ops import check_whole_model_gradient

    cfg = deepseek_moe(**kw)
    assert check_whole_model_gradient(cfg, prepare=random_biases) == cfg.n_params()


def test_params_names_and_counts():
    from mpicube.model.gpt import gpt_params, param_names

    cfg = deepseek_moe(first_k_dense=1, n_shared_experts=2)
    decls = gpt_params(cfg)
    names = [d.name for d in decls]
    assert names == list(param_names(cfg))
    assert sum(int(np.prod(d.shape)) for d in decls) == cfg.n_params()
    assert "h.0.mlp.c_fc.weight" in names and "h.0.moe.router.weight" not in names
    shapes = {d.name: d.shape for d in decls}
    assert shapes["h.1.moe.shared.c_fc.weight"] == (8, 2 * 2 * 4) and shapes["h.1.moe.shared.c_proj.weight"] == (8, 8)
    assert shapes["h.1.moe.experts.7.c_fc.weight"] == (8, 8)
    assert not any("score_bias" in n for n in names)                 # a buffer, not a parameter
    assert ModelConfig.from_dict(cfg.to_dict()).to_dict() == cfg.to_dict()
