"""A random ``LlamaForCausalLM`` (grouped-query attention: 8 heads over 2
kv heads; a vocabulary of 61, a multiple of no tensor-parallel size),
saved by transformers, evaluates on every layout to 1e-12 of transformers'
own float64 loss; and a Llama config.json mpicube does not compute is
refused by the field's name.

transformers' "float64" Llama still computes RMSNorm and the rotary angles
in float32 (it casts to float32 inside both, on purpose, for 16-bit
training); the reference here replaces those forwards with their float64
arithmetic (tests/hf_float64.py), and uses torch's SDPA attention (float64
throughout), so that the comparison is between two float64 computations. Skipped where
torch or transformers is not installed; mpicube itself never imports them
(the evaluations run in separate processes with mpicube's path only).
"""

import json
from pathlib import Path

import numpy as np
import pytest

import hf_float64
from mpirun import ROOT, mpiexec

VOCAB, T, B, BATCHES = 61, 16, 4, 2
TOKENS = np.random.default_rng(1).integers(0, VOCAB, BATCHES * B * T + 1)
LAYOUTS = [(1, "serial", 1), (2, "1d", 1), (4, "1d", 1), (8, "1d", 1), (4, "2d", 1), (8, "3d", 1), (8, "2.5d", 2)]


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}     # head size 4, theta 500: one frequency blended, one stretched


def make_model(tmp_path, monkeypatch, torch, transformers, rope=None):
    """A random float64 LlamaForCausalLM saved under tmp_path/llama (with
    the rope type ``rope``'s scaling if given), a token shard, and its
    loss with transformers' Llama patched to float64 (``hf_float64``)."""
    from mpicube.files import data

    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=T,
                                      rms_norm_eps=1e-5, rope_parameters={"rope_theta": 500.0, **(rope or {})},
                                      tie_word_embeddings=False, initializer_range=0.2,
                                      attn_implementation="sdpa")   # logits far from uniform
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).double().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):                 # norms away from 1: their weight must be applied
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    model.save_pretrained(str(tmp_path / "llama"), safe_serialization=True)
    model.save_pretrained(str(tmp_path / "sharded"), safe_serialization=True, max_shard_size="40KB")
    data.write_shard(tmp_path / "tokens.bin", TOKENS)
    hf_float64.patch(monkeypatch, torch, transformers.models.llama.modeling_llama)
    return reference_loss(torch, model)


def reference_loss(torch, model, tokens=None):
    """transformers' float64 mean cross-entropy of ``model`` over the eval's batches of ``tokens``."""
    tokens = TOKENS if tokens is None else tokens
    starts = np.arange(BATCHES * B) * T                      # batch k, row r: token (k B + r) T
    x = torch.tensor(np.stack([tokens[s:s + T] for s in starts]))
    y = torch.tensor(np.stack([tokens[s + 1:s + T + 1] for s in starts]))
    with torch.no_grad():
        logits = model(x).logits                             # (8, T, V) float64
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
    return float(loss)


def test_llama_directory_evaluates_like_transformers(tmp_path, monkeypatch):
    """Every layout; the 2-D and 2.5-D runs read the same model split by
    transformers over several safetensors files (model.safetensors.index.json)."""
    from mpicube.files.formats import open_model

    torch = pytest.importorskip("torch", reason="torch is not installed (optional check)")
    transformers = pytest.importorskip("transformers", reason="transformers is not installed (optional check)")
    want = make_model(tmp_path, monkeypatch, torch, transformers)
    shards = sorted(p.name for p in (tmp_path / "sharded").glob("*.safetensors"))
    assert len(shards) >= 2 and (tmp_path / "sharded" / "model.safetensors.index.json").is_file(), shards
    with open_model(tmp_path / "sharded") as m:
        assert m.describe().endswith(f"({len(shards)} safetensors shards)")
    for ranks, layout, depth in LAYOUTS:
        model = tmp_path / ("sharded" if layout in ("2d", "2.5d") else "llama")
        proc = mpiexec(ranks, ["-m", "mpicube", "eval", model, "--data", tmp_path / "tokens.bin",
                               "--batch-size", B, "--seq-len", T, "--batches", BATCHES, "--dtype", "float64",
                               "--layout", layout, "--depth", depth], timeout=180, env={"PYTHONPATH": str(ROOT)})
        assert proc.returncode == 0, proc.stdout + proc.stderr
        got = json.loads(proc.stdout.strip().splitlines()[-1])["loss"]
        assert abs(got - want) <= 1e-12 * abs(want), f"{layout} ({model.name}): {got!r} vs transformers {want!r}"


def test_llama3_rope_scaling_like_transformers(tmp_path, monkeypatch):
    """Llama 3's scaled frequencies are transformers' own (its formula run in
    float64, and its float32 buffer to float32's rounding), and a model with
    them evaluates to 1e-12 of transformers' float64 loss (serial and 1-D)."""
    torch = pytest.importorskip("torch", reason="torch is not installed (optional check)")
    transformers = pytest.importorskip("transformers", reason="transformers is not installed (optional check)")
    from mpicube import ops
    from mpicube.files.formats import open_model

    wide = dict(vocab_size=VOCAB, hidden_size=512, intermediate_size=24, num_hidden_layers=1, num_attention_heads=8)
    for rope in ({"rope_type": "default"}, LLAMA3, {**LLAMA3, "original_max_position_embeddings": 2048}):
        config = transformers.LlamaConfig(**wide, rope_parameters={"rope_theta": 10000.0, **rope})
        scaling = None if rope["rope_type"] == "default" else (8.0, 1.0, 4.0, rope["original_max_position_embeddings"])
        ours = ops.rope_inv_freq(64, 10000.0, scaling)                              # (32,)
        assert np.allclose(ours, hf_float64.rope_parameters(torch, config)[0].numpy(), rtol=1e-15, atol=0)
        assert np.allclose(ours, hf_float64.rope_parameters(torch, config, wide=False)[0].numpy(), rtol=2e-7, atol=0)
        assert scaling is None or not np.allclose(ours, ops.rope_inv_freq(64, 10000.0))   # the scaling did something
    want = make_model(tmp_path, monkeypatch, torch, transformers, rope=LLAMA3)
    with open_model(tmp_path / "llama") as m:
        assert m.config.rope_scaling.as_tuple() == (8.0, 1.0, 4.0, 16)
    for ranks, layout, depth in LAYOUTS[:2]:
        proc = mpiexec(ranks, ["-m", "mpicube", "eval", tmp_path / "llama", "--data", tmp_path / "tokens.bin",
                               "--batch-size", B, "--seq-len", T, "--batches", BATCHES, "--dtype", "float64",
                               "--layout", layout, "--depth", depth], timeout=180, env={"PYTHONPATH": str(ROOT)})
        assert proc.returncode == 0, proc.stdout + proc.stderr
        got = json.loads(proc.stdout.strip().splitlines()[-1])["loss"]
        assert abs(got - want) <= 1e-12 * abs(want), f"{layout}: {got!r} vs transformers {want!r}"


def test_rope_fields_of_either_transformers_generation():
    """transformers 5's ``rope_parameters`` and the earlier top-level
    ``rope_theta`` with ``rope_scaling`` (rope_type once spelled ``type``)
    read the same."""
    from mpicube.files.formats import hf_llama

    doc = {"model_type": "llama", "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 24,
           "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2, "max_position_embeddings": T}
    tmp = Path(".")
    new = hf_llama.parse_config(tmp, {**doc, "rope_parameters": {"rope_theta": 500.0, **LLAMA3}})
    old_scaling = {("type" if k == "rope_type" else k): v for k, v in LLAMA3.items()}
    old = hf_llama.parse_config(tmp, {**doc, "rope_theta": 500.0, "rope_scaling": old_scaling})
    assert new == old and new.rope_theta == 500.0 and new.rope_scaling.factor == 8.0
    plain = hf_llama.parse_config(tmp, {**doc, "rope_theta": 500.0, "rope_scaling": None})
    assert plain.rope_scaling is None and plain.rope_theta == 500.0


@pytest.mark.parametrize("field,value", [("attention_bias", True), ("rope_parameters", {"rope_type": "yarn"}),
                                         ("rope_parameters", {"rope_type": "llama3", "factor": 8.0}),
                                         ("rope_scaling", {"rope_type": "dynamic", "factor": 2.0}),
                                         ("head_dim", 8), ("num_key_value_heads", 3)])
def test_unsupported_llama_config_is_refused_by_name(tmp_path, field, value):
    from mpicube.files.formats import hf_llama
    from mpicube.files.formats.base import FormatError

    doc = {"model_type": "llama", "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 24,
           "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
           "max_position_embeddings": T, field: value}
    with pytest.raises(FormatError, match=field):
        hf_llama.parse_config(tmp_path, doc)


def random_llama(cfg, seed=3) -> dict:
    """{mpicube name: float64 tensor} of a random Llama, norm weights away from 1."""
    from mpicube.model.gpt import gpt_params

    rng = np.random.default_rng(seed)
    return {d.name: 1.0 + 0.2 * rng.standard_normal(d.shape) if d.role == "norm" else
            0.3 * rng.standard_normal(d.shape) for d in gpt_params(cfg)}


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_llama_converts_to_hf_and_back_bitwise(tmp_path, tied):
    """A mpicube Llama (8 heads over 2 kv heads, vocabulary 61, Llama 3
    rope scaling) -> Hugging Face directory in shards -> mpicube: every
    tensor's bits and the configuration come back. The HF files hold
    transformers' names in its (out, in) orientation, split back from
    mpicube's fused c_attn ([q | k | v]) and c_fc ([gate | up]); a tied
    model stores no lm_head."""
    from safetensors.numpy import load_file

    from mpicube.core.config import ModelConfig, RopeScaling
    from mpicube.files.formats import open_model
    from mpicube.files.formats.convert import convert, write_mpicube

    cfg = ModelConfig(vocab_size=VOCAB, n_ctx=T, n_layer=2, n_head=8, n_embd=32, arch="llama", n_kv_head=2,
                      ffn_hidden=24, rope_theta=500.0, rms_eps=1e-5, tie_embeddings=tied,
                      rope_scaling=RopeScaling(8.0, 1.0, 4.0, 16))
    tensors = random_llama(cfg)
    write_mpicube(tmp_path / "run", tensors, cfg, 0, {"format": "test"})
    summary = convert(tmp_path / "run", tmp_path / "hf", "hf", max_shard_bytes=20_000)
    assert len(summary["files"]) >= 4                                         # >= 2 shards, the index, config.json
    doc = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert doc["architectures"] == ["LlamaForCausalLM"] and doc["num_key_value_heads"] == 2
    assert doc["head_dim"] == 4 and doc["intermediate_size"] == 24 and doc["tie_word_embeddings"] is tied
    assert doc["rope_parameters"] == {**cfg.rope_scaling.to_dict(), "rope_theta": 500.0}
    assert doc["rope_scaling"]["rope_type"] == "llama3" and doc["rope_theta"] == 500.0
    hf = {}
    for shard in (tmp_path / "hf").glob("*.safetensors"):
        hf.update(load_file(str(shard)))
    assert ("lm_head.weight" in hf) is not tied and len(hf) == 2 * 9 + 2 + (not tied)
    attn, fc = tensors["h.1.attn.c_attn.weight"], tensors["h.1.mlp.c_fc.weight"]                # (32, 48), (32, 48)
    p = "model.layers.1."
    assert np.array_equal(hf[p + "self_attn.q_proj.weight"], attn[:, :32].T)                   # (32, 32)
    assert np.array_equal(hf[p + "self_attn.k_proj.weight"], attn[:, 32:40].T)                 # (8, 32)
    assert np.array_equal(hf[p + "self_attn.v_proj.weight"], attn[:, 40:].T)
    assert np.array_equal(hf[p + "mlp.gate_proj.weight"], fc[:, :24].T)                        # (24, 32)
    assert np.array_equal(hf[p + "mlp.up_proj.weight"], fc[:, 24:].T)
    assert np.array_equal(hf[p + "mlp.down_proj.weight"], tensors["h.1.mlp.c_proj.weight"].T)  # (32, 24)
    convert(tmp_path / "hf", tmp_path / "back", "mpicube")
    with open_model(tmp_path / "back") as m:
        assert m.config == cfg
        back = m.read_all()
    assert back.keys() == tensors.keys()
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and np.array_equal(back[name], t), name


def test_exported_llama_loads_in_transformers(tmp_path, monkeypatch):
    """transformers' LlamaForCausalLM (GQA, vocabulary 61, Llama 3 scaling)
    -> mpicube checkpoint -> ``convert --to hf``: the same tensors, bit for
    bit, under the same names; transformers loads the export, and its
    float64 loss equals mpicube's on the checkpoint to 1e-12."""
    torch = pytest.importorskip("torch", reason="torch is not installed (optional check)")
    transformers = pytest.importorskip("transformers", reason="transformers is not installed (optional check)")
    from safetensors.numpy import load_file

    want = make_model(tmp_path, monkeypatch, torch, transformers, rope=LLAMA3)
    for args in (["llama", "run", "--to", "mpicube"], ["run", "export", "--to", "hf"]):
        proc = mpiexec(1, ["-m", "mpicube", "convert", *[tmp_path / a if i < 2 else a for i, a in enumerate(args)]],
                       env={"PYTHONPATH": str(ROOT)})
        assert proc.returncode == 0, proc.stdout + proc.stderr
    original, exported = load_file(str(tmp_path / "llama" / "model.safetensors")), \
        load_file(str(tmp_path / "export" / "model.safetensors"))
    assert original.keys() == exported.keys()
    for name, t in original.items():
        assert exported[name].dtype == t.dtype and np.array_equal(exported[name], t), name
    model = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "export"), dtype=torch.float64,
                                                          attn_implementation="sdpa").eval()
    assert model.config.rope_parameters["rope_type"] == "llama3" and model.config.num_key_value_heads == 2
    loaded = reference_loss(torch, model)
    proc = mpiexec(1, ["-m", "mpicube", "eval", tmp_path / "run", "--data", tmp_path / "tokens.bin", "--batch-size", B,
                       "--seq-len", T, "--batches", BATCHES, "--dtype", "float64"], env={"PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])["loss"]
    assert abs(got - loaded) <= 1e-12 * abs(loaded) and abs(loaded - want) <= 1e-12 * abs(want), (got, loaded, want)
