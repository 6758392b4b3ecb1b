"""DeepSeek-V3's ops and Hugging Face files against transformers'
DeepseekV3 in float64: the attention module on random weights (q rank on
and off, interleaved rope on and off), the router's chosen experts and
weights (group-limited, a non-zero bias), and a whole tiny
DeepseekV3ForCausalLM's loss from the serial reference
(tests/deepseek_reference.py), read from a directory transformers saved
and written by ``hf_deepseek.write`` for transformers to load; plus the
config reader's refusals (no torch needed).

transformers computes RMSNorm, the rotary tables, eager attention's
softmax and the router in float32 even in a float64 model; the tests
patch those to float64 (``float64_reference``) so that two float64
computations are compared, to 1e-12.
"""

import json

import numpy as np
import pytest

import deepseek_reference as ref
from mpicube.files.formats import hf_deepseek
from mpicube.files.formats.base import FormatError
from mpicube.files.formats.hf_deepseek_config import parse_config
from mpicube.ops import deepseek_router as router
from mpicube.ops import mtp

T, B, V = 7, 2, 61


def hf_config(transformers, **over):
    """A tiny DeepseekV3Config: MLA with a q rank, 8 routed experts in 4
    groups, top-2 within 2 groups, 1 shared expert, first layer dense."""
    kw = dict(vocab_size=V, hidden_size=16, intermediate_size=24, moe_intermediate_size=6, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, kv_lora_rank=6,
              q_lora_rank=5, qk_rope_head_dim=4, v_head_dim=3, qk_nope_head_dim=2, n_group=4, topk_group=2,
              num_experts_per_tok=2, first_k_dense_replace=1, max_position_embeddings=32, num_mtp_layers=0,
              routed_scaling_factor=2.5, rms_norm_eps=1e-5,
              rope_parameters={"rope_type": "default", "rope_theta": 50.0},
              rope_interleave=True, tie_word_embeddings=False, attn_implementation="eager",
              experts_implementation="eager")
    kw.update(over)
    return transformers.DeepseekV3Config(**kw)


@pytest.fixture
def hf(monkeypatch):
    """(torch, transformers, modeling) with DeepseekV3's float32 internals patched to float64."""
    torch = pytest.importorskip("torch", reason="torch is not installed (optional check)")
    transformers = pytest.importorskip("transformers", reason="transformers is not installed (optional check)")
    modeling = transformers.models.deepseek_v3.modeling_deepseek_v3
    F = torch.nn.functional

    def rms_forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    def rope_forward(self, x, position_ids):
        cfg = self.config
        dim = cfg.qk_rope_head_dim
        inv = 1.0 / cfg.rope_parameters["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
        angles = position_ids[..., None].double() * inv
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos().to(x.dtype), angles.sin().to(x.dtype)

    def eager(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        w = torch.matmul(query, key.transpose(2, 3)) * scaling
        if attention_mask is not None:
            w = w + attention_mask
        w = F.softmax(w, dim=-1)                                   # in float64
        return torch.matmul(w, value).transpose(1, 2).contiguous(), w

    def router_forward(self, hidden_states):
        hidden_states = hidden_states.view(-1, self.hidden_dim)
        logits = F.linear(hidden_states, self.weight)              # float64 throughout
        scores = logits.sigmoid()
        choice = scores + self.e_score_correction_bias
        groups = choice.view(-1, self.num_group, self.num_experts // self.num_group).topk(2, dim=-1)[0].sum(-1)
        idx = torch.topk(groups, k=self.topk_group, dim=-1, sorted=False)[1]
        mask = torch.zeros_like(groups).scatter_(1, idx, 1)
        mask = mask.unsqueeze(-1).expand(-1, self.num_group, self.num_experts // self.num_group).reshape(
            -1, self.num_experts)
        choice = choice.masked_fill(~mask.bool(), float("-inf"))
        top = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
        w = scores.gather(1, top)
        if self.norm_topk_prob:
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return logits, w * self.routed_scaling_factor, top

    monkeypatch.setattr(modeling.DeepseekV3RMSNorm, "forward", rms_forward)
    monkeypatch.setattr(modeling.DeepseekV3RotaryEmbedding, "forward", rope_forward)
    monkeypatch.setattr(modeling, "eager_attention_forward", eager)
    monkeypatch.setattr(modeling.DeepseekV3TopkRouter, "forward", router_forward)
    torch.manual_seed(0)
    return torch, transformers, modeling


def shape_of(config):
    return parse_config("<test>", json.loads(config.to_json_string()))


def randomise(torch, model):
    """Every parameter and buffer of the (float64) model random, norms near
    1, the expert bias non-zero; returns the model."""
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith("inv_freq"):
                continue
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("e_score_correction_bias"):
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(0.3 * torch.randn_like(p))
    return model


def causal_mask(torch, n):
    return torch.triu(torch.full((n, n), float("-inf"), dtype=torch.float64), 1)[None, None]


@pytest.mark.parametrize("q_rank,interleave", [(5, True), (None, True), (5, False)])
def test_mla_equals_transformers_attention(hf, q_rank, interleave):
    torch, transformers, modeling = hf
    config = hf_config(transformers, q_lora_rank=q_rank, rope_interleave=interleave)
    d = shape_of(config)
    attn = randomise(torch, modeling.DeepseekV3Attention(config, 0).double().eval())
    rotary = modeling.DeepseekV3RotaryEmbedding(config)
    x = torch.randn(B, T, d.n_embd, dtype=torch.float64)
    pos = torch.arange(T)[None]
    with torch.no_grad():
        want = attn(x, rotary(x, pos), causal_mask(torch, T))[0].numpy()
    state = {k: v.numpy() for k, v in attn.state_dict().items()}
    t = {}
    for suffix in hf_deepseek.param_shapes(d):
        if suffix.startswith("h.0.attn."):
            (fname, _), = hf_deepseek.sources(d, suffix)[0]
            t[suffix] = state[fname.split("self_attn.", 1)[1]].T
    cos, sin = ref.ops.rope_tables(np.arange(T), d.qk_rope_head_dim, d.rope_theta)
    got = ref.mla_forward(x.numpy(), t, "h.0.", d, cos, sin)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12 * np.abs(want).max())


def test_router_equals_transformers_gate(hf):
    torch, transformers, modeling = hf
    config = hf_config(transformers)
    d = shape_of(config)
    gate = randomise(torch, modeling.DeepseekV3TopkRouter(config).double())
    x = torch.randn(64, d.n_embd, dtype=torch.float64)
    with torch.no_grad():
        logits, weights, top = gate(x)
    top, weights = top.numpy(), weights.numpy()
    order = np.argsort(top, axis=1)                                   # compare as sets: by expert index
    _, chosen, mine, _ = router.route(x.numpy() @ gate.weight.detach().numpy().T, gate.e_score_correction_bias.numpy(),
                                      d.top_k, d.n_groups, d.topk_groups, d.norm_topk, d.routed_scaling_factor)
    mine_order = np.argsort(chosen, axis=1)
    rows = np.arange(64)[:, None]
    np.testing.assert_array_equal(chosen[rows, mine_order], top[rows, order])
    np.testing.assert_allclose(mine[rows, mine_order], weights[rows, order], rtol=1e-13, atol=0)
    # the bias matters here: without it some token chooses differently
    _, unbiased, _, _ = router.route(logits.numpy(), np.zeros(d.n_routed_experts), d.top_k, d.n_groups, d.topk_groups)
    assert (np.sort(unbiased, 1) != np.sort(chosen, 1)).any()


def test_mtp_module_equals_transformers_mtp_layer(hf):
    """One MTP depth (norms, [embedding | hidden] projection, a MoE block,
    the shared head's norm) from ops.mtp and the reference's block equals
    transformers' MtpLayer, its weights named through hf_deepseek's table."""
    torch, transformers, modeling = hf
    from transformers.modeling_layers import MtpLayer

    config = hf_config(transformers)
    d = shape_of(config)
    layer = randomise(torch, MtpLayer(config, modeling.DeepseekV3DecoderLayer, modeling.DeepseekV3RMSNorm,
                                      d.n_layer).double().eval())
    state = {k: v.numpy() for k, v in layer.state_dict().items()}
    prefix, F = f"model.layers.{d.n_layer}.", d.moe_ffn_hidden
    t = {}
    for name, shape in hf_deepseek.param_shapes(d, mtp_depth=1).items():
        if not name.startswith("mtp.0."):
            continue
        parts, transposed = hf_deepseek.sources(d, name)
        pieces = []
        for fname, _ in parts:
            key = fname[len(prefix):].replace("shared_head.norm.", "post_norm.")
            if ".experts." in key and ".shared_experts." not in key:             # in memory: fused per expert
                _, _, e, what, _ = key.split(".")                                  # mlp.experts.{e}.gate_proj.weight
                fused = "down_proj" if what == "down_proj" else "gate_up_proj"
                w = state[f"mtp_block.mlp.experts.{fused}"][int(e)]
                w = w[:F] if what == "gate_proj" else w[F:] if what == "up_proj" else w
            else:
                own = key.split(".")[0] in ("enorm", "hnorm", "eh_proj", "post_norm")
                w = state[key if own else "mtp_block." + key]
            pieces.append(w.T if transposed else w)
        t[name] = np.concatenate(pieces, axis=1) if len(pieces) > 1 else pieces[0]
        assert t[name].shape == shape
    emb = torch.randn(B, T, d.n_embd, dtype=torch.float64)
    prev = torch.randn(B, T, d.n_embd, dtype=torch.float64)
    pos = torch.arange(T)[None]
    with torch.no_grad():
        want = layer(emb, prev, modeling.DeepseekV3RotaryEmbedding(config)(emb, pos), causal_mask(torch, T), pos,
                     None).numpy()
    cos, sin = ref.ops.rope_tables(np.arange(T), d.qk_rope_head_dim, d.rope_theta)
    u, _ = mtp.input_forward(prev.numpy(), emb.numpy(), t["mtp.0.hnorm.weight"], t["mtp.0.enorm.weight"], d.n_embd,
                             d.rms_eps)
    z = ref.block_forward(mtp.project_forward(u, t["mtp.0.proj.weight"]), t, "mtp.0.", d, d.n_layer, cos, sin)
    got = ref.rms(z, t["mtp.0.ln_f.weight"], d.rms_eps)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12 * np.abs(want).max())


def hf_loss(torch, model, ids, targets):
    with torch.no_grad():
        logits = model(torch.tensor(ids)).logits                     # (B, T, V) float64
        return float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                       torch.tensor(targets).reshape(-1)))


@pytest.mark.parametrize("interleave", [True, False])
def test_transformers_directory_loss_equals_reference(hf, tmp_path, interleave):
    """transformers saves a random model; hf_deepseek reads it; the serial
    reference's loss equals transformers' float64 loss to 1e-12."""
    torch, transformers, modeling = hf
    config = hf_config(transformers, rope_interleave=interleave)
    model = randomise(torch, transformers.DeepseekV3ForCausalLM(config).double().eval())
    model.save_pretrained(str(tmp_path / "ds"))
    d, tensors = hf_deepseek.read_tensors(tmp_path / "ds")
    assert np.abs(tensors["h.1.moe.router.score_bias"]).max() > 0
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, V, size=(B, T + 1))
    ids, targets = tokens[:, :-1], tokens[:, 1:]
    want = hf_loss(torch, model, ids, targets)
    record = []
    got = ref.forward(tensors, d, ids, targets, record=record)[0]
    assert got == pytest.approx(want, rel=1e-12)
    assert len(record) == 2 and len(np.unique(record[0][0])) > 2    # two MoE layers, several experts chosen


def test_written_directory_loads_in_transformers(hf, tmp_path):
    """hf_deepseek.write (with one MTP module) -> transformers loads it and
    gives the reference's loss; reading it back gives the same tensors."""
    torch, transformers, modeling = hf
    d = shape_of(hf_config(transformers, tie_word_embeddings=False))
    rng = np.random.default_rng(1)
    tensors = {}
    for name, shape in hf_deepseek.param_shapes(d, mtp_depth=1).items():
        if "norm" in name or name.endswith("ln_1.weight") or name.endswith("ln_2.weight") or "ln_f" in name:
            tensors[name] = 1.0 + 0.2 * rng.normal(size=shape)
        else:           # router weights and bias in float32's grid: transformers keeps those two in float32
            tensors[name] = 0.3 * rng.normal(size=shape)
            if ".moe.router." in name:
                tensors[name] = (0.3 * tensors[name]).astype(np.float32).astype(np.float64)
    hf_deepseek.write(tmp_path / "out", tensors, d, mtp_depth=1)
    doc = json.loads((tmp_path / "out" / "config.json").read_text())
    assert doc["num_nextn_predict_layers"] == 1
    back_d, back = hf_deepseek.read_tensors(tmp_path / "out")
    assert back_d.mtp_depth == 1 and set(back) == set(tensors)
    for name in tensors:
        np.testing.assert_array_equal(back[name], tensors[name])
    model = transformers.DeepseekV3ForCausalLM.from_pretrained(str(tmp_path / "out"), attn_implementation="eager",
                                                                 experts_implementation="eager")
    model = model.double().eval()
    tokens = rng.integers(0, V, size=(B, T + 1))
    ids, targets = tokens[:, :-1], tokens[:, 1:]
    assert ref.forward(tensors, d, ids, targets)[0] == pytest.approx(hf_loss(torch, model, ids, targets), rel=1e-12)
    loss, main, depths = ref.forward(tensors, d, ids, targets, mtp_depth=1, mtp_weight=0.3)
    assert loss == pytest.approx(main + 0.3 * depths[0], rel=1e-14) and depths[0] > 0



def test_greedy_tokens_through_the_latent_cache_equal_transformers(hf):
    torch, transformers, modeling = hf
    config = hf_config(transformers)
    d = shape_of(config)
    model = randomise(torch, transformers.DeepseekV3ForCausalLM(config).double().eval())
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    prompt = np.random.default_rng(2).integers(0, V, size=(B, 4))
    with torch.no_grad():
        want = model.generate(torch.tensor(prompt), max_new_tokens=6, do_sample=False, min_new_tokens=6,
                              pad_token_id=0).numpy()
    tensors = {}
    with torch.no_grad():
        for name in hf_deepseek.param_shapes(d):
            parts, transposed = hf_deepseek.sources(d, name)
            pieces = []
            for fname, _ in parts:
                e = fname.split(".experts.")
                if len(e) == 2 and "shared" not in e[0]:                         # fused per expert in memory
                    n, what = int(e[1].split(".")[0]), e[1].split(".")[1]
                    w = state[e[0] + ".experts." + ("down_proj" if what == "down_proj" else "gate_up_proj")][n]
                    F = d.moe_ffn_hidden
                    w = w[:F] if what == "gate_proj" else w[F:] if what == "up_proj" else w
                else:
                    w = state[fname]
                pieces.append(w.T if transposed else w)
            tensors[name] = np.concatenate(pieces, axis=1) if len(pieces) > 1 else pieces[0]
    got = ref.greedy(tensors, d, prompt, 6)
    np.testing.assert_array_equal(got, want)
    assert len(np.unique(got[:, 4:])) > 1                                        # not one repeated token


# --- the config reader (no torch) ------------------------------------------------
BASE = {"model_type": "deepseek_v3", "vocab_size": 61, "hidden_size": 16, "intermediate_size": 24,
        "moe_intermediate_size": 6, "num_hidden_layers": 3, "num_attention_heads": 4, "kv_lora_rank": 6,
        "q_lora_rank": 5, "qk_rope_head_dim": 4, "v_head_dim": 3, "qk_nope_head_dim": 2, "n_routed_experts": 8,
        "n_shared_experts": 1, "n_group": 4, "topk_group": 2, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
        "max_position_embeddings": 32, "routed_scaling_factor": 2.5}


def test_config_round_trips_and_reads_deepseeks_spelling():
    d = parse_config("x", BASE)
    assert (d.q_lora_rank, d.n_groups, d.topk_groups, d.mtp_depth, d.rope_interleave) == (5, 4, 2, 0, True)
    assert parse_config("x", hf_deepseek.config_json(d)) == d
    released = dict(BASE, q_lora_rank=None, scoring_func="sigmoid", topk_method="noaux_tc", seq_aux=True,
                    aux_loss_alpha=0.001, num_nextn_predict_layers=1, rope_theta=10000, moe_layer_freq=1)
    d = parse_config("x", released)
    assert (d.q_lora_rank, d.seq_aux_loss_coef, d.mtp_depth) == (0, 0.001, 1)
    shapes = hf_deepseek.param_shapes(d)
    assert "h.0.attn.q_proj.weight" in shapes and "mtp.0.proj.weight" in shapes


@pytest.mark.parametrize("field,value,words", [
    ("rope_scaling", {"type": "yarn", "factor": 40}, "rope_scaling.rope_type"),
    ("rope_parameters", {"rope_type": "yarn", "rope_theta": 1e4}, "rope_parameters.rope_type"),
    ("scoring_func", "softmax", "scoring_func"),
    ("topk_method", "greedy", "topk_method"),
    ("n_group", 3, "n_group = 3 does not divide n_routed_experts 8"),
    ("n_group", 8, "n_group = 8 leaves 1 expert per group"),
    ("topk_group", 5, "topk_group = 5 exceeds n_group 4"),
    ("num_experts_per_tok", 5, "num_experts_per_tok = 5 exceeds the 4 experts"),
    ("num_key_value_heads", 2, "num_key_value_heads"),
    ("attention_bias", True, "attention_bias"),
    ("kv_lora_rank", 0, "kv_lora_rank"),
    ("q_lora_rank", 0, "q_lora_rank"),
    ("qk_rope_head_dim", 3, "qk_rope_head_dim = 3 is not even"),
    ("first_k_dense_replace", 4, "first_k_dense_replace"),
    ("norm_topk_prob", "yes", "norm_topk_prob"),
    ("num_nextn_predict_layers", -1, "num_nextn_predict_layers"),
])
def test_unsupported_config_is_refused_by_name(field, value, words):
    with pytest.raises(FormatError) as e:
        parse_config("dir", dict(BASE, **{field: value}))
    message = str(e.value)
    assert words in message and "\n" not in message and message.startswith("dir/config.json: ")
