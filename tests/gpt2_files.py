"""Model files the tests make themselves (no downloads): random GPT-2
weights, Hugging Face directories and llm.c files written by hand from the
formats' published layouts (independently of mpicube.files.formats' writers),
and a plain NumPy GPT-2 forward pass to check logits against."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from mpicube.core.config import ModelConfig
from mpicube.model.gpt import gpt_params

LAYER_ORDER = ["ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias", "attn.c_proj.weight",
               "attn.c_proj.bias", "ln_2.weight", "ln_2.bias", "mlp.c_fc.weight", "mlp.c_fc.bias",
               "mlp.c_proj.weight", "mlp.c_proj.bias"]


def random_gpt2(cfg: ModelConfig, seed: int = 0, dtype=np.float32) -> dict:
    """{mpicube name: tensor}: weights large enough that logits differ
    visibly, LayerNorm gains near 1."""
    rng = np.random.default_rng(seed)
    out = {}
    for decl in gpt_params(cfg):
        if decl.init == "ones":
            t = 1.0 + 0.1 * rng.standard_normal(decl.shape)
        else:
            t = 0.3 * rng.standard_normal(decl.shape)
        out[decl.name] = t.astype(dtype)
    return out


def hf_config(cfg: ModelConfig, **overrides) -> dict:
    doc = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "activation_function": "gelu_new",
           "n_layer": cfg.n_layer, "n_head": cfg.n_head, "n_embd": cfg.n_embd, "n_positions": cfg.n_ctx,
           "n_ctx": cfg.n_ctx, "vocab_size": cfg.vocab_size, "layer_norm_epsilon": 1e-5, "n_inner": None}
    doc.update(overrides)
    return doc


def hf_names(tensors: dict, prefix: str = "transformer.") -> dict:
    """GPT2LMHeadModel's names: weights are Conv1D (in, out), as mpicube's."""
    named = {}
    for name, t in tensors.items():
        hf = {"wte": "wte.weight", "wpe": "wpe.weight"}.get(name, name)
        named[prefix + hf] = np.ascontiguousarray(t)
    return named


def write_hf(path, tensors: dict, cfg: ModelConfig, prefix="transformer.", extra=None, shards=1, **config) -> Path:
    """A Hugging Face GPT-2 directory written with safetensors directly."""
    from safetensors.numpy import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    named = hf_names(tensors, prefix)
    named.update(extra or {})
    (path / "config.json").write_text(json.dumps(hf_config(cfg, **config)))
    if shards == 1:
        save_file(named, str(path / "model.safetensors"), metadata={"format": "pt"})
        return path
    names = list(named)
    weight_map = {}
    for k in range(shards):
        part = names[k::shards]
        file = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: named[n] for n in part}, str(path / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in part})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


def write_llmc(path, tensors: dict, cfg: ModelConfig, version: int = 3, vocab_padded=None) -> Path:
    """An llm.c model file: header, then wte (padded), wpe, each layer tensor
    stacked over layers, matrices (out, in), then lnf."""
    L, V = cfg.n_layer, cfg.vocab_size
    vp = vocab_padded or -(-V // 128) * 128
    header = np.zeros(256, "<i4")
    header[:8] = (20240326, version, cfg.n_ctx, V, L, cfg.n_head, cfg.n_embd, vp)
    wte = np.zeros((vp, cfg.n_embd), np.float32)
    wte[:V] = tensors["wte"]
    parts = [wte, tensors["wpe"]]
    for suffix in LAYER_ORDER:
        matrix = suffix.endswith("weight") and not suffix.startswith("ln")
        parts += [tensors[f"h.{i}.{suffix}"].T if matrix else tensors[f"h.{i}.{suffix}"] for i in range(L)]
    parts += [tensors["ln_f.weight"], tensors["ln_f.bias"]]
    with open(path, "wb") as f:
        f.write(header.tobytes())
        for p in parts:
            p = np.ascontiguousarray(p, dtype=np.float32)
            if version == 5:       # bfloat16: the top 16 bits, rounded to nearest even
                bits = p.view(np.uint32).astype(np.uint64)
                p = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype("<u2")
            f.write(p.tobytes())
    return Path(path)


def bf16_round(t: np.ndarray) -> np.ndarray:
    bits = np.ascontiguousarray(t, dtype=np.float32).view(np.uint32).astype(np.uint64)
    top = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint32)
    return (top << 16).view(np.float32)


def reference_logits(tensors: dict, cfg: ModelConfig, tokens) -> np.ndarray:
    """GPT-2's forward pass in plain float64 NumPy: tokens (T,) -> (T, V)."""
    p = {k: np.asarray(v, dtype=np.float64) for k, v in tensors.items()}
    T, h, nh = len(tokens), cfg.n_embd, cfg.n_head
    hd = h // nh

    def ln(x, w, b):
        mu = x.mean(-1, keepdims=True)
        var = ((x - mu) ** 2).mean(-1, keepdims=True)
        return (x - mu) / np.sqrt(var + 1e-5) * w + b

    def gelu(x):
        return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))

    x = p["wte"][np.asarray(tokens)] + p["wpe"][:T]
    mask = np.triu(np.full((T, T), -np.inf), 1)
    for i in range(cfg.n_layer):
        a = f"h.{i}."
        qkv = ln(x, p[a + "ln_1.weight"], p[a + "ln_1.bias"]) @ p[a + "attn.c_attn.weight"] + p[a + "attn.c_attn.bias"]
        q, k, v = (qkv[:, j * h:(j + 1) * h].reshape(T, nh, hd).transpose(1, 0, 2) for j in range(3))
        s = q @ k.transpose(0, 2, 1) / math.sqrt(hd) + mask
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        y = (s @ v).transpose(1, 0, 2).reshape(T, h)
        x = x + y @ p[a + "attn.c_proj.weight"] + p[a + "attn.c_proj.bias"]
        f = gelu(ln(x, p[a + "ln_2.weight"], p[a + "ln_2.bias"]) @ p[a + "mlp.c_fc.weight"] + p[a + "mlp.c_fc.bias"])
        x = x + f @ p[a + "mlp.c_proj.weight"] + p[a + "mlp.c_proj.bias"]
    return ln(x, p["ln_f.weight"], p["ln_f.bias"]) @ p["wte"].T


def reference_loss(tensors, cfg, x, y) -> float:
    """Mean cross-entropy of batches x, y (B, T)."""
    total = 0.0
    for xs, ys in zip(x, y):
        logits = reference_logits(tensors, cfg, xs)
        logits -= logits.max(-1, keepdims=True)
        logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        total += -logp[np.arange(len(ys)), ys].sum()
    return total / x.size


def reference_greedy(tensors, cfg, prompt, n) -> list:
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(np.argmax(reference_logits(tensors, cfg, seq)[-1])))
    return seq[len(prompt):]
