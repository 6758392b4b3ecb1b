"""PyTorch eager's side of ``tools/compare_torch.py``: one whole timed run in
its own process, as a PyTorch user would run it.

Nothing here imports mpicube: this file runs in an environment that has
torch and NumPy only (mpicube does not depend on torch), and reads the
initial weights and the batch from the .npz file that mpicube wrote, so
both libraries start from the same numbers. It prints one JSON line: the
first-step loss, every timed step, this process's matmul rate and its
thread settings.

    python tools/torch_step.py --weights w.npz --steps 20 --warmup 3
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import numpy as np
import torch


class TorchGPT(torch.nn.Module):
    """GPT-2 (tied head, pre-LN, tanh GELU) in plain torch ops, its weights
    named as mpicube's ParamStore names them."""

    def __init__(self, n_layer: int, n_head: int, weights: dict):
        super().__init__()
        self.n_layer, self.n_head = n_layer, n_head
        self.p = torch.nn.ParameterDict({k.replace(".", "_"): torch.nn.Parameter(torch.tensor(v))
                                         for k, v in weights.items()})

    def w(self, name):
        return self.p[name.replace(".", "_")]

    def forward(self, idx, targets):
        w, nh = self.w, self.n_head
        B, T = idx.shape
        h = w("wte").shape[1]
        x = w("wte")[idx] + w("wpe")[:T]                                     # (B, T, h)
        for i in range(self.n_layer):
            p = f"h.{i}."
            a = torch.nn.functional.layer_norm(x, (h,), w(p + "ln_1.weight"), w(p + "ln_1.bias"), 1e-5)
            qkv = a @ w(p + "attn.c_attn.weight") + w(p + "attn.c_attn.bias")
            q, k, v = qkv.view(B, T, 3, nh, h // nh).permute(2, 0, 3, 1, 4)   # (B, nh, T, hd) each
            scores = (q @ k.transpose(-1, -2)) / math.sqrt(h // nh)
            mask = torch.ones(T, T, dtype=torch.bool).triu(1)
            att = scores.masked_fill(mask, float("-inf")).softmax(-1)
            y = (att @ v).transpose(1, 2).reshape(B, T, h)
            x = x + y @ w(p + "attn.c_proj.weight") + w(p + "attn.c_proj.bias")
            a = torch.nn.functional.layer_norm(x, (h,), w(p + "ln_2.weight"), w(p + "ln_2.bias"), 1e-5)
            f = torch.nn.functional.gelu(a @ w(p + "mlp.c_fc.weight") + w(p + "mlp.c_fc.bias"), approximate="tanh")
            x = x + f @ w(p + "mlp.c_proj.weight") + w(p + "mlp.c_proj.bias")
        x = torch.nn.functional.layer_norm(x, (h,), w("ln_f.weight"), w("ln_f.bias"), 1e-5)
        logits = x @ w("wte").T                                              # (B, T, V)
        return torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def matmul_rate(n: int, h: int, seconds: float = 0.3) -> float:
    """FLOP/s of a float32 (n, h) @ (h, 4h) torch.matmul: the median of
    repeats filling ``seconds``, after two untimed ones."""
    a, b = torch.ones(n, h), torch.ones(h, 4 * h)
    for _ in range(2):
        torch.matmul(a, b)
    times, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end or len(times) < 5:
        t0 = time.perf_counter()
        torch.matmul(a, b)
        times.append(time.perf_counter() - t0)
    return 2.0 * n * h * 4 * h / float(np.median(times))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--weights", required=True, help=".npz from compare_torch.py --write-weights")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()
    t_start = time.perf_counter()
    data = np.load(args.weights)
    n_layer, n_head = int(data["meta.n_layer"]), int(data["meta.n_head"])
    tokens = data["meta.tokens"]                                             # (B, T + 1)
    weights = {k[len("w."):]: data[k] for k in data.files if k.startswith("w.")}
    model = TorchGPT(n_layer, n_head, weights)
    decay = [p for n, p in model.p.items() if n.endswith("_weight") and "ln_" not in n]
    no_decay = [p for n, p in model.p.items() if not (n.endswith("_weight") and "ln_" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=1e-4, betas=(0.9, 0.95), eps=1e-8)
    x, y = torch.tensor(tokens[:, :-1]), torch.tensor(tokens[:, 1:])

    def step():
        opt.zero_grad(set_to_none=True)
        loss = model(x, y)
        loss.backward()
        opt.step()
        return float(loss)

    times, first = [], None
    for i in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        loss = step()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
        first = loss if first is None else first
    B, T = x.shape
    print(json.dumps({
        "library": f"torch {torch.__version__}", "first_loss": first, "step_s": times,
        "matmul_flops": matmul_rate(B * T, weights["wte"].shape[1]),
        "blas": blas_kernels(torch),
        "threads": f"torch.get_num_threads() {torch.get_num_threads()}, "
                   f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '(unset)')}",
        "process_s": time.perf_counter() - t_start}))


def blas_kernels(torch) -> str:
    """torch's own BLAS, as its build says (MKL is linked into torch, where
    threadpoolctl does not see it: it would report NumPy's OpenBLAS), and
    the CPU capability torch dispatches its kernels for (AVX2, AVX512)."""
    import re

    found = re.search(r"BLAS_INFO=(\w+)", torch.__config__.show())
    return (f"{found.group(1) if found else 'unknown'} (torch's build), "
            f"CPU capability {torch.backends.cpu.get_cpu_capability()}")


if __name__ == "__main__":
    main()
