"""What reproducibility costs: the serial training step with mpicube's GEMMs
in panels fixed by their shape on a one-thread BLAS (the default, the same
bits at any thread count) against the same step with each GEMM handed whole
to OpenBLAS on the rank's threads (its own split: faster or not, but its
last bits change with the thread count under some kernels), alternating
step by step in one process so that both see the same machine state.
Prints median wall and CPU time per step and the BLAS kernel that ran.

    python tools/gemm_threads.py                          # 4 x 144, T 64, B 8
    python tools/gemm_threads.py --n-embd 768 --seq-len 256 --batch-size 4

CPU time counts every thread of the process, spinning or waiting in a
barrier included; on a loaded machine it is the steadier of the two.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from mpi4py import MPI
from threadpoolctl import threadpool_info, threadpool_limits

from mpicube.core.config import ModelConfig
from mpicube.device import gemm_threads
from mpicube.device.threads import configure
from mpicube.training.optim import AdamW
from mpicube.parallel.planning import resolve
from mpicube.training.train import build_parts


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-head", type=int, default=12)
    ap.add_argument("--n-embd", type=int, default=144)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10, help="timed steps of each (after 2 warm-up steps)")
    args = ap.parse_args()
    share = configure()
    cfg = ModelConfig(vocab_size=256, n_ctx=args.seq_len, n_layer=args.n_layer, n_head=args.n_head,
                      n_embd=args.n_embd)
    parts = build_parts(resolve("serial", cfg, args.batch_size, 1), MPI.COMM_SELF, seed=0)
    opt = AdamW(parts.store, weight_decay=0.1)
    tokens = np.random.default_rng(0).integers(0, 256, (args.batch_size, args.seq_len + 1))
    x, y = tokens[:, :-1], tokens[:, 1:]

    def step():
        parts.store.zero_grad()
        parts.model.forward(x, y, step=1)
        parts.model.backward()
        opt.step(1e-4)

    panels = gemm_threads.gemm

    def blas_split(a, b, out=None):
        return np.matmul(a, b, out=out)

    variants = {"fixed panels (default)": (panels, 1), "OpenBLAS's own split": (blas_split, share.threads)}
    times = {name: ([], []) for name in variants}
    for rnd in range(args.steps + 2):
        for name, (gemm, blas_threads) in variants.items():
            gemm_threads.gemm = gemm
            with threadpool_limits(blas_threads, user_api="blas"):
                t0, c0 = time.perf_counter(), time.process_time()
                step()
                if rnd >= 2:
                    times[name][0].append(time.perf_counter() - t0)
                    times[name][1].append(time.process_time() - c0)
    gemm_threads.gemm = panels
    kernel = ", ".join(f"{i['internal_api']} {i.get('architecture')}" for i in threadpool_info()
                       if i["user_api"] == "blas")
    print(f"model: {cfg.n_layer} layers, n_embd {cfg.n_embd}, seq {args.seq_len}, batch {args.batch_size}; "
          f"{share.describe()}; BLAS kernel: {kernel}")
    for name, (wall, cpu) in times.items():
        print(f"{name:<28} wall {np.median(wall) * 1e3:8.1f} ms ({min(wall) * 1e3:.1f}-{max(wall) * 1e3:.1f})"
              f"   cpu {np.median(cpu) * 1e3:8.1f} ms")
    first, second = (np.median(w) for w, _ in times.values())
    print(f"ratio fixed panels / OpenBLAS's split, wall: {first / second:.2f}x")


if __name__ == "__main__":
    main()
