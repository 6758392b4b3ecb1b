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
patch those to float64 (tests/hf_float64.py) so that two float64
computations are compared, to 1e-12.
"""

import dataclasses
import json

import numpy as np
import pytest

import deepseek_reference as ref
import hf_float64
from mpicube.files.formats import hf_deepseek
from mpicube.files.formats.base import FormatError
from mpicube.files.formats.hf_deepseek_config import parse_config
from mpicube.ops import deepseek_router as router
from mpicube.ops import mtp

T, B, V = 7, 2, 61
# YaRN as DeepSeek-V3's released config.json has it, but over an original context of 64: with 4 rotary
# columns and theta 50 the slower frequency then sits inside the blended band (ramp 1/2), not at an end
YARN = {"rope_type": "yarn", "factor": 40, "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 1.0}
# the tables' factor too (mscale != mscale_all_dim) and the unrounded band (ramp 0.84)
YARN_SCALED = {**YARN, "mscale_all_dim": 0.8, "truncate": False}


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
    patched = hf_float64.patch(monkeypatch, torch, modeling)
    assert {"DeepseekV3TopkRouter", "eager_attention_forward"} <= set(patched), patched
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


def with_rope(rope):
    """hf_config's rope_parameters with ``rope``'s scaling (None: the default rope)."""
    return {"rope_parameters": {"rope_type": "default", "rope_theta": 50.0, **(rope or {})}}


@pytest.mark.parametrize("q_rank,interleave,rope", [(5, True, None), (None, True, None), (5, False, None),
                                                     (5, True, YARN), (None, False, YARN_SCALED)])
def test_mla_equals_transformers_attention(hf, q_rank, interleave, rope):
    torch, transformers, modeling = hf
    config = hf_config(transformers, q_lora_rank=q_rank, rope_interleave=interleave, **with_rope(rope))
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
    cos, sin = ref.rope_tables(d, np.arange(T))
    got = ref.mla_forward(x.numpy(), t, "h.0.", d, cos, sin)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12 * np.abs(want).max())


RELEASED = {"hidden_size": 7168, "num_attention_heads": 128, "num_key_value_heads": 128, "q_lora_rank": 1536,
            "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
            "max_position_embeddings": 163840,
            "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40,
                                "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
                                "mscale": 1.0, "mscale_all_dim": 1.0}}


@pytest.mark.parametrize("over", [RELEASED, with_rope(YARN), with_rope(YARN_SCALED),
                                  with_rope({**YARN_SCALED, "attention_factor": 0.9, "beta_slow": 2})],
                         ids=["released", "tiny", "tiny-scaled-tables", "tiny-attention-factor"])
def test_yarn_tables_and_softmax_scale_equal_transformers(hf, over):
    """YaRN's frequencies (ops.yarn) are transformers' own formula run in
    float64, and its float32 buffer to float32's rounding; the cos/sin
    tables and MLA's softmax scale equal transformers' DeepseekV3 (rotary
    embedding patched to float64, the attention's ``scaling``) to 1e-12,
    at DeepSeek-V3's released shape and the tests' tiny ones."""
    torch, transformers, modeling = hf
    config = hf_config(transformers, **over)
    d = shape_of(config)
    assert d.rope_scaling is not None and d.rope_scaling.factor == 40.0
    inv64, factor = hf_float64.rope_parameters(torch, config)
    inv32, _ = hf_float64.rope_parameters(torch, config, wide=False)
    ours = ref.ops.rope_inv_freq(d.qk_rope_head_dim, d.rope_theta, d.rope_scaling)          # (dr/2,)
    np.testing.assert_allclose(ours, inv64.numpy(), rtol=1e-15, atol=0)
    np.testing.assert_allclose(ours, inv32.numpy(), rtol=2e-7, atol=0)
    plain = ref.ops.rope_inv_freq(d.qk_rope_head_dim, d.rope_theta)
    assert (ours < plain).any() and (ours == plain).any()                   # interpolated and kept frequencies
    assert factor == pytest.approx(d.rope_scaling.table_factor, rel=1e-15)
    positions = np.array([0, 1, 2, 5, 31, 1000, 4095, 4096, 40000, 163839])
    x = torch.zeros(1, len(positions), 1, dtype=torch.float64)
    cos, sin = modeling.DeepseekV3RotaryEmbedding(config)(x, torch.tensor(positions)[None])
    our_cos, our_sin = ref.rope_tables(d, positions)                                      # (T, dr)
    # 1e-12, plus the float64 rounding of an angle pos * f (f <= 1) far out: ~2e-16 pos, with a margin
    slack = 1e-12 + 1e-15 * positions[:, None]                                             # (T, 1)
    assert (np.abs(our_cos - cos[0].numpy()) <= slack).all() and (np.abs(our_sin - sin[0].numpy()) <= slack).all()
    assert np.abs(our_cos[:5] - cos[0, :5].numpy()).max() <= 1e-14                        # positions 0 .. 31
    with torch.device("meta"):                                              # the released shape: no weights
        scaling = modeling.DeepseekV3Attention(config, 0).scaling
    assert ref.dims_of(d).scale == pytest.approx(scaling, rel=1e-15)
    assert ref.dims_of(d).scale != pytest.approx(1 / np.sqrt(d.qk_head_dim), rel=1e-3)   # mscale_all_dim's correction


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
        if not name.startswith(("mtp.0.", f"h.{d.n_layer}.")):
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
    cos, sin = ref.rope_tables(d, np.arange(T))
    u, _ = mtp.input_forward(prev.numpy(), emb.numpy(), t["mtp.0.hnorm.weight"], t["mtp.0.enorm.weight"], d.n_embd,
                             d.rms_eps)
    z = ref.block_forward(mtp.project_forward(u, t["mtp.0.proj.weight"]), t, f"h.{d.n_layer}.", d, d.n_layer, cos, sin)
    got = ref.rms(z, t["mtp.0.ln_f.weight"], d.rms_eps)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12 * np.abs(want).max())


def hf_loss(torch, model, ids, targets):
    with torch.no_grad():
        logits = model(torch.tensor(ids)).logits                     # (B, T, V) float64
        return float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                       torch.tensor(targets).reshape(-1)))


@pytest.mark.parametrize("interleave,rope", [(True, None), (False, None), (True, YARN), (False, YARN_SCALED)],
                         ids=["interleaved", "half-split", "yarn", "yarn-scaled-tables"])
def test_transformers_directory_loss_equals_reference(hf, tmp_path, interleave, rope):
    """transformers saves a random model (YaRN's rope where ``rope`` says);
    hf_deepseek reads it; the serial reference's loss equals transformers'
    float64 loss to 1e-12."""
    torch, transformers, modeling = hf
    config = hf_config(transformers, rope_interleave=interleave, **with_rope(rope))
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
    assert (d.rope_scaling is None) == (rope is None)
    if rope:                                                         # the scaling changed the loss
        plain = ref.forward(tensors, dataclasses.replace(d, rope_scaling=None), ids, targets)[0]
        assert abs(plain - got) > 1e-6 * got
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
    yarn = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
            "mscale": 1.0, "mscale_all_dim": 1.0}                      # the released config's, spelled as it is
    d = parse_config("x", dict(released, rope_scaling=yarn))
    assert d.rope_scaling.factor == 40.0 and d.softmax_factor == pytest.approx((0.1 * np.log(40) + 1) ** 2)
    assert parse_config("x", hf_deepseek.config_json(d)) == d
    assert parse_config("x", dict(released, rope_parameters={**YARN, "rope_theta": 1e4}, rope_scaling=YARN)) == \
        parse_config("x", dict(released, rope_parameters={**YARN, "rope_theta": 1e4}))


@pytest.mark.parametrize("field,value,words", [
    ("rope_scaling", {"type": "dynamic", "factor": 40}, "rope_scaling.rope_type"),
    ("rope_parameters", {"rope_type": "llama3", "rope_theta": 1e4}, "rope_parameters.rope_type"),
    ("rope_scaling", {"type": "yarn", "factor": 40}, "rope_scaling.original_max_position_embeddings = null"),
    ("rope_scaling", {**YARN, "factor": float("nan")}, "rope_scaling.factor = NaN is not a positive number"),
    ("rope_scaling", {**YARN, "factor": 0.5}, "rope_scaling.factor = 0.5 is below 1"),
    ("rope_scaling", {**YARN, "original_max_position_embeddings": 4096.5}, "original_max_position_embeddings = 4096.5"),
    ("rope_scaling", {**YARN, "beta_fast": -32}, "rope_scaling.beta_fast = -32 is not a positive number"),
    ("rope_scaling", {**YARN, "beta_slow": 40}, "rope_scaling.beta_fast = 32.0 is not above beta_slow 40.0"),
    ("rope_scaling", {**YARN, "mscale": float("inf")}, "rope_scaling.mscale = Infinity is not a positive number"),
    ("rope_scaling", {**YARN, "mscale_all_dim": 0}, "rope_scaling.mscale_all_dim = 0 is not a positive number"),
    ("rope_scaling", {**YARN, "attention_factor": "x"}, "rope_scaling.attention_factor"),
    ("rope_scaling", {**YARN, "truncate": "no"}, "rope_scaling.truncate"),
    ("rope_parameters", {**YARN, "low_freq_factor": 1}, "rope_parameters.low_freq_factor = 1 is not a YaRN field"),
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
    ("rope_scaling", {**YARN, "factor": 8}, "rope_scaling = "),          # beside rope_parameters, disagreeing
])
def test_unsupported_config_is_refused_by_name(field, value, words):
    doc = dict(BASE, **{field: value})
    if words == "rope_scaling = ":
        doc["rope_parameters"] = {**YARN, "rope_theta": 1e4}
    with pytest.raises(FormatError) as e:
        parse_config("dir", doc)
    message = str(e.value)
    assert words in message and "\n" not in message and message.startswith("dir/config.json: ")
