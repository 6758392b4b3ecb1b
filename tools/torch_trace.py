"""The same training steps in PyTorch, written as a framework user would,
recorded with ``mpicube.check.torch`` so that ``mpicube compare`` can check
the two tensor by tensor.

It reads a reference trace's model config, optimizer, initial parameters,
batches and (with dropout) keep masks, trains a nanoGPT-style GPT-2 made of
ordinary torch modules - nn.Embedding, nn.LayerNorm, nn.Linear, nn.GELU -
or, for a trace of ``--arch llama``, a Llama under Hugging Face's module
names (RMSNorm, rotary embeddings with ``rotate_half``, grouped-query
attention, SwiGLU, an untied ``lm_head``) written here in plain torch, with
autograd, ``torch.optim.AdamW`` over two parameter groups (or
``torch.optim.SGD`` for a trace of ``--optimizer sgd``) and
``clip_grad_norm_``, and records the same steps. The model is torch's
alone; the recorder and the nanoGPT or hf_llama name map (transposing
nn.Linear's (out, in) weights, splitting ``c_attn`` and ``c_fc``) are the
only part of mpicube it uses, and they need
numpy and h5py, not MPI.

    mpicube trace --dtype float64 --steps 3 --out ref.h5
    python tools/torch_trace.py ref.h5 --out torch.h5
    mpicube compare ref.h5 torch.h5

``--torchao-fp8 tensorwise|rowwise`` trains the blocks' linears with
torchao's float8 training (emulated), for a reference traced with ``--fp8``
(docs/fp8.md, "Against torchao, one training step").

torch is not a dependency of mpicube: install it into the environment that
runs this tool (``pip install torch``; the CPU build is enough; torchao for
``--torchao-fp8``).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))       # run from a checkout without installing
from mpicube.check.namemaps import hf_llama, nanogpt                # noqa: E402
from mpicube.check.reference import Reference                       # noqa: E402
from mpicube.check.torch import Recorder                            # noqa: E402
from mpicube.core.errors import UserError                           # noqa: E402


class ReplayDropout(nn.Module):
    """Dropout whose keep mask is given from outside (the reference trace's),
    so both implementations drop the same elements; kept elements are
    scaled by 1 / (1 - p) as nn.Dropout does."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p
        self.mask = None          # set before each step when p > 0

    def forward(self, x):
        if self.p == 0.0:
            return x
        return x * self.mask / (1.0 - self.p)


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, n_ctx: int, p: float):
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.attn_dropout = ReplayDropout(p)
        self.resid_dropout = ReplayDropout(p)
        self.register_buffer("causal", torch.tril(torch.ones(n_ctx, n_ctx, dtype=torch.bool)))

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)                      # (B, T, C) each
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))       # (B, nh, T, T)
        att = att.masked_fill(~self.causal[:T, :T], float("-inf")).softmax(dim=-1)
        att = self.attn_dropout(att)
        y = (att @ v).transpose(1, 2).reshape(B, T, C)                # (B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, n_embd: int, p: float):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * n_embd, n_embd)
        self.dropout = ReplayDropout(p)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: dict, p: float):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg["n_embd"], eps=1e-5)
        self.attn = CausalSelfAttention(cfg["n_embd"], cfg["n_head"], cfg["n_ctx"], p)
        self.ln_2 = nn.LayerNorm(cfg["n_embd"], eps=1e-5)
        self.mlp = MLP(cfg["n_embd"], p)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """GPT-2 with nanoGPT's module names and the LM head tied to the token embedding."""

    def __init__(self, cfg: dict, p: float):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(cfg["vocab_size"], cfg["n_embd"]), wpe=nn.Embedding(cfg["n_ctx"], cfg["n_embd"]),
            drop=ReplayDropout(p), h=nn.ModuleList(Block(cfg, p) for _ in range(cfg["n_layer"])),
            ln_f=nn.LayerNorm(cfg["n_embd"], eps=1e-5)))
        self.lm_head = nn.Linear(cfg["n_embd"], cfg["vocab_size"], bias=False)
        self.lm_head.weight = self.transformer.wte.weight

    def forward(self, idx, targets):
        t = self.transformer
        x = t.drop(t.wte(idx) + t.wpe(torch.arange(idx.shape[1], device=idx.device)))
        for block in t.h:
            x = block(x)
        logits = self.lm_head(t.ln_f(x))                              # (B, T, V)
        return logits, F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))

    def set_masks(self, masks: dict, device, dtype) -> None:
        """Point every dropout site at the reference trace's keep mask of this step."""
        get = lambda site: torch.as_tensor(masks[site], device=device).to(dtype)     # noqa: E731
        self.transformer.drop.mask = get("emb")
        for i, block in enumerate(self.transformer.h):
            block.attn.attn_dropout.mask = get(f"h.{i}.attn")
            block.attn.resid_dropout.mask = get(f"h.{i}.resid_attn")
            block.mlp.dropout.mask = get(f"h.{i}.resid_mlp")


# --------------------------------------------------------------------------- Llama


class RMSNorm(nn.Module):
    """x / rms(x) * weight, the statistics in float32 or wider (as HF's)."""

    def __init__(self, n: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(n)), eps

    def forward(self, x):
        wide = x if x.dtype == torch.float64 else x.float()
        wide = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * wide.to(x.dtype)


def rotate_half(x):
    """(..., hd) -> (..., hd): the halves [a | b] become [-b | a]."""
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def rotary(T: int, hd: int, theta: float, dtype):
    """(cos, sin), each (T, hd): angle p / theta^(2j/hd) for the pair j, in
    float64 and then cast, the two halves sharing each angle."""
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)      # (hd/2,)
    angles = torch.outer(torch.arange(T, dtype=torch.float64), inv)             # (T, hd/2)
    both = torch.cat((angles, angles), dim=-1)                                  # (T, hd)
    return both.cos().to(dtype), both.sin().to(dtype)


class LlamaAttention(nn.Module):
    """Grouped-query causal attention: query head i reads kv head
    i // (n_head / n_kv_head); rotary on q and k; no biases."""

    def __init__(self, cfg: dict, p: float):
        super().__init__()
        h, self.nh, self.nkv = cfg["n_embd"], cfg["n_head"], cfg["n_kv_head"]
        self.hd, self.theta = h // self.nh, cfg["rope_theta"]
        self.q_proj = nn.Linear(h, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(h, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(h, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(h, h, bias=False)
        self.attn_dropout, self.resid_dropout = ReplayDropout(p), ReplayDropout(p)

    def forward(self, x):
        B, T, C = x.shape
        q = self.q_proj(x).view(B, T, self.nh, self.hd).transpose(1, 2)       # (B, nh, T, hd)
        k = self.k_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)      # (B, nkv, T, hd)
        v = self.v_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)
        cos, sin = rotary(T, self.hd, self.theta, x.dtype)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        group = self.nh // self.nkv
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)   # (B, nh, T, hd)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(self.hd)                   # (B, nh, T, T)
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        att = self.attn_dropout(att.masked_fill(~causal, float("-inf")).softmax(dim=-1))
        y = (att @ v).transpose(1, 2).reshape(B, T, C)                       # (B, T, C)
        return self.resid_dropout(self.o_proj(y))


class LlamaMLP(nn.Module):
    """down(silu(gate(x)) * up(x))."""

    def __init__(self, h: int, F: int, p: float):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(h, F, bias=False), nn.Linear(h, F, bias=False)
        self.down_proj = nn.Linear(F, h, bias=False)
        self.dropout = ReplayDropout(p)

    def forward(self, x):
        return self.dropout(self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x)))


class LlamaLayer(nn.Module):
    def __init__(self, cfg: dict, p: float):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg["n_embd"], cfg["rms_eps"])
        self.self_attn = LlamaAttention(cfg, p)
        self.post_attention_layernorm = RMSNorm(cfg["n_embd"], cfg["rms_eps"])
        self.mlp = LlamaMLP(cfg["n_embd"], cfg["ffn_hidden"], p)

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    """A Llama under Hugging Face ``LlamaForCausalLM``'s parameter names, so
    the hf_llama map serves it; ``model.drop`` is the embedding dropout
    (HF's Llama has none), whose output is the trace's ``act/emb``."""

    def __init__(self, cfg: dict, p: float):
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(cfg["vocab_size"], cfg["n_embd"])
        self.model.drop = ReplayDropout(p)
        self.model.layers = nn.ModuleList(LlamaLayer(cfg, p) for _ in range(cfg["n_layer"]))
        self.model.norm = RMSNorm(cfg["n_embd"], cfg["rms_eps"])
        self.lm_head = nn.Linear(cfg["n_embd"], cfg["vocab_size"], bias=False)
        if cfg["tie_embeddings"]:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, idx, targets):
        m = self.model
        x = m.drop(m.embed_tokens(idx))
        for layer in m.layers:
            x = layer(x)
        logits = self.lm_head(m.norm(x))                                       # (B, T, V)
        return logits, F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))

    def set_masks(self, masks: dict, device, dtype) -> None:
        get = lambda site: torch.as_tensor(masks[site], device=device).to(dtype)     # noqa: E731
        self.model.drop.mask = get("emb")
        for i, layer in enumerate(self.model.layers):
            layer.self_attn.attn_dropout.mask = get(f"h.{i}.attn")
            layer.self_attn.resid_dropout.mask = get(f"h.{i}.resid_attn")
            layer.mlp.dropout.mask = get(f"h.{i}.resid_mlp")


def model_for(cfg: dict, p: float):
    """The torch model of a trace's config, and the name map it records under."""
    if cfg.get("arch") == "llama":
        name_map = hf_llama(cfg)
        name_map.acts["emb"] = "model.drop"                # after the embedding dropout, as the format says
        return Llama(cfg, p), name_map
    return GPT(cfg, p), nanogpt(cfg)


def optimizer_for(model, ref, name_map):
    """torch's AdamW over the trace's two groups (decayed or not), or SGD
    when the reference was traced with --optimizer sgd."""
    opt_cfg = ref.optimizer
    if opt_cfg["name"] == "SGD":
        return torch.optim.SGD(model.parameters(), lr=0.0, momentum=0.0, foreach=False)
    decayed = name_map.sources(ref.decay)
    params = dict(model.named_parameters())
    groups = [{"params": [t for n, t in params.items() if n in decayed], "weight_decay": opt_cfg["weight_decay"]},
              {"params": [t for n, t in params.items() if n not in decayed], "weight_decay": 0.0}]
    # foreach=False: one tensor at a time, so DTensor shards and plain replicas mix (tools/check_dtensor.py)
    return torch.optim.AdamW(groups, lr=0.0, betas=tuple(opt_cfg["betas"]), eps=opt_cfg["eps"], foreach=False)


def clip(model, max_norm: float):
    """``clip_grad_norm_``'s rule, min(1, max_norm / (norm + 1e-6)), written
    out because torch's own cannot take DTensor and plain gradients in one
    list; returns the norm before clipping."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    norm = torch.linalg.vector_norm(torch.stack([
        torch.linalg.vector_norm(g.full_tensor() if hasattr(g, "full_tensor") else g) for g in grads]))
    if max_norm > 0:
        coef = min(1.0, max_norm / (float(norm) + 1e-6))
        for g in grads:
            g.mul_(coef)
    return norm


def train_and_record(model, ref, out, steps, device, layout, after_backward=None, say=print,
                     name_map=None, clip_fn=clip, applied=None, act_index=None) -> None:
    """The reference's steps on ``model``, recorded to ``out`` under
    ``name_map`` (default nanoGPT's); ``after_backward(model)`` may change
    the gradients (a planted bug), ``clip_fn(model, max_norm)`` clips and
    returns the norm, ``applied(model, masks)`` says which masks (or blocks
    of them) this rank applied (default: the reference's, whole),
    ``act_index`` goes to the Recorder. Every rank calls it under
    torch.distributed."""
    dtype = next(model.parameters()).dtype
    name_map = name_map or nanogpt(ref.config)
    opt = optimizer_for(model, ref, name_map)
    max_norm = ref.optimizer["grad_clip"]["max_norm"]
    with Recorder(model, name_map, out, ref, layout=layout, act_index=act_index) as rec:
        rec.load_init()
        for s in range(1, steps + 1):
            x, y = (torch.as_tensor(t, device=device) for t in ref.batch(s))        # (B, T) each
            masks = ref.masks(s)
            if masks:
                model.set_masks(masks, device, dtype)
            for group in opt.param_groups:
                group["lr"] = ref.lr(s)
            opt.zero_grad(set_to_none=True)
            logits, loss = model(x, y)
            loss.backward()
            if after_backward is not None:
                after_backward(model)
            rec.gradients()                                           # before clipping
            norm = clip_fn(model, max_norm)
            opt.step()
            state = {}
            if ref.has_state:            # the moments, and the RNG offset of the masks replayed: the reference's
                state = {"optimizer": opt, "rng_offset": ref.state(s, "rng_offset")}
            rec.step(s, loss=loss, lr=ref.lr(s), grad_norm=norm, logits=logits,
                     masks=applied(model, masks) if applied and masks else masks, tokens=ref.tokens[s - 1], **state)
            say(f"step {s}/{steps}: loss {loss.item():.6f}, lr {ref.lr(s):.3e}, grad_norm {float(norm):.6f}")


def float8_blocks(model, recipe: str) -> None:
    """torchao's float8 training on every nn.Linear but the head (mpicube's
    --fp8 quantizes the blocks' linears; the head is the tied embedding or
    kept in --dtype), emulated: the quantized operands are dequantized and
    multiplied in the model's dtype, so a float64 model checks the
    recipe's quantization, not a GPU's FP8 GEMM. ``recipe``: torchao's
    tensorwise (x and W e4m3, dy e5m2) or rowwise (e4m3 throughout, scales
    rounded down to powers of two: mpicube's --fp8 rowwise --fp8-pow2)."""
    import dataclasses

    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name(recipe)
    convert_to_float8_training(model, config=dataclasses.replace(config, emulate=True),
                               module_filter_fn=lambda module, fqn: fqn != "lm_head")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("reference", help="trace to take config, optimizer, initial parameters, batches and masks from")
    ap.add_argument("--out", required=True, help="trace file to write")
    ap.add_argument("--steps", type=int, default=None, help="steps to run (default: all the reference's)")
    ap.add_argument("--device", default="cpu", help="torch device (cpu, cuda)")
    ap.add_argument("--torchao-fp8", choices=("tensorwise", "rowwise"), default=None,
                    help="convert the blocks' nn.Linear layers with torchao's float8 training recipe, emulated\n"
                         "(for a reference traced with --fp8 tensorwise, or --fp8 rowwise --fp8-pow2)")
    args = ap.parse_args(argv)
    try:
        ref = Reference(args.reference)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    dtype, device = (torch.float64 if ref.dtype == "float64" else torch.float32), torch.device(args.device)
    model, name_map = model_for(ref.config, ref.dropout)
    model = model.to(device=device, dtype=dtype)
    if args.torchao_fp8:
        float8_blocks(model, args.torchao_fp8)
    steps = min(args.steps or ref.steps, ref.steps)
    with ref:
        train_and_record(model, ref, args.out, steps, device,
                         {"framework": "torch", "torch": torch.__version__, "device": str(device)}, name_map=name_map)
    print(f"wrote {args.out}: {steps} steps of torch {torch.__version__}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
