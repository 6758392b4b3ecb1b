"""CuPy check for a machine with a GPU: the GPU path follows the CPU path.

One process (no MPI launcher needed): the serial GPT in float64 on NumPy and
on CuPy from the same seed and batch; loss, every gradient and the
parameters after two AdamW steps must agree to 1e-10 relative. Then a
float32 timing of the 768-wide model on the GPU (median of 10 steps).

    pip install -e '.[gpu]'      # cupy-cuda12x
    python tools/gpu_check.py

Multi-rank GPU runs (one rank per GPU, host-staged MPI) use the same code
through `mpiexec -n P mpicube train --device gpu`.
"""

from __future__ import annotations

import sys
import time

import numpy as np
from mpi4py import MPI

from mpicube.bench import model_flops
from mpicube.config import ModelConfig
from mpicube.optim import AdamW
from mpicube.train import build_parts


def build(device, dtype, cfg, batch):
    parts = build_parts(cfg, "serial", batch, MPI.COMM_SELF, dtype=dtype, device=device, seed=3, dropout=0.1)
    return parts, AdamW(parts.store)


def host(parts, array):
    return parts.backend.to_host(array)


def main() -> int:
    cfg = ModelConfig(vocab_size=61, n_ctx=16, n_layer=2, n_head=4, n_embd=32)
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 61, (4, 16)), rng.integers(0, 61, (4, 16))
    cpu, cpu_opt = build("cpu", "float64", cfg, 4)
    gpu, gpu_opt = build("gpu", "float64", cfg, 4)
    worst = 0.0
    for step in (1, 2):
        losses = []
        for parts, opt in ((cpu, cpu_opt), (gpu, gpu_opt)):
            parts.store.zero_grad()
            losses.append(parts.model.forward(x, y, step=step))
            parts.model.backward()
            opt.step(1e-2)
        worst = max(worst, abs(losses[0] - losses[1]) / abs(losses[0]))
        print(f"step {step}: loss cpu {losses[0]:.15f} gpu {losses[1]:.15f}")
    for name in cpu.store.data:
        a, b = host(cpu, cpu.store.data[name]), host(gpu, gpu.store.data[name])
        worst = max(worst, float(np.abs(a - b).max() / max(np.abs(a).max(), 1e-300)))
    print(f"largest relative difference (losses, parameters after 2 steps): {worst:.2e}")
    ok = worst <= 1e-10

    big = ModelConfig(vocab_size=256, n_ctx=256, n_layer=4, n_head=12, n_embd=768)
    parts, opt = build("gpu", "float32", big, 4)
    tokens = np.random.default_rng(1).integers(0, 256, (4, 257))
    times = []
    for i in range(12):
        parts.backend.synchronize()
        t0 = time.perf_counter()
        parts.store.zero_grad()
        parts.model.forward(tokens[:, :-1], tokens[:, 1:], step=i + 1)
        parts.model.backward()
        opt.step(1e-4)
        parts.backend.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    median = float(np.median(times))
    print(f"768-wide model, float32 on the GPU: {median * 1e3:.1f} ms per step, "
          f"{model_flops(big, 4, 256) / median / 1e12:.2f} TFLOP/s")
    print("OK" if ok else "FAILED: the GPU path differs from the CPU path")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
