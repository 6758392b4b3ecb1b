"""Name maps and the PyTorch recorder of mpicube.check.

The maps are numpy both ways, so they are tested without torch: a round
trip through each shipped map is the identity, and each conversion puts
elements where the format says (a transpose, q/k/v side by side, Megatron's
rows per head). The recorder's tests need torch and skip without it
(tests/test_trace.py compares the recorder's trace of tools/torch_trace.py
with mpicube's own, where torch is installed).
"""

import importlib.util
from pathlib import Path

import h5py
import numpy as np
import pytest
from test_check import CFG, write_good

from mpicube.check import namemaps, names
from mpicube.core.errors import UserError

REPO = Path(__file__).resolve().parents[1]
H, NH = CFG["n_embd"], CFG["n_head"]
HD = H // NH


# a Llama with grouped-query attention (4 heads reading 2 kv heads) and an FFN width not a multiple of h
LLAMA_CFG = {**CFG, "n_head": 4, "arch": "llama", "n_kv_head": 2, "ffn_hidden": 12, "rope_theta": 10000.0,
             "rms_eps": 1e-6, "tie_embeddings": False}


# a Mixtral: 4 experts, top 2 (the keys a mixture's trace config holds, names.MOE_KEYS)
MIXTRAL_CFG = {**LLAMA_CFG, "n_experts": 4, "top_k": 2, "norm_topk": True, "capacity_factor": 0.0,
               "router_aux_loss_coef": 0.02, "router_z_loss_coef": 0.0}


# a DeepSeek-V3 (what names.config_of reads from an HF DeepseekV3 directory of these sizes): MLA with a q rank,
# the first block dense, then 8 routed experts in 4 groups (sigmoid router) and one shared expert
DEEPSEEK_CFG = {"vocab_size": 61, "n_ctx": 8, "n_layer": 2, "n_head": 4, "n_embd": 16, "arch": "deepseek_v3",
                "n_kv_head": 4, "ffn_hidden": 24, "rope_theta": 50.0, "rms_eps": 1e-05, "tie_embeddings": False,
                "q_lora_rank": 5, "kv_lora_rank": 6, "qk_rope_head_dim": 4, "qk_nope_head_dim": 2, "v_head_dim": 3,
                "rope_interleave": True, "n_experts": 8, "top_k": 2, "norm_topk": True, "capacity_factor": 0.0,
                "router_aux_loss_coef": 0.0, "router_z_loss_coef": 0.0, "router": "sigmoid", "n_groups": 4,
                "topk_groups": 2, "routed_scaling_factor": 2.5, "n_shared_experts": 1, "moe_ffn_hidden": 6,
                "first_k_dense": 1, "bias_update_rate": 0.0, "bias_update": "plain", "seq_aux_loss_coef": 0.0}
# without a q rank (q_proj), every block dense
DEEPSEEK_DENSE_CFG = {k: v for k, v in DEEPSEEK_CFG.items() if k in list(DEEPSEEK_CFG)[:17]} | {"q_lora_rank": 0}
# with one multi-token prediction depth: its block h.2 (a mixture, as HF's layer 2) and mtp.0.*
DEEPSEEK_MTP_CFG = {**DEEPSEEK_CFG, "mtp_depth": 1}


def cfg_of(make):
    if make is namemaps.hf_deepseek_v3_hub:          # a hub file: the MTP layer with its copies
        return DEEPSEEK_MTP_CFG
    if make is namemaps.hf_deepseek_v3:
        return DEEPSEEK_CFG
    if make in (namemaps.hf_mixtral, namemaps.hf_mixtral_hub):
        return MIXTRAL_CFG
    return LLAMA_CFG if make is namemaps.hf_llama else CFG


def trace_params(seed=0, cfg=CFG):
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal(shape) for n, shape in names.param_shapes(cfg).items()}


@pytest.mark.parametrize("make", list(namemaps.MAPS.values()), ids=list(namemaps.MAPS))
def test_every_map_round_trips_exactly(make):
    m = make(cfg_of(make))
    trace = trace_params(cfg=cfg_of(make))
    theirs = m.from_trace(trace)
    assert set(theirs) == m.sources() | set(m.copies)
    back = m.to_trace(theirs)
    assert list(back) == names.forward_param_order(cfg_of(make))
    assert all(np.array_equal(back[n], trace[n]) for n in trace)


@pytest.mark.parametrize("cfg", [CFG, LLAMA_CFG, MIXTRAL_CFG, DEEPSEEK_CFG, DEEPSEEK_DENSE_CFG, DEEPSEEK_MTP_CFG,
                                 {**DEEPSEEK_DENSE_CFG, "mtp_depth": 2}],
                         ids=["gpt2", "llama", "mixtral", "deepseek_v3", "deepseek_v3-dense", "deepseek_v3-mtp",
                              "deepseek_v3-dense-mtp2"])
def test_each_family_names_the_map_of_its_transformers_class(cfg):
    """A model family's ``hf_map`` (model/families) is a shipped map whose
    trace names are exactly the family's parameters, in its order; the
    checker's names (names.forward_param_order, param_shapes) are the
    family's declarations, the MTP depths' included."""
    from mpicube.core.config import ModelConfig
    from mpicube.model.families import family_of

    model = ModelConfig.from_dict(cfg)
    family = family_of(model)
    m = namemaps.MAPS[family.hf_map](cfg)
    assert sorted(m.rules) == sorted(family.param_names(model))
    assert [d.name for d in family.params(model)] == list(family.param_names(model))
    assert {d.name: tuple(d.shape) for d in family.params(model)} == names.param_shapes(cfg)
    assert list(names.param_shapes(cfg)) == names.forward_param_order(cfg)


def test_linear_weights_are_transposed_and_q_k_v_split_by_columns():
    trace = trace_params()
    nano = namemaps.nanogpt(CFG).from_trace(trace)
    assert np.array_equal(nano["transformer.h.1.mlp.c_fc.weight"], trace["h.1.mlp.c_fc.weight"].T)   # (4h, h)
    assert np.array_equal(nano["transformer.h.1.ln_2.bias"], trace["h.1.ln_2.bias"])
    hf = namemaps.hf_gpt2(CFG).from_trace(trace)                  # Conv1D: already (in, out)
    assert np.array_equal(hf["transformer.h.0.attn.c_attn.weight"], trace["h.0.attn.c_attn.weight"])
    split = namemaps.split_qkv(CFG).from_trace(trace)
    for k, part in enumerate("qkv"):
        cols = slice(k * H, (k + 1) * H)
        assert np.array_equal(split[f"transformer.h.0.attn.{part}_proj.weight"],
                              trace["h.0.attn.c_attn.weight"][:, cols].T)
        assert np.array_equal(split[f"transformer.h.0.attn.{part}_proj.bias"], trace["h.0.attn.c_attn.bias"][cols])


def test_hf_llama_splits_gqa_q_k_v_and_gate_up_by_their_widths():
    """c_attn's columns are q (4 heads), k and v (2 kv heads each) of head
    size 2, c_fc's gate then up (12 each); every HF linear is (out, in);
    the untied lm_head is (V, h) on both sides."""
    trace = trace_params(cfg=LLAMA_CFG)
    hf = namemaps.hf_llama(LLAMA_CFG).from_trace(trace)
    p, hd = "model.layers.1.", 2
    w = trace["h.1.attn.c_attn.weight"]                                  # (8, (4 + 2 + 2) * 2)
    assert w.shape == (8, 16)
    assert np.array_equal(hf[p + "self_attn.q_proj.weight"], w[:, :4 * hd].T)
    assert np.array_equal(hf[p + "self_attn.k_proj.weight"], w[:, 4 * hd:6 * hd].T)
    assert np.array_equal(hf[p + "self_attn.v_proj.weight"], w[:, 6 * hd:].T)
    assert np.array_equal(hf[p + "mlp.gate_proj.weight"], trace["h.1.mlp.c_fc.weight"][:, :12].T)
    assert np.array_equal(hf[p + "mlp.up_proj.weight"], trace["h.1.mlp.c_fc.weight"][:, 12:].T)
    assert np.array_equal(hf[p + "mlp.down_proj.weight"], trace["h.1.mlp.c_proj.weight"].T)
    assert np.array_equal(hf["lm_head.weight"], trace["lm_head"]) and "model.norm.weight" in hf
    with pytest.raises(UserError, match="not a Llama"):
        namemaps.hf_llama(CFG)


def test_megatron_fused_qkv_rows_go_per_head():
    """Row (j*3 + p)*hd + d of linear_qkv is column p*h + j*hd + d of c_attn
    (head j, part p of q/k/v, element d), written out element by element."""
    trace = trace_params()
    meg = namemaps.megatron_gpt2(CFG).from_trace(trace)
    fused = "decoder.layers.1.self_attention.linear_qkv."
    w, b = meg[fused + "weight"], meg[fused + "bias"]
    assert w.shape == (3 * H, H)
    for j in range(NH):
        for p in range(3):
            for d in range(HD):
                assert np.array_equal(w[(j * 3 + p) * HD + d], trace["h.1.attn.c_attn.weight"][:, p * H + j * HD + d])
                assert b[(j * 3 + p) * HD + d] == trace["h.1.attn.c_attn.bias"][p * H + j * HD + d]
    assert np.array_equal(meg["decoder.layers.0.mlp.linear_fc2.weight"], trace["h.0.mlp.c_proj.weight"].T)


def test_a_map_that_misses_or_misnames_a_parameter_is_named():
    m = namemaps.nanogpt(CFG)
    theirs = m.from_trace(trace_params())
    del theirs["transformer.h.1.ln_1.bias"]
    with pytest.raises(UserError, match=r"name map nanogpt: the model has no 'transformer.h.1.ln_1.bias'"):
        m.to_trace(theirs)
    theirs = m.from_trace(trace_params())
    theirs["transformer.h.0.mlp.fc.weight"] = theirs.pop("transformer.h.0.mlp.c_fc.weight")
    with pytest.raises(UserError, match=r"has no 'transformer.h.0.mlp.c_fc.weight'"):
        m.to_trace(theirs)
    theirs = m.from_trace(trace_params())
    theirs["transformer.extra"] = np.zeros(1)
    with pytest.raises(UserError, match=r"the model's 'transformer.extra' maps to no trace tensor"):
        m.to_trace(theirs)
    theirs = m.from_trace(trace_params())
    theirs["lm_head.weight"] = theirs["transformer.wte.weight"]      # a tied head is an alias, not an extra
    assert m.to_trace(theirs).keys() == trace_params().keys()


# --------------------------------------------------------------------------- the recorder (torch)


def torch_tool():
    spec = importlib.util.spec_from_file_location("torch_trace", REPO / "tools" / "torch_trace.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_recorder_takes_gradients_before_clipping_and_loads_the_reference(tmp_path):
    torch = pytest.importorskip("torch")
    from mpicube.check.reference import Reference
    from mpicube.check.torch import Recorder

    ref_path = write_good(tmp_path / "ref.h5")
    tool = torch_tool()
    with Reference(ref_path) as ref:
        model = tool.GPT(ref.config, ref.dropout).double()
        name_map = namemaps.nanogpt(ref.config)
        with Recorder(model, name_map, tmp_path / "rec.h5", ref) as rec:
            rec.load_init()
            x, y = (torch.as_tensor(t) for t in ref.batch(1))
            model.set_masks(ref.masks(1), "cpu", torch.float64)
            logits, loss = model(x, y)
            loss.backward()
            rec.gradients()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)           # clips for sure
            rec.step(1, loss=loss, lr=ref.lr(1), grad_norm=norm, logits=logits, masks=ref.masks(1),
                     tokens=ref.tokens[0])
        init = ref.init()
    with h5py.File(tmp_path / "rec.h5", "r") as f:
        assert all(np.array_equal(f[f"init/{n}"][()], init[n]) for n in init)
        grads = [f[f"step_1/grad/{n}"][()] for n in init]
        assert np.sqrt(sum((g ** 2).sum() for g in grads)) == pytest.approx(f["step_1/grad_norm"][()], rel=1e-12)
        assert f["step_1/grad_norm"][()] > 1e-2                      # the unclipped norm
        assert set(f["step_1/act"]) == set(names.act_names(CFG)) and f["step_1/logits"].shape == (2, 4, 16)
        a = f["step_1/act"]                         # the branches are what the residual stream adds
        assert np.allclose(a["h.0"][()], a["emb"][()] + a["h.0.attn"][()] + a["h.0.mlp"][()], rtol=0, atol=1e-12)


def test_recorder_refuses_a_model_the_map_does_not_cover(tmp_path):
    torch = pytest.importorskip("torch")
    from mpicube.check.reference import Reference
    from mpicube.check.torch import Recorder

    ref_path = write_good(tmp_path / "ref.h5")
    with Reference(ref_path) as ref:
        model = torch_tool().GPT(ref.config, 0.0)
        model.extra = torch.nn.Parameter(torch.zeros(3))
        with pytest.raises(UserError, match="'extra' maps to no trace tensor"):
            Recorder(model, namemaps.nanogpt(ref.config), tmp_path / "x.h5", ref)


@pytest.mark.parametrize("make", list(namemaps.MAPS.values()), ids=list(namemaps.MAPS))
def test_shards_map_to_the_trace_blocks_the_whole_tensor_maps_to(make):
    """Every framework tensor split in two along its first dimension (rows
    of a fused q/k/v, columns of a transposed weight) and the halves mapped
    on their own put together into exactly what the whole maps to."""
    from mpicube.check.shards import Shard

    m = make(cfg_of(make))
    trace = trace_params(cfg=cfg_of(make))
    theirs = m.from_trace(trace)
    split = {}
    for name, value in theirs.items():
        cut = value.shape[0] // 2
        rows = [np.arange(cut), np.arange(cut, value.shape[0])]
        split[name] = [Shard(r, (ix, *[np.arange(n) for n in value.shape[1:]]), value[ix]) for r, ix in enumerate(rows)]
    mapped = m.shards_to_trace(split, {n: v.shape for n, v in theirs.items()})
    for name, tensor in mapped.items():
        assert tensor.shape == trace[name].shape, name
        full = np.full(tensor.shape, np.nan)
        for s in tensor.shards:
            full[np.ix_(*s.index)] = s.data
        assert np.array_equal(full, trace[name]), (m.name, name)


def hf_llama_shape(cfg: dict) -> dict:
    """transformers' config keywords for the shape of a trace's Llama-family
    ``cfg`` (untied head), shared by its Llama and Mixtral configs."""
    return dict(vocab_size=cfg["vocab_size"], hidden_size=cfg["n_embd"], intermediate_size=cfg["ffn_hidden"],
                num_hidden_layers=cfg["n_layer"], num_attention_heads=cfg["n_head"],
                num_key_value_heads=cfg["n_kv_head"], max_position_embeddings=cfg["n_ctx"],
                rms_norm_eps=cfg["rms_eps"], tie_word_embeddings=False)


def test_hf_llama_map_fits_transformers_llama_and_the_torch_tool_computes_the_same(monkeypatch):
    """The hf_llama map's names are those of transformers' LlamaForCausalLM
    (every parameter used, every activation module present), and
    tools/torch_trace.py's plain-torch Llama loaded through the same map
    gives transformers' logits to 1e-12 (transformers' float32 RMSNorm,
    rotary angles and eager softmax patched to float64: tests/hf_float64.py).
    Skipped without torch and transformers."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import hf_float64

    hf_float64.patch(monkeypatch, torch, transformers.models.llama.modeling_llama)
    cfg = LLAMA_CFG
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **hf_llama_shape(cfg), rope_theta=cfg["rope_theta"], attn_implementation="eager")).double().eval()
    m = namemaps.hf_llama(cfg)
    m.check_names(dict(hf.named_parameters()))
    assert all(hf.get_submodule(path) is not None for path in m.acts.values())
    ours = torch_tool().Llama(cfg, 0.0).double().eval()
    values = m.from_trace({n: 0.3 * v for n, v in trace_params(3, cfg).items()})
    with torch.no_grad():
        for model in (hf, ours):
            params = dict(model.named_parameters())
            for name, value in values.items():
                params[name].copy_(torch.as_tensor(value))
        idx = torch.as_tensor(np.random.default_rng(4).integers(0, cfg["vocab_size"], (2, cfg["n_ctx"])))
        want = hf(idx).logits                                                   # (2, T, V)
        got, _ = ours(idx, idx)
    assert float((got - want).abs().max()) <= 1e-12 * float(want.abs().max())


def test_hf_mixtral_maps_cover_transformers_mixtral_in_memory_and_on_file(tmp_path):
    """hf_mixtral uses every parameter of a random transformers
    MixtralForCausalLM (its fused gate_up_proj/down_proj experts, the
    router ``gate``; every activation module present), hf_mixtral_hub every
    tensor of the same model's save_pretrained files (per-expert w1/w2/w3),
    both give the same trace tensors, and expert e's trace weights compute
    what transformers' expert e computes (c_fc's columns [gate | up]).
    Skipped without torch and transformers."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    safetensors = pytest.importorskip("safetensors.numpy")
    cfg = MIXTRAL_CFG
    hf = transformers.MixtralForCausalLM(transformers.MixtralConfig(
        **hf_llama_shape(cfg), num_local_experts=cfg["n_experts"], num_experts_per_tok=cfg["top_k"],
        experts_implementation="eager")).double().eval()           # the loop over experts (float64 too)
    fused = namemaps.hf_mixtral(cfg)
    ours = fused.to_trace({n: p.detach().numpy() for n, p in hf.named_parameters()})   # every name used
    assert list(ours) == names.forward_param_order(cfg)
    assert all(hf.get_submodule(path) is not None for path in fused.acts.values())
    hf.save_pretrained(tmp_path)
    on_file = {k: v for f in sorted(tmp_path.glob("*.safetensors")) for k, v in safetensors.load_file(f).items()}
    assert any(".block_sparse_moe.experts.3.w2.weight" in k for k in on_file), sorted(on_file)[:8]
    hub = namemaps.hf_mixtral_hub(cfg).to_trace(on_file)
    assert list(hub) == list(ours) and all(np.array_equal(hub[n], ours[n]) for n in ours)
    x = np.random.default_rng(6).standard_normal((5, cfg["n_embd"]))                   # (n, h)
    F = cfg["ffn_hidden"]
    for e in range(cfg["n_experts"]):
        w_fc, w_proj = ours[f"h.1.moe.experts.{e}.c_fc.weight"], ours[f"h.1.moe.experts.{e}.c_proj.weight"]
        gate, up = x @ w_fc[:, :F], x @ w_fc[:, F:]                                  # (n, F) each
        want = (gate / (1 + np.exp(-gate)) * up) @ w_proj                           # (n, h)
        with torch.no_grad():
            got = hf.model.layers[1].mlp.experts(torch.as_tensor(x), torch.full((5, 1), e),
                                                 torch.ones((5, 1), dtype=torch.float64)).numpy()
        assert np.abs(got - want).max() <= 1e-12 * np.abs(want).max(), e
    logits = x @ ours["h.1.moe.router.weight"]                                       # (n, E)
    with torch.no_grad():
        theirs = hf.model.layers[1].mlp.gate(torch.as_tensor(x))[0].numpy()
    assert np.abs(theirs - logits).max() <= 1e-12 * np.abs(logits).max()


def test_hf_deepseek_maps_cover_transformers_deepseek_and_agree_with_the_file_reader(tmp_path):
    """hf_deepseek_v3 uses every parameter of a random transformers
    DeepseekV3ForCausalLM (MLA with a q rank, a dense first block, fused
    routed experts, a shared expert; every activation module present),
    hf_deepseek_v3_hub every tensor of its save_pretrained files, both give
    the same trace tensors, and those are what mpicube's own reader of the
    directory gives (files/formats/hf_deepseek.py: an independent table),
    its config read as the trace's (names.config_of). kv_a_proj_with_mqa
    maps whole onto kv_down: the latent's rows its first columns, k_pe's
    its last; e_score_correction_bias is the buffer of the record
    moe/h.1.bias. Skipped without torch and transformers."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    safetensors = pytest.importorskip("safetensors.numpy")
    from mpicube.files import formats

    cfg = DEEPSEEK_CFG
    hf = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
        **hf_llama_shape(cfg), moe_intermediate_size=cfg["moe_ffn_hidden"], n_shared_experts=1, n_routed_experts=8,
        kv_lora_rank=6, q_lora_rank=5, qk_rope_head_dim=4, v_head_dim=3, qk_nope_head_dim=2, n_group=4,
        topk_group=2, num_experts_per_tok=2, first_k_dense_replace=1, routed_scaling_factor=2.5,
        rope_parameters={"rope_type": "default", "rope_theta": 50.0})).double().eval()
    with torch.no_grad():
        hf.model.layers[1].mlp.gate.e_score_correction_bias.copy_(torch.linspace(-0.1, 0.1, 8))
    fused = namemaps.hf_deepseek_v3(cfg)
    ours = fused.to_trace({n: p.detach().numpy() for n, p in hf.named_parameters()})    # every name used
    fused.check_names(hf.state_dict())                                                    # the buffer too
    assert list(ours) == names.forward_param_order(cfg)
    assert all(hf.get_submodule(path) is not None for path in fused.acts.values())
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert fused.buffers == {bias: "moe/h.1.bias"}
    kv = hf.model.layers[1].self_attn.kv_a_proj_with_mqa.weight.detach().numpy()         # (rkv + dr, h)
    assert np.array_equal(ours["h.1.attn.kv_down.weight"][:, :6], kv[:6].T)              # the kv latent's
    assert np.array_equal(ours["h.1.attn.kv_down.weight"][:, 6:], kv[6:].T)              # k_pe's
    hf.save_pretrained(tmp_path)
    on_file = {k: v for f in sorted(tmp_path.glob("*.safetensors")) for k, v in safetensors.load_file(f).items()}
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in on_file, sorted(on_file)[:8]
    hub = namemaps.hf_deepseek_v3_hub(cfg)
    mapped = hub.to_trace(on_file, "file")
    assert list(mapped) == list(ours) and all(np.array_equal(mapped[n], ours[n]) for n in ours)
    with formats.open_model(tmp_path) as model_file:
        assert names.config_of(model_file.config.to_dict()) == cfg
        read = model_file.read_all()
        assert sorted(read) == sorted(ours) and all(np.array_equal(read[n], ours[n]) for n in ours)
        assert np.array_equal(model_file.read_buffers()["h.1.moe.router.score_bias"], on_file[bias])
    with pytest.raises(UserError, match="not a DeepSeek-V3"):
        namemaps.hf_deepseek_v3(MIXTRAL_CFG)
    with pytest.raises(UserError, match="not a Llama"):
        namemaps.hf_llama(cfg)


def test_deepseek_mtp_depths_are_ordered_after_the_head_forward_and_first_backward():
    """With --mtp-depth D the trace's parameters end with each depth's
    block h.{L+k-1} and mtp.{k-1}.* (the model's declaration order), and
    backward completes the depths first, from depth D: its output norm,
    its block, the projection, the two input norms; the untied head with
    depth 1 (its last use), then the main model's ln_f and blocks, wte
    last. The depths' blocks run after the main logits (their records
    before the losses), and their routers' bias updates follow lr."""
    cfg = {**DEEPSEEK_CFG, "mtp_depth": 2}
    own = ["enorm.weight", "hnorm.weight", "proj.weight", "ln_f.weight"]
    block = [s for s in names.block_params(cfg, 1)]                   # the mixture's (h.2, h.3 are mixtures too)
    forward = names.forward_param_order(cfg)
    assert forward[forward.index("lm_head") + 1:] == ([f"h.2.{s}" for s in block] + [f"mtp.0.{s}" for s in own]
                                                      + [f"h.3.{s}" for s in block] + [f"mtp.1.{s}" for s in own])
    back = names.backward_param_order(cfg)
    depth = [f"h.{{i}}.{s}" for s in names._backward_block(cfg, 1)]
    tail = ["proj.weight", "enorm.weight", "hnorm.weight"]
    assert back[:back.index("ln_f.weight")] == (["mtp.1.ln_f.weight"] + [n.format(i=3) for n in depth]
                                                + [f"mtp.1.{s}" for s in tail] + ["lm_head", "mtp.0.ln_f.weight"]
                                                + [n.format(i=2) for n in depth] + [f"mtp.0.{s}" for s in tail])
    assert back[-1] == "wte" and sorted(back) == sorted(forward)
    step = names.step_names(cfg, 1, state=True)
    at = {n.split("/", 1)[1]: i for i, n in enumerate(step)}
    assert at["logits"] < at["act/h.2.ln_1"] < at["moe/h.2.scores"] < at["act/h.3"] < at["moe/aux_loss"] \
        < at["mtp/main_loss"] < at["mtp/loss_2"] < at["loss"] < at["grad/mtp.1.ln_f.weight"]
    assert at["lr"] < at["moe/h.1.bias_update"] < at["moe/h.3.bias_update"] < at["state/exp_avg/mtp.1.proj.weight"]
    assert "state/expert_load/h.3" in at
    shuffled = sorted(step, key=lambda n: n[::-1])
    assert names.ordered(shuffled, cfg) == step                       # compare's order puts each where it belongs
    hostile = {**cfg, "mtp_depth": 2 ** 40}                               # costs what the names cost
    assert names.ordered(["step_1/grad/wte", "step_1/grad/mtp.0.proj.weight", "step_1/mtp/loss_1"], hostile) == \
        ["step_1/mtp/loss_1", "step_1/grad/mtp.0.proj.weight", "step_1/grad/wte"]
    # the tolerances' depths: the chain runs through both depths' blocks
    assert [names.depth(f"step_1/{n}", cfg) for n in ("act/h.1", "act/ln_f", "act/h.2", "act/h.3", "mtp/loss_2",
                                                       "loss", "grad/mtp.1.ln_f.weight", "grad/lm_head",
                                                       "grad/ln_f.weight", "grad/wte")] == [3, 4, 5, 6, 7, 8, 10, 10,
                                                                                              11, 15]


def test_hf_deepseek_hub_map_covers_the_mtp_layer_mpicube_writes(tmp_path):
    """A DeepseekV3 directory with its MTP layer, as mpicube's own writer
    makes it (files/formats/hf_deepseek_model.py: layer L's enorm, hnorm,
    eh_proj, shared_head.norm, the block's tensors and the copies of the
    embedding and head), maps through hf_deepseek_v3_hub to exactly the
    trace tensors it was written from, every file tensor used (the
    routers' biases as buffers, the MTP block's too); back, the map gives
    the writer's names and values. A copy that differs from the shared
    tensor is bad input naming it."""
    from safetensors.numpy import load_file

    from mpicube.core.config import ModelConfig
    from mpicube.files import formats
    from mpicube.files.formats import hf_deepseek_model

    cfg = DEEPSEEK_MTP_CFG
    trace = trace_params(4, cfg)
    hf_deepseek_model.write(tmp_path / "ds", trace, ModelConfig.from_dict(cfg))
    on_file = {k: v for f in sorted((tmp_path / "ds").glob("*.safetensors")) for k, v in load_file(f).items()}
    assert {"model.layers.2.eh_proj.weight", "model.layers.2.shared_head.head.weight",
            "model.layers.2.embed_tokens.weight", "model.layers.2.mlp.experts.7.down_proj.weight"} <= set(on_file)
    hub = namemaps.hf_deepseek_v3_hub(cfg)
    hub.check_names(on_file, "file")
    assert hub.buffers == {f"model.layers.{i}.mlp.gate.e_score_correction_bias": f"moe/h.{i}.bias" for i in (1, 2)}
    assert hub.copies == {"model.layers.2.embed_tokens.weight": "model.embed_tokens.weight",
                          "model.layers.2.shared_head.head.weight": "lm_head.weight"}
    mapped = hub.to_trace(on_file, "file")
    assert list(mapped) == names.forward_param_order(cfg) and all(np.array_equal(mapped[n], trace[n]) for n in trace)
    assert np.array_equal(on_file["model.layers.2.eh_proj.weight"], trace["mtp.0.proj.weight"].T)   # (C, 2C)
    theirs = hub.from_trace(trace)
    assert sorted(theirs) == sorted(set(on_file) - set(hub.buffers))
    assert all(np.array_equal(theirs[n], on_file[n]) for n in theirs)
    with formats.open_model(tmp_path / "ds") as model_file:
        assert names.config_of(model_file.config.to_dict()) == cfg
    on_file["model.layers.2.shared_head.head.weight"] = on_file["model.layers.2.shared_head.head.weight"] + 1.0
    with pytest.raises(UserError, match="'model.layers.2.shared_head.head.weight' differs from 'lm_head.weight'"):
        hub.to_trace(on_file, "file")
    del on_file["model.layers.2.shared_head.head.weight"], on_file["model.layers.2.embed_tokens.weight"]
    assert list(hub.to_trace(on_file, "file")) == list(mapped)          # the copies are optional
    del on_file["model.layers.2.eh_proj.weight"]
    with pytest.raises(UserError, match="has no 'model.layers.2.eh_proj.weight'"):
        hub.to_trace(on_file, "file")
