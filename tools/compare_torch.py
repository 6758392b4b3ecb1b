"""Serial training step: mpicube (NumPy) vs PyTorch eager on the CPU.

Both run the same GPT-2 (tied head, pre-LN, tanh GELU) from the same initial
weights on the same batch, with AdamW, in one process, alternating so that
both see the same machine state, each starting after a pause (``--pause``)
in which the other library's idle worker threads stop spinning: OpenBLAS's
and PyTorch's OpenMP workers both spin for milliseconds after their last
call, and on a 2-core machine a step that starts while the other pool
spins runs on one core. Prints the median step times, their ratio,
each one's fraction of its own library's matmul rate, and the first-step
losses (which must agree: the comparison is of the same computation).

torch is needed only here: `pip install torch` (CPU build); it is not an
mpicube dependency.

    python tools/compare_torch.py                       # 4 x 768, T 256, B 4
    python tools/compare_torch.py --n-embd 144 --seq-len 64 --batch-size 8
"""

from __future__ import annotations

import argparse
import math
import time

from mpicube.device import fused
import numpy as np
import torch
from mpi4py import MPI

from mpicube.analysis.bench import median_seconds, model_flops
from mpicube.core.config import ModelConfig
from mpicube.training.optim import AdamW
from mpicube.parallel.planning import resolve
from mpicube.training.train import build_parts


class TorchGPT(torch.nn.Module):
    """GPT-2 in plain torch ops, weights copied from an mpicube ParamStore."""

    def __init__(self, cfg: ModelConfig, weights: dict):
        super().__init__()
        self.cfg = cfg
        self.p = torch.nn.ParameterDict({k.replace(".", "_"): torch.nn.Parameter(torch.tensor(v))
                                         for k, v in weights.items()})

    def w(self, name):
        return self.p[name.replace(".", "_")]

    def forward(self, idx, targets):
        cfg, w = self.cfg, self.w
        B, T = idx.shape
        h, nh = cfg.n_embd, cfg.n_head
        x = w("wte")[idx] + w("wpe")[:T]
        for i in range(cfg.n_layer):
            p = f"h.{i}."
            a = torch.nn.functional.layer_norm(x, (h,), w(p + "ln_1.weight"), w(p + "ln_1.bias"), 1e-5)
            qkv = a @ w(p + "attn.c_attn.weight") + w(p + "attn.c_attn.bias")
            q, k, v = qkv.view(B, T, 3, nh, h // nh).permute(2, 0, 3, 1, 4)
            scores = (q @ k.transpose(-1, -2)) / math.sqrt(h // nh)
            mask = torch.ones(T, T, dtype=torch.bool).triu(1)
            att = scores.masked_fill(mask, float("-inf")).softmax(-1)
            y = (att @ v).transpose(1, 2).reshape(B, T, h)
            x = x + y @ w(p + "attn.c_proj.weight") + w(p + "attn.c_proj.bias")
            a = torch.nn.functional.layer_norm(x, (h,), w(p + "ln_2.weight"), w(p + "ln_2.bias"), 1e-5)
            f = torch.nn.functional.gelu(a @ w(p + "mlp.c_fc.weight") + w(p + "mlp.c_fc.bias"), approximate="tanh")
            x = x + f @ w(p + "mlp.c_proj.weight") + w(p + "mlp.c_proj.bias")
        x = torch.nn.functional.layer_norm(x, (h,), w("ln_f.weight"), w("ln_f.bias"), 1e-5)
        logits = x @ w("wte").T
        return torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def matmul_rate(mm, a, b, min_repeats=7, min_seconds=0.5):
    """FLOP/s of mm(a, b) (bench.median_seconds)."""
    return 2.0 * a.shape[0] * a.shape[1] * b.shape[1] / median_seconds(lambda: mm(a, b), min_repeats, min_seconds)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-head", type=int, default=12)
    ap.add_argument("--n-embd", type=int, default=768)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10, help="timed steps of each (after 2 warm-up steps)")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads [default: torch's]")
    ap.add_argument("--pause", type=float, default=0.05,
                    help="seconds of idle before each timed step, for the other pool's spinning to end [0.05]")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    cfg = ModelConfig(vocab_size=256, n_ctx=args.seq_len, n_layer=args.n_layer, n_head=args.n_head,
                      n_embd=args.n_embd)
    parts = build_parts(resolve("serial", cfg, args.batch_size, 1), MPI.COMM_SELF, seed=0)
    opt = AdamW(parts.store, weight_decay=0.1)
    weights = {name: parts.store.data[name].copy() for name in parts.store.data}
    tmodel = TorchGPT(cfg, weights)
    decay = [p for n, p in tmodel.p.items() if n.endswith("_weight") and "ln_" not in n]
    no_decay = [p for n, p in tmodel.p.items() if not (n.endswith("_weight") and "ln_" not in n)]
    topt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=1e-4, betas=(0.9, 0.95), eps=1e-8)

    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, (args.batch_size, args.seq_len + 1))
    x, y = tokens[:, :-1], tokens[:, 1:]
    tx, ty = torch.tensor(x), torch.tensor(y)

    def ours():
        parts.store.zero_grad()
        loss = parts.model.forward(x, y, step=1)
        parts.model.backward()
        opt.step(1e-4)
        return loss

    def theirs():
        topt.zero_grad(set_to_none=True)
        loss = tmodel(tx, ty)
        loss.backward()
        topt.step()
        return float(loss)

    N, h = args.batch_size * args.seq_len, args.n_embd
    a32, b32 = np.ones((N, h), np.float32), np.ones((h, 4 * h), np.float32)
    ta, tb = torch.ones(N, h), torch.ones(h, 4 * h)

    first = (ours(), theirs())
    ours()
    theirs()
    # Each round times both steps and both libraries' matmul, so that every
    # figure of a fraction comes from the same stretch of the machine's time.
    t_ours, t_theirs, r_np, r_torch = [], [], [], []
    for _ in range(args.steps):
        time.sleep(args.pause)
        t0 = time.perf_counter()
        ours()
        t_ours.append(time.perf_counter() - t0)
        time.sleep(args.pause)
        t0 = time.perf_counter()
        theirs()
        t_theirs.append(time.perf_counter() - t0)
        r_np.append(matmul_rate(np.matmul, a32, b32, min_repeats=3, min_seconds=0.05))
        r_torch.append(matmul_rate(torch.matmul, ta, tb, min_repeats=3, min_seconds=0.05))
    m_ours, m_theirs = float(np.median(t_ours)), float(np.median(t_theirs))
    g_np, g_torch = float(np.median(r_np)), float(np.median(r_torch))
    flops = model_flops(cfg, args.batch_size, args.seq_len)
    print(f"model: {cfg.n_layer} layers, n_embd {h}, {cfg.n_head} heads, seq {args.seq_len}, batch "
          f"{args.batch_size}, vocab 256; {flops / 1e9:.2f} GFLOP per step; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; mpicube kernels: {fused.describe()}")
    print(f"first-step loss: mpicube {first[0]:.6f}, torch {first[1]:.6f}")
    print(f"{'':<10} {'median step':>12} {'spread':>17} {'GFLOP/s':>8} {'matmul GFLOP/s':>15} {'fraction':>9}")
    for name, med, ts, g in (("mpicube", m_ours, t_ours, g_np), ("torch", m_theirs, t_theirs, g_torch)):
        print(f"{name:<10} {med * 1e3:>10.1f}ms {min(ts) * 1e3:>7.1f}-{max(ts) * 1e3:.1f}ms "
              f"{flops / med / 1e9:>8.1f} {g / 1e9:>15.1f} {flops / med / g:>8.0%}")
    print(f"ratio mpicube / torch step time: {m_ours / m_theirs:.2f}x (below 1 = mpicube faster)")


if __name__ == "__main__":
    main()
