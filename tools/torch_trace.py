"""The same training steps in PyTorch, written as a framework user would,
traced in mpicube's trace format (docs/trace-format.md) so that
``mpicube compare`` can check the two tensor by tensor.

It reads a reference trace's model config, optimizer, initial parameters,
batches and (with dropout) keep masks, trains a GPT-2 made of ordinary torch
modules - nn.Embedding, nn.LayerNorm, nn.Linear, nn.GELU - with autograd,
``torch.optim.AdamW`` over two parameter groups and ``clip_grad_norm_``,
and writes a trace of the same steps. Nothing here imports mpicube: this
is the "other framework" side of the comparison.

    mpicube trace --dtype float64 --steps 3 --out ref.h5
    python tools/torch_trace.py ref.h5 --out torch.h5
    mpicube compare ref.h5 torch.h5

torch is needed only here and is not a dependency of mpicube: install it
into the environment that runs this tool (``pip install torch`` gives the
CPU build or a CUDA one; a distribution's python3-torch works too). The
tool itself needs torch, numpy and h5py.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import h5py
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

FORMAT, VERSION = "mpicube-trace", 1


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
    """GPT-2 with the LM head tied to the token embedding. Module names
    follow GPT-2's, so parameter names match the trace's."""

    def __init__(self, cfg: dict, p: float):
        super().__init__()
        self.wte = nn.Embedding(cfg["vocab_size"], cfg["n_embd"])
        self.wpe = nn.Embedding(cfg["n_ctx"], cfg["n_embd"])
        self.drop = ReplayDropout(p)
        self.h = nn.ModuleList(Block(cfg, p) for _ in range(cfg["n_layer"]))
        self.ln_f = nn.LayerNorm(cfg["n_embd"], eps=1e-5)
        self.lm_head = nn.Linear(cfg["n_embd"], cfg["vocab_size"], bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx, targets):
        T = idx.shape[1]
        x = self.drop(self.wte(idx) + self.wpe(torch.arange(T, device=idx.device)))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))                          # (B, T, V)
        return logits, F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


# --------------------------------------------------------------------------- trace names <-> torch


def torch_name(name: str) -> str:
    """Trace (GPT-2) name -> torch parameter name."""
    return name + ".weight" if name in ("wte", "wpe") else name


def is_linear_weight(model: GPT, name: str) -> bool:
    """nn.Linear stores (out, in); GPT-2 and the trace store (in, out)."""
    module = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else None
    return isinstance(module, nn.Linear) and name.endswith(".weight")


def to_trace(model: GPT, name: str, tensor) -> np.ndarray:
    t = tensor.detach()
    return (t.T if is_linear_weight(model, name) else t).cpu().numpy()


def load_init(model: GPT, init: h5py.Group, device) -> None:
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name in init:
            value = torch.as_tensor(init[name][()], device=device)
            params[torch_name(name)].copy_(value.T if is_linear_weight(model, torch_name(name)) else value)


def trace_names(model: GPT) -> list:
    return [n[: -len(".weight")] if n in ("wte.weight", "wpe.weight") else n for n, _ in model.named_parameters()]


# --------------------------------------------------------------------------- the run


def lr_at(sched: dict, step: int) -> float:
    """Linear warm-up, then cosine decay to min_lr (step is 1-based)."""
    peak, warmup, steps, floor = sched["peak"], sched["warmup"], sched["steps"], sched["min_lr"]
    if warmup > 0 and step <= warmup:
        return peak * step / warmup
    progress = min(1.0, (step - warmup) / max(1, steps - warmup))
    return floor + 0.5 * (peak - floor) * (1.0 + math.cos(math.pi * progress))


def set_masks(model: GPT, masks, device, dtype) -> None:
    """Point every dropout site at the reference trace's keep mask of this step."""
    def get(name):
        return torch.as_tensor(masks[name][()], device=device).to(dtype)

    model.drop.mask = get("emb")
    for i, block in enumerate(model.h):
        block.attn.attn_dropout.mask = get(f"h.{i}.attn")
        block.attn.resid_dropout.mask = get(f"h.{i}.resid_attn")
        block.mlp.dropout.mask = get(f"h.{i}.resid_mlp")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("reference", help="trace to take config, optimizer, initial parameters, batches and masks from")
    ap.add_argument("--out", required=True, help="trace file to write")
    ap.add_argument("--steps", type=int, default=None, help="steps to run (default: all the reference's)")
    ap.add_argument("--device", default="cpu", help="torch device (cpu, cuda)")
    args = ap.parse_args(argv)

    ref = h5py.File(args.reference, "r")
    if ref.attrs.get("format") != FORMAT or int(ref.attrs.get("version", 0)) != VERSION:
        print(f"error: {args.reference}: not a {FORMAT} v{VERSION} file", file=sys.stderr)
        return 2
    cfg = json.loads(ref.attrs["config"])
    optim = json.loads(ref.attrs["optimizer"])
    dtype = torch.float64 if ref.attrs["dtype"] == "float64" else torch.float32
    p = float(ref.attrs.get("dropout", 0.0))
    tokens = ref["tokens"][()]                                        # (N, B, T+1) int32
    steps = min(args.steps or len(tokens), len(tokens))
    device = torch.device(args.device)

    torch.set_default_dtype(dtype)
    model = GPT(cfg, p).to(device)
    load_init(model, ref["init"], device)
    names = dict(zip(trace_names(model), model.parameters()))
    decay = set(optim["decay"])
    groups = [{"params": [t for n, t in names.items() if n in decay], "weight_decay": optim["weight_decay"]},
              {"params": [t for n, t in names.items() if n not in decay], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=0.0, betas=tuple(optim["betas"]), eps=optim["eps"])
    max_norm = optim["grad_clip"]["max_norm"]

    captured = {}
    def keep(key):
        return lambda module, inputs, output: captured.__setitem__(key, output.detach())
    model.drop.register_forward_hook(keep("emb"))
    for i, block in enumerate(model.h):
        block.register_forward_hook(keep(f"h.{i}"))
    model.ln_f.register_forward_hook(keep("ln_f"))

    out = h5py.File(args.out, "w")
    for key in ("config", "optimizer", "dtype", "dropout", "seed"):
        if key in ref.attrs:
            out.attrs[key] = ref.attrs[key]
    out.attrs.update({"format": FORMAT, "version": VERSION, "steps": steps,
                      "layout": json.dumps({"framework": "torch", "torch": torch.__version__, "device": str(device)})})
    out["tokens"] = tokens[:steps]
    for name, t in names.items():
        out[f"init/{name}"] = to_trace(model, torch_name(name), t)

    for s in range(1, steps + 1):
        g = f"step_{s}/"
        batch = torch.as_tensor(tokens[s - 1].astype(np.int64), device=device)
        x, y = batch[:, :-1], batch[:, 1:]                            # (B, T) each
        if p > 0:
            set_masks(model, ref[g + "dropout"], device, dtype)
            for name in ref[g + "dropout"]:
                out[g + "dropout/" + name] = ref[g + "dropout/" + name][()]
        lr = lr_at(optim["lr"], s)
        for group in opt.param_groups:
            group["lr"] = lr
        opt.zero_grad(set_to_none=True)
        logits, loss = model(x, y)
        loss.backward()
        for name, t in names.items():                                 # before clipping
            out[g + "grad/" + name] = to_trace(model, torch_name(name), t.grad)
        if max_norm > 0:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        else:
            norm = torch.sqrt(sum((t.grad.double() ** 2).sum() for t in model.parameters()))
        opt.step()
        for key, value in captured.items():
            out[g + "act/" + key] = value.cpu().numpy()
        out[g + "logits"] = logits.detach().cpu().numpy()
        out[g + "loss"] = float(loss)
        out[g + "lr"] = lr
        out[g + "grad_norm"] = float(norm)
        for name, t in names.items():
            out[g + "param/" + name] = to_trace(model, torch_name(name), t)
        print(f"step {s}/{steps}: loss {float(loss):.6f}, lr {lr:.3e}, grad_norm {float(norm):.6f}")
    out.close()
    print(f"wrote {args.out}: {steps} steps of torch {torch.__version__}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
