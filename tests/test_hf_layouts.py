"""Hugging Face layouts checked by position, without torch (issue 48).

mpicube's Hugging Face tables (the files' read/write table of
files/formats/hf.py, hf_llama.py, hf_mixtral.py, hf_deepseek.py; the name maps of
check/namemaps.py) are each used both ways, so a round trip through one is
the identity even when the table is wrong: a Mixtral table that swapped w1
and w3 (gate and up) reads back what it wrote. The tests that compare with
transformers catch such a swap, but only where torch is installed. These
need numpy and safetensors only:

- every tensor written holds distinguishable values (each element its own
  number), and each file tensor is checked against its mpicube tensor by
  position, from a table written here from transformers' documented
  layouts: ``nn.Linear`` weights are (out, in), GPT-2's ``Conv1D`` (in,
  out); Llama's ``q_proj``/``k_proj``/``v_proj`` are the n_head, n_kv_head,
  n_kv_head heads of ``c_attn``'s columns, ``gate_proj``/``up_proj`` the
  two halves of ``c_fc``; Mixtral's ``block_sparse_moe.gate`` is the router
  (E, h), expert e's ``w1`` its gate, ``w3`` its up and ``w2`` its down
  projection; transformers 5's in-memory ``mlp.experts.gate_up_proj`` is
  (E, 2F, h) with rows [gate | up], ``down_proj`` (E, h, F);
- which half of ``c_fc`` is the gate is fixed by a tiny forward: one
  expert of a written Mixtral computed as transformers' MixtralBlockSparseTop2MLP
  does, ``w2(silu(w1 x) * w3 x)``, from the file's tensors, equals
  mpicube's ``c_fc`` -> ``swiglu_forward`` -> ``c_proj`` on its own tensors.
"""

import json

import numpy as np
import pytest
from safetensors.numpy import load_file

from mpicube.check import namemaps, names
from mpicube.core.config import ModelConfig
from mpicube.files.formats import hf, hf_deepseek, hf_llama, hf_mixtral
from mpicube.files.formats.hf_deepseek_config import parse_config as deepseek_config
from mpicube.model.gpt import gpt_params
from mpicube.ops.llama import swiglu_forward

GPT2 = ModelConfig(vocab_size=11, n_ctx=5, n_layer=2, n_head=2, n_embd=8)
LLAMA = ModelConfig(vocab_size=11, n_ctx=5, n_layer=2, n_head=4, n_embd=8, arch="llama", n_kv_head=2, ffn_hidden=6)
MIXTRAL = ModelConfig(vocab_size=11, n_ctx=5, n_layer=2, n_head=4, n_embd=8, arch="llama", n_kv_head=2,
                      ffn_hidden=6, n_experts=4, top_k=2)


# a DeepSeek-V3 in transformers' config spelling: q compressed, 4 routed experts and a shared one, layer 0
# dense, one MTP module (stored as layer 2)
DEEPSEEK = deepseek_config("<test>", {
    "model_type": "deepseek_v3", "vocab_size": 11, "hidden_size": 8, "intermediate_size": 10,
    "moe_intermediate_size": 3, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
    "max_position_embeddings": 8, "q_lora_rank": 5, "kv_lora_rank": 4, "qk_rope_head_dim": 2, "qk_nope_head_dim": 2,
    "v_head_dim": 3, "n_routed_experts": 4, "n_shared_experts": 1, "first_k_dense_replace": 1,
    "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 2.5,
    "num_nextn_predict_layers": 1, "rope_theta": 50.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "hidden_act": "silu"})


def distinct(cfg) -> dict:
    """{mpicube name: tensor} in which no two elements, of any tensors, are equal."""
    shapes = {d.name: d.shape for d in gpt_params(cfg)} if isinstance(cfg, ModelConfig) else \
        hf_deepseek.param_shapes(cfg)
    out, start = {}, 0
    for name, shape in shapes.items():
        size = int(np.prod(shape))
        out[name] = (start + np.arange(size, dtype=np.float64)).reshape(shape) / 7.0
        start += size
    return out


def written(writer, cfg, tmp_path) -> dict:
    """The safetensors tensors ``writer`` puts in a directory, by file name
    (the hub's ``transformer.`` and ``model.`` prefixes kept as written)."""
    tensors = distinct(cfg)
    writer(tmp_path / "hf", tensors, cfg)
    out = {}
    for f in sorted((tmp_path / "hf").glob("*.safetensors")):
        out.update(load_file(f))
    return tensors, out, json.loads((tmp_path / "hf" / "config.json").read_text())


def llama_layout(cfg, t: dict, prefix: str = "model.") -> dict:
    """LlamaForCausalLM's tensors from mpicube's ``t``, as transformers
    documents them (every linear (out, in), q/k/v and gate/up split by
    their widths); without the MLP of a mixture."""
    hd, F = cfg.n_embd // cfg.n_head, cfg.ffn
    q, kv = cfg.n_head * hd, cfg.kv_heads * hd
    want = {prefix + "embed_tokens.weight": t["wte"], prefix + "norm.weight": t["ln_f.weight"]}
    if "lm_head" in t:
        want["lm_head.weight"] = t["lm_head"]                                       # (V, h) both sides
    for i in range(cfg.n_layer):
        p, c_attn = f"{prefix}layers.{i}.", t[f"h.{i}.attn.c_attn.weight"]          # (h, q + 2 kv)
        want.update({p + "input_layernorm.weight": t[f"h.{i}.ln_1.weight"],
                     p + "post_attention_layernorm.weight": t[f"h.{i}.ln_2.weight"],
                     p + "self_attn.q_proj.weight": c_attn[:, :q].T,                # (n_head hd, h)
                     p + "self_attn.k_proj.weight": c_attn[:, q:q + kv].T,          # (n_kv_head hd, h)
                     p + "self_attn.v_proj.weight": c_attn[:, q + kv:].T,
                     p + "self_attn.o_proj.weight": t[f"h.{i}.attn.c_proj.weight"].T})
        if not cfg.n_experts:
            c_fc = t[f"h.{i}.mlp.c_fc.weight"]                                       # (h, 2F)
            want.update({p + "mlp.gate_proj.weight": c_fc[:, :F].T, p + "mlp.up_proj.weight": c_fc[:, F:].T,
                         p + "mlp.down_proj.weight": t[f"h.{i}.mlp.c_proj.weight"].T})
    return want


def mixtral_hub_layout(cfg, t: dict, prefix: str = "model.") -> dict:
    """MixtralForCausalLM's files: Llama's attention, and per layer the
    router ``block_sparse_moe.gate`` (E, h) and expert e's w1 (gate, (F, h)),
    w3 (up) and w2 (down, (h, F))."""
    F, want = cfg.ffn, llama_layout(cfg, t, prefix)
    for i in range(cfg.n_layer):
        p = f"{prefix}layers.{i}.block_sparse_moe."
        want[p + "gate.weight"] = t[f"h.{i}.moe.router.weight"].T                     # (E, h)
        for e in range(cfg.n_experts):
            c_fc = t[f"h.{i}.moe.experts.{e}.c_fc.weight"]                           # (h, 2F)
            want.update({f"{p}experts.{e}.w1.weight": c_fc[:, :F].T, f"{p}experts.{e}.w3.weight": c_fc[:, F:].T,
                         f"{p}experts.{e}.w2.weight": t[f"h.{i}.moe.experts.{e}.c_proj.weight"].T})
    return want


def mixtral_fused_layout(cfg, t: dict) -> dict:
    """transformers 5's in-memory Mixtral: ``mlp.gate`` (E, h), and every
    expert of a layer in ``mlp.experts.gate_up_proj`` (E, 2F, h, rows
    [gate | up]) and ``mlp.experts.down_proj`` (E, h, F)."""
    want = llama_layout(cfg, t)
    for i in range(cfg.n_layer):
        p, E = f"model.layers.{i}.mlp.", range(cfg.n_experts)
        want[p + "gate.weight"] = t[f"h.{i}.moe.router.weight"].T
        want[p + "experts.gate_up_proj"] = np.stack([t[f"h.{i}.moe.experts.{e}.c_fc.weight"].T for e in E])
        want[p + "experts.down_proj"] = np.stack([t[f"h.{i}.moe.experts.{e}.c_proj.weight"].T for e in E])
    return want


def deepseek_layout(d, t: dict) -> dict:
    """DeepseekV3ForCausalLM's tensors as transformers (and DeepSeek's
    checkpoint, for the MTP module) lay them out: every nn.Linear (out,
    in); the dense MLP, each routed expert and the shared experts as
    gate_proj / up_proj / down_proj (c_fc's halves and c_proj); the router
    ``mlp.gate`` (E, C) with its ``e_score_correction_bias``; MTP module 0
    as layer L with enorm, hnorm, eh_proj (C, 2C) and its shared head's
    norm, plus copies of the embedding and the head."""
    want = {"model.embed_tokens.weight": t["wte"], "model.norm.weight": t["ln_f.weight"],
            "lm_head.weight": t["lm_head"]}

    def block(p, q, moe):                          # p: HF prefix, q: mpicube prefix
        a, m = p + "self_attn.", p + "mlp."
        want.update({p + "input_layernorm.weight": t[q + "ln_1.weight"],
                     p + "post_attention_layernorm.weight": t[q + "ln_2.weight"],
                     a + "q_a_proj.weight": t[q + "attn.q_down.weight"].T,
                     a + "q_a_layernorm.weight": t[q + "attn.q_norm.weight"],
                     a + "q_b_proj.weight": t[q + "attn.q_up.weight"].T,
                     a + "kv_a_proj_with_mqa.weight": t[q + "attn.kv_down.weight"].T,
                     a + "kv_a_layernorm.weight": t[q + "attn.kv_norm.weight"],
                     a + "kv_b_proj.weight": t[q + "attn.kv_up.weight"].T,
                     a + "o_proj.weight": t[q + "attn.c_proj.weight"].T})
        mlps = {m: q + "mlp."}
        if moe:
            mlps = {m + "shared_experts.": q + "moe.shared.",
                    **{f"{m}experts.{e}.": f"{q}moe.experts.{e}." for e in range(d.n_routed_experts)}}
        for theirs, ours in mlps.items():
            c_fc = t[ours + "c_fc.weight"]                                           # (C, 2F)
            F = c_fc.shape[1] // 2
            want.update({theirs + "gate_proj.weight": c_fc[:, :F].T, theirs + "up_proj.weight": c_fc[:, F:].T,
                         theirs + "down_proj.weight": t[ours + "c_proj.weight"].T})
        if moe:
            want.update({m + "gate.weight": t[q + "moe.router.weight"].T,
                         m + "gate.e_score_correction_bias": t[q + "moe.router.score_bias"]})

    for i in range(d.n_layer):
        block(f"model.layers.{i}.", f"h.{i}.", i >= d.first_k_dense)
    p = f"model.layers.{d.n_layer}."
    block(p, f"h.{d.n_layer}.", True)          # the MTP depth's block, named as the model names it
    want.update({p + "enorm.weight": t["mtp.0.enorm.weight"], p + "hnorm.weight": t["mtp.0.hnorm.weight"],
                 p + "eh_proj.weight": t["mtp.0.proj.weight"].T, p + "shared_head.norm.weight": t["mtp.0.ln_f.weight"],
                 p + "embed_tokens.weight": t["wte"], p + "shared_head.head.weight": t["lm_head"]})
    return want


def gpt2_layout(cfg, t: dict, prefix: str) -> dict:
    """GPT2LMHeadModel: Conv1D weights stored (in, out) as mpicube's, so
    every tensor keeps its name and orientation; wte/wpe gain ``.weight``."""
    want = {prefix + "wte.weight": t["wte"], prefix + "wpe.weight": t["wpe"]}
    want.update({prefix + n: a for n, a in t.items() if n not in ("wte", "wpe")})
    return want


def assert_positions(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want), sorted(set(got) ^ set(want))
    for name, a in want.items():
        assert got[name].shape == a.shape and np.array_equal(got[name], a), f"{name}: not where transformers has it"


@pytest.mark.parametrize("family", ["gpt2", "llama", "mixtral", "deepseek"])
def test_written_hf_files_hold_every_tensor_where_transformers_documents_it(family, tmp_path):
    """The shared read/write tables, write direction, by position; the
    round trips of tests/test_formats.py then pin the read direction."""
    if family == "gpt2":
        t, got, doc = written(hf.write, GPT2, tmp_path)
        prefix = "transformer." if any(n.startswith("transformer.") for n in got) else ""
        assert_positions(got, gpt2_layout(GPT2, t, prefix))
        assert doc["architectures"] == ["GPT2LMHeadModel"]
    elif family == "llama":
        t, got, doc = written(hf_llama.write, LLAMA, tmp_path)
        assert_positions(got, llama_layout(LLAMA, t))
        assert doc["architectures"] == ["LlamaForCausalLM"] and doc["num_key_value_heads"] == 2
    elif family == "mixtral":
        t, got, doc = written(hf_mixtral.write, MIXTRAL, tmp_path)
        assert_positions(got, mixtral_hub_layout(MIXTRAL, t))
        assert doc["architectures"] == ["MixtralForCausalLM"] and doc["num_local_experts"] == 4
    else:
        t, got, doc = written(hf_deepseek.write, DEEPSEEK, tmp_path)
        assert_positions(got, deepseek_layout(DEEPSEEK, t))
        assert doc["architectures"] == ["DeepseekV3ForCausalLM"] and doc["num_nextn_predict_layers"] == 1
        _, back = hf_deepseek.read_tensors(tmp_path / "hf")
        assert sorted(back) == sorted(t) and all(np.array_equal(back[n], t[n]) for n in t)


def test_a_mixtral_expert_computes_what_transformers_computes_from_the_file(tmp_path):
    """Which half of c_fc is the gate: expert 2 of layer 1 on random
    tokens, transformers' way from the written w1/w3/w2 (silu of w1's output
    times w3's, through w2) and mpicube's way (c_fc, swiglu_forward, c_proj)
    on random weights, equal to 1e-14; a Llama MLP (gate_proj, up_proj,
    down_proj) likewise."""
    rng = np.random.default_rng(48)
    x = rng.standard_normal((3, MIXTRAL.n_embd))                                      # (n, h)

    def silu(v):
        return v / (1 + np.exp(-v))

    for cfg, writer, key, theirs in (
            (MIXTRAL, hf_mixtral.write, "h.1.moe.experts.2.",
             ("model.layers.1.block_sparse_moe.experts.2.w1.weight",
              "model.layers.1.block_sparse_moe.experts.2.w3.weight",
              "model.layers.1.block_sparse_moe.experts.2.w2.weight")),
            (LLAMA, hf_llama.write, "h.1.mlp.",
             ("model.layers.1.mlp.gate_proj.weight", "model.layers.1.mlp.up_proj.weight",
              "model.layers.1.mlp.down_proj.weight"))):
        t = {d.name: rng.standard_normal(d.shape) for d in gpt_params(cfg)}
        out = tmp_path / key.replace(".", "_")
        writer(out, t, cfg)
        f = {}
        for path in out.glob("*.safetensors"):
            f.update(load_file(path))
        w1, w3, w2 = (f[n] for n in theirs)                                           # (F, h), (F, h), (h, F)
        want = (silu(x @ w1.T) * (x @ w3.T)) @ w2.T                                   # (n, h)
        hidden, _ = swiglu_forward(x @ t[key + "c_fc.weight"])                        # (n, F)
        got = hidden @ t[key + "c_proj.weight"]                                       # (n, h)
        assert np.abs(got - want).max() <= 1e-14 * np.abs(want).max(), key


@pytest.mark.parametrize("make", [namemaps.hf_gpt2, namemaps.hf_llama, namemaps.hf_mixtral_hub, namemaps.hf_mixtral],
                         ids=["hf_gpt2", "hf_llama", "hf_mixtral_hub", "hf_mixtral"])
def test_each_hf_name_map_puts_every_tensor_where_transformers_documents_it(make):
    """check/namemaps.py's Hugging Face maps, both directions, by position:
    from_trace gives the documented layout, to_trace of the documented
    layout gives the trace's tensors back."""
    cfg = {namemaps.hf_gpt2: GPT2, namemaps.hf_llama: LLAMA}.get(make, MIXTRAL)
    trace_cfg = cfg.to_dict()
    t = distinct(cfg)
    assert sorted(t) == sorted(names.param_shapes(trace_cfg))
    want = {namemaps.hf_gpt2: lambda: gpt2_layout(cfg, t, "transformer."),
            namemaps.hf_llama: lambda: llama_layout(cfg, t),
            namemaps.hf_mixtral_hub: lambda: mixtral_hub_layout(cfg, t),
            namemaps.hf_mixtral: lambda: mixtral_fused_layout(cfg, t)}[make]()
    m = make(trace_cfg)
    got = m.from_trace(t)
    assert_positions(got, want)
    back = m.to_trace(want)
    assert sorted(back) == sorted(t) and all(np.array_equal(back[n], t[n]) for n in t)
