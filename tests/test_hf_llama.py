"""A random ``LlamaForCausalLM`` (grouped-query attention: 8 heads over 2
kv heads; a vocabulary of 61, a multiple of no tensor-parallel size),
saved by transformers, evaluates on every layout to 1e-9 of transformers'
own float64 loss; and a Llama config.json mpicube does not compute is
refused by the field's name.

transformers' "float64" Llama still computes RMSNorm and the rotary angles
in float32 (it casts to float32 inside both, on purpose, for 16-bit
training); the reference here replaces those two forwards with their
float64 arithmetic, and uses torch's SDPA attention (float64 throughout),
so that the comparison is between two float64 computations. Skipped where
torch or transformers is not installed; mpicube itself never imports them
(the evaluations run in separate processes with mpicube's path only).
"""

import json

import numpy as np
import pytest

from mpirun import ROOT, mpiexec

VOCAB, T, B, BATCHES = 61, 16, 4, 2
LAYOUTS = [(1, "serial", 1), (2, "1d", 1), (4, "2d", 1), (8, "3d", 1), (8, "2.5d", 2)]


def float64_reference(torch, modeling):
    """Patch transformers' Llama RMSNorm and rotary embedding to compute in float64."""

    def rms_forward(self, x):
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.variance_epsilon))

    def rope_forward(self, x, position_ids):
        cfg = self.config
        dim = cfg.hidden_size // cfg.num_attention_heads
        theta = cfg.rope_parameters["rope_theta"] if getattr(cfg, "rope_parameters", None) else cfg.rope_theta
        inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
        angles = position_ids[..., None].double() * inv_freq
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos().to(x.dtype), angles.sin().to(x.dtype)

    modeling.LlamaRMSNorm.forward = rms_forward
    modeling.LlamaRotaryEmbedding.forward = rope_forward


def make_model(tmp_path, torch, transformers):
    """A random float64 LlamaForCausalLM saved under tmp_path/llama, its reference loss and a token shard."""
    from mpicube.files import data

    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=T,
                                      rms_norm_eps=1e-5, rope_theta=500.0, tie_word_embeddings=False,
                                      initializer_range=0.2, attn_implementation="sdpa")   # logits far from uniform
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).double().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):                 # norms away from 1: their weight must be applied
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    model.save_pretrained(str(tmp_path / "llama"), safe_serialization=True)
    tokens = np.random.default_rng(1).integers(0, VOCAB, BATCHES * B * T + 1)
    data.write_shard(tmp_path / "tokens.bin", tokens)
    float64_reference(torch, transformers.models.llama.modeling_llama)
    starts = np.arange(BATCHES * B) * T                      # batch k, row r: token (k B + r) T
    x = torch.tensor(np.stack([tokens[s:s + T] for s in starts]))
    y = torch.tensor(np.stack([tokens[s + 1:s + T + 1] for s in starts]))
    with torch.no_grad():
        logits = model(x).logits                             # (8, T, V) float64
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
    return float(loss)


def test_llama_directory_evaluates_like_transformers(tmp_path):
    torch = pytest.importorskip("torch", reason="torch is not installed (optional check)")
    transformers = pytest.importorskip("transformers", reason="transformers is not installed (optional check)")
    want = make_model(tmp_path, torch, transformers)
    for ranks, layout, depth in LAYOUTS:
        proc = mpiexec(ranks, ["-m", "mpicube", "eval", tmp_path / "llama", "--data", tmp_path / "tokens.bin",
                               "--batch-size", B, "--seq-len", T, "--batches", BATCHES, "--dtype", "float64",
                               "--layout", layout, "--depth", depth], timeout=180, env={"PYTHONPATH": str(ROOT)})
        assert proc.returncode == 0, proc.stdout + proc.stderr
        got = json.loads(proc.stdout.strip().splitlines()[-1])["loss"]
        assert abs(got - want) <= 1e-9 * abs(want), f"{layout}: {got!r} vs transformers {want!r}"


@pytest.mark.parametrize("field,value", [("attention_bias", True), ("rope_parameters", {"rope_type": "llama3"}),
                                         ("head_dim", 8), ("num_key_value_heads", 3)])
def test_unsupported_llama_config_is_refused_by_name(tmp_path, field, value):
    from mpicube.files.formats import hf_llama
    from mpicube.files.formats.base import FormatError

    doc = {"model_type": "llama", "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 24,
           "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
           "max_position_embeddings": T, field: value}
    with pytest.raises(FormatError, match=field):
        hf_llama.parse_config(tmp_path, doc)
