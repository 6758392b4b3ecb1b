"""The in-process steps of tools/gpu_check.py, run in its children
(``gpu_check.py --worker env|serial``): what the environment offers, and
the serial GPT in float64 on NumPy against CuPy."""

from __future__ import annotations

import shutil
import sys

def worker_env() -> dict:
    """Versions and capabilities, each found or its error recorded."""
    info = {}

    def record(key, fn):
        try:
            info[key] = fn()
        except Exception as exc:  # each probe may fail on its own; say how
            info[key] = f"unavailable: {type(exc).__name__}: {exc}"
        print(f"{key}: {info[key]}", flush=True)

    import platform

    record("python", lambda: sys.version.split()[0])
    record("host", platform.node)
    record("mpi4py_config", lambda: __import__("mpi4py").get_config())
    record("mpi4py", lambda: __import__("mpi4py").__version__)
    record("mpi_library", lambda: __import__("mpi4py.MPI", fromlist=["MPI"]).Get_library_version().strip())
    record("mpi_cuda_aware", lambda: __import__("mpicube.device.backend", fromlist=["backend"]).mpi_cuda_support())
    record("numpy", lambda: __import__("numpy").__version__)
    record("cupy", lambda: __import__("cupy").__version__)

    def cuda():
        import cupy

        rt = cupy.cuda.runtime
        props = rt.getDeviceProperties(0)
        name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
        free, total = cupy.cuda.Device(0).mem_info
        return {"runtime": rt.runtimeGetVersion(), "driver": rt.driverGetVersion(), "devices": rt.getDeviceCount(),
                "device": name, "compute_capability": cupy.cuda.Device(0).compute_capability,
                "memory_gib": round(total / 2 ** 30, 1), "free_gib": round(free / 2 ** 30, 1)}

    record("cuda", cuda)
    record("cuda_kernels_available", lambda: __import__("mpicube.device.cuda_kernels", fromlist=["x"]).available())
    record("torch", lambda: (lambda t: f"{t.__version__}, cuda {t.version.cuda}, available {t.cuda.is_available()}")(
        __import__("torch")))
    record("gxx", lambda: shutil.which("g++"))
    stand_in = getattr(sys.modules.get("cupy"), "_mpicube_host_memory", False)
    info["stand_in"] = stand_in
    info["ok"] = not str(info.get("cuda" if not stand_in else "cupy", "unavailable")).startswith("unavailable")
    return info


def worker_serial(kernels: str) -> dict:
    """float64 serial GPT, NumPy against CuPy: 2 steps with dropout."""
    import numpy as np
    from mpi4py import MPI

    from mpicube.device import cuda_kernels
    from mpicube.core.config import ModelConfig
    from mpicube.training.optim import AdamW
    from mpicube.parallel.gradients import global_grad_norm
    from mpicube.parallel.planning import resolve
    from mpicube.training.parts import Numerics
    from mpicube.training.train import build_parts

    from mpicube.device import fused

    fused.use(False)                  # the CPU reference without numba: no JIT cache to build in the lease
    if kernels == "on" and not cuda_kernels.available():
        if getattr(__import__("cupy"), "_mpicube_host_memory", False):
            return {"ok": None, "skipped": "CI's stand-in runs no CUDA source"}
        return {"ok": False, "error": "CUDA kernels unavailable (cuda_kernels.available() is False)"}
    # GELU's (B T, 4h) = (512, 512) and the softmax's rows exceed every CPU cache block
    cfg = ModelConfig(vocab_size=256, n_ctx=64, n_layer=2, n_head=4, n_embd=128)
    B = 8
    gen = np.random.default_rng(0)
    batches = [(gen.integers(0, 256, (B, 64)), gen.integers(0, 256, (B, 64))) for _ in range(2)]
    runs = {}
    for device in ("cpu", "gpu"):
        parts = build_parts(resolve("serial", cfg, B, 1), MPI.COMM_SELF, Numerics("float64", device), seed=3,
                            dropout=0.1)
        cuda_kernels.use(kernels == "on")
        opt, host = AdamW(parts.store), parts.backend.to_host
        rec = {"loss": [], "norm": [], "grads": []}
        for step, (x, y) in enumerate(batches, start=1):
            parts.store.zero_grad()
            rec["loss"].append(parts.model.forward(x, y, step=step))
            parts.model.backward()
            norm = global_grad_norm(parts.store, parts.layout.axes.tp)
            rec["norm"].append(norm)
            rec["grads"].append({n: np.array(host(g)) for n, g in parts.store.grad.items()})
            opt.step(1e-2, min(1.0, 1.0 / (norm + 1e-6)))
        rec["params"] = {n: np.array(host(d)) for n, d in parts.store.data.items()}
        runs[device] = rec
        print(f"{device}: losses {rec['loss']}, grad norms {rec['norm']}", flush=True)

    def rel(a, b):
        return float(np.abs(a - b).max() / max(float(np.abs(a).max()), 1e-300))

    cpu, gpu = runs["cpu"], runs["gpu"]
    worst = {
        "loss": max(rel(np.array(cpu["loss"]), np.array(gpu["loss"])), 0.0),
        "grad_norm": rel(np.array(cpu["norm"]), np.array(gpu["norm"])),
        "grads": max(rel(c[n], g[n]) for c, g in zip(cpu["grads"], gpu["grads"]) for n in c),
        "params_after_2_steps": max(rel(cpu["params"][n], gpu["params"][n]) for n in cpu["params"]),
    }
    print(f"largest relative differences (kernels {kernels}): {worst}", flush=True)
    return {"ok": all(v <= 1e-10 for v in worst.values()), "worst_relative": worst,
            "kernels": cuda_kernels.describe(), "loss_cpu": cpu["loss"], "loss_gpu": gpu["loss"]}


