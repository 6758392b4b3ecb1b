"""float32 training-step time on one GPU: mpicube beside PyTorch eager.

For GPT-2 small (12 layers, 768 wide, 12 heads, T 1024, B 8, vocabulary
50304) and a 1.3B shape (24 layers, 2048 wide, 16 heads, T 1024, B 4):
mpicube's serial model on CuPy with TF32 off and on, with its CUDA kernels
off and on, and a PyTorch model of the same GPT-2 from the same weights on
the same batch, with attention written out (the computation mpicube does)
and through scaled_dot_product_attention (flash attention), TF32 off and
on. One step is forward, backward, gradient norm and AdamW, ended by a
device synchronisation; 3 warm-up steps, then the median of 5.

Reported per configuration: ms per step, model TFLOP/s
(mpicube.analysis.bench.model_flops), the fraction of a large same-process GEMM
(mpicube.analysis.bench.gemm_rate, 8192^3, same TF32 setting), and mpicube's time
over PyTorch's. The first losses of both models from the shared weights
are recorded beside each other: they must agree, or the comparison is not
of the same computation (tools/gpu_check.py makes that part of its
verdict). mpicube is timed first, PyTorch after it, and ``--part`` runs
one side alone (gpu_check times all of mpicube before any PyTorch, so a
deadline costs PyTorch's figures, not mpicube's); each configuration's
result is saved as soon as it is measured.

The weights are drawn on the device (CuPy's generator, GPT-2's scales), not
by mpicube's host-side counter hash, which needs minutes for 1.3B
parameters; the timing does not depend on the values.

Run by tools/gpu_check.py (its ``perf`` step), or alone:
    python tools/gpu_perf.py --json perf.json [--quick]
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from mpicube.core.config import ModelConfig  # noqa: E402

SHAPES = {
    "gpt2-small": (ModelConfig(vocab_size=50304, n_ctx=1024, n_layer=12, n_head=12, n_embd=768), 8),
    "1.3b": (ModelConfig(vocab_size=50304, n_ctx=1024, n_layer=24, n_head=16, n_embd=2048), 4),
}
QUICK = {  # --quick: the same code on shapes any device holds in seconds
    "tiny": (ModelConfig(vocab_size=512, n_ctx=128, n_layer=2, n_head=4, n_embd=128), 4),
}
WARMUP, TIMED = 3, 5
GEMM = 8192             # the large GEMM's m = k = n (--quick: 512)
PART = "both"           # --part: which side this process times
ONLY_SHAPES = None      # --shapes: the labels to run (None: all)


def log(line: str) -> None:
    print(line, flush=True)


# --- mpicube ------------------------------------------------------------------------
def build_mpicube(cfg, batch: int, seed: int = 0):
    """Serial parts on the GPU in float32, weights drawn on the device."""
    from mpi4py import MPI

    from mpicube.device.backend import make_backend
    from mpicube.parallel.comm import Counters
    from mpicube.parallel.grid import build_layout
    from mpicube.parallel.planning import resolve
    from mpicube.model.gpt import gpt_params
    from mpicube.training.driver import make_runner
    from mpicube.parallel.params import ParamStore
    from mpicube.parallel.paramspec import real_mask

    class DeviceInitStore(ParamStore):
        """GPT-2's initial scales (N(0, std), ones, zeros) from CuPy's
        generator; falls back to mpicube's own init where the array module
        has none (CI's stand-in)."""

        def initialize(self, seed_):
            xp = self.backend.xp
            if not hasattr(getattr(xp, "random", None), "standard_normal"):
                return super().initialize(seed_)
            xp.random.seed(seed_)
            for spec in self.specs:
                block = self.data[spec.name]
                if spec.decl.init == "normal":
                    block[...] = xp.random.standard_normal(block.shape, dtype=block.dtype) * spec.decl.std
                    block *= xp.asarray(real_mask(spec), dtype=block.dtype)     # vocabulary padding stays 0
                else:
                    block[...] = 1.0 if spec.decl.init == "ones" else 0.0

    backend = make_backend("gpu", "float32", MPI.COMM_SELF)
    layout = build_layout(resolve("serial", cfg, batch, 1), backend, MPI.COMM_SELF, counters=Counters())
    store = DeviceInitStore([layout.shard(d) for d in gpt_params(cfg)], backend, seed)
    return backend, layout, store, make_runner(cfg, layout, store, dropout=0.0, seed=seed)


def time_steps(step, sync, deadline: float) -> dict:
    """Median and spread of TIMED calls of ``step`` after WARMUP ones."""
    times = []
    for i in range(WARMUP + TIMED):
        if time.time() > deadline:
            raise TimeoutError("out of time")
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        if i >= WARMUP:
            times.append(time.perf_counter() - t0)
    return {"ms": 1e3 * float(np.median(times)), "min_ms": 1e3 * min(times), "max_ms": 1e3 * max(times)}


# --- PyTorch ------------------------------------------------------------------------
def torch_model(torch, cfg, weights: dict, sdpa: bool):
    """GPT-2 in plain torch ops (as tools/compare_torch.py's, on the device),
    attention written out or, with ``.sdpa`` set, through
    scaled_dot_product_attention (read at each call)."""
    F = torch.nn.functional

    class TorchGPT(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.sdpa = sdpa
            self.p = torch.nn.ParameterDict({k.replace(".", "_"): torch.nn.Parameter(v) for k, v in weights.items()})
            T = cfg.n_ctx
            self.register_buffer("upper", torch.ones(T, T, dtype=torch.bool, device="cuda").triu(1), persistent=False)

        def w(self, name):
            return self.p[name.replace(".", "_")]

        def forward(self, idx, targets):
            w, (B, T), h, nh = self.w, idx.shape, cfg.n_embd, cfg.n_head
            x = w("wte")[idx] + w("wpe")[:T]                                   # (B, T, h)
            for i in range(cfg.n_layer):
                p = f"h.{i}."
                a = F.layer_norm(x, (h,), w(p + "ln_1.weight"), w(p + "ln_1.bias"), 1e-5)
                qkv = a @ w(p + "attn.c_attn.weight") + w(p + "attn.c_attn.bias")   # (B, T, 3h)
                q, k, v = qkv.view(B, T, 3, nh, h // nh).permute(2, 0, 3, 1, 4)      # (B, nh, T, hd) each
                if self.sdpa:
                    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                else:
                    scores = (q @ k.transpose(-1, -2)) / math.sqrt(h // nh)          # (B, nh, T, T)
                    y = scores.masked_fill(self.upper[:T, :T], float("-inf")).softmax(-1) @ v
                y = y.transpose(1, 2).reshape(B, T, h)
                x = x + y @ w(p + "attn.c_proj.weight") + w(p + "attn.c_proj.bias")
                a = F.layer_norm(x, (h,), w(p + "ln_2.weight"), w(p + "ln_2.bias"), 1e-5)
                f = F.gelu(a @ w(p + "mlp.c_fc.weight") + w(p + "mlp.c_fc.bias"), approximate="tanh")
                x = x + f @ w(p + "mlp.c_proj.weight") + w(p + "mlp.c_proj.bias")
            x = F.layer_norm(x, (h,), w("ln_f.weight"), w("ln_f.bias"), 1e-5)
            logits = x @ w("wte").T                                            # (B, T, V)
            return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))

    return TorchGPT()


def set_torch_tf32(torch, enabled: bool) -> None:
    torch.set_float32_matmul_precision("high" if enabled else "highest")
    torch.backends.cudnn.allow_tf32 = enabled


# --- one shape ----------------------------------------------------------------------
def memory_needed(cfg, batch: int) -> float:
    """Bytes the run holds at its peak, roughly: mpicube's parameters,
    gradients and saved activations beside PyTorch's whole training state."""
    from mpicube.analysis.costmodel import Problem
    from mpicube.analysis.costmemory import step_memory

    mem = step_memory(Problem(cfg, "serial", 1, 1, 1, batch, cfg.n_ctx))
    params = cfg.n_params()
    return 4.0 * (2 * params + mem.activations) + 4.0 * (4 * params + 1.5 * mem.activations)


def run_shape(label: str, cfg, batch: int, deadline: float, torch, out: dict, save) -> None:
    """Fill ``out`` with the figures of one shape, calling ``save()`` after
    each configuration (the parent may have to stop this process)."""
    import cupy

    from mpicube.analysis.bench import model_flops

    T = cfg.n_ctx
    flops = model_flops(cfg, batch, T)
    out.update(batch=batch, seq_len=T, params=cfg.n_params(), model_flops_per_step=flops)
    mem_info = getattr(cupy.cuda.Device(), "mem_info", None)          # (free, total); CI's stand-in has none
    free = mem_info[0] if mem_info else float("inf")
    need = memory_needed(cfg, batch)
    out["memory_needed_gib"] = round(need / 2 ** 30, 1)
    out["memory_free_gib"] = round(free / 2 ** 30, 1) if mem_info else None
    if need > 0.9 * free:
        raise MemoryError(f"needs about {need / 2 ** 30:.0f} GiB, {free / 2 ** 30:.0f} GiB free")

    backend, layout, store, model = build_mpicube(cfg, batch)
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (batch, T + 1))
    x, y = np.ascontiguousarray(tokens[:, :-1]), np.ascontiguousarray(tokens[:, 1:])   # (B, T)
    out["mpicube_first_loss"] = model.forward(x, y, step=1)
    if PART != "torch":                          # mpicube first: a deadline then costs PyTorch's figures
        time_mpicube(label, cfg, batch, deadline, out, save, backend, layout, store, model, x, y, flops)
    if torch is not None and PART != "mpicube":
        time_torch(label, cfg, deadline, torch, out, save, store, x, y, flops)
        gc.collect()                             # its model and optimizer went with the call
        torch.cuda.empty_cache()
    add_ratios(out)
    save()


def time_mpicube(label, cfg, batch, deadline, out, save, backend, layout, store, model, x, y, flops) -> None:
    import cupy

    from mpicube.analysis.bench import gemm_rate
    from mpicube.device import cuda_kernels
    from mpicube.device.backend import set_tf32
    from mpicube.parallel.gradients import global_grad_norm
    from mpicube.training.optim import AdamW

    opt, sync = AdamW(store), backend.synchronize

    def mpicube_step():
        store.zero_grad()
        model.forward(x, y, step=1)
        model.backward()
        norm = global_grad_norm(store, layout.axes.tp)
        opt.step(1e-4, min(1.0, 1.0 / (norm + 1e-6)))

    out["mpicube"], out["gemm_rate_tflops"] = {}, {}
    for tf32 in (False, True):
        set_tf32(cupy, tf32)
        mode = "tf32" if tf32 else "fp32"
        if time.time() > deadline:
            raise TimeoutError("out of time")
        rate = gemm_rate(backend, GEMM, GEMM, GEMM)
        out["gemm_rate_tflops"][mode] = rate / 1e12
        for kernels in (False, True):
            key = f"{mode}/{'kernels' if kernels else 'array'}"
            if kernels and not cuda_kernels.available():
                out["mpicube"][key] = {"error": "CUDA kernels unavailable"}
                continue
            cuda_kernels.use(kernels)
            try:
                r = time_steps(mpicube_step, sync, deadline)
            except Exception as exc:
                out["mpicube"][key] = {"error": f"{type(exc).__name__}: {exc}"}
                continue
            r["tflops"] = flops / (r["ms"] / 1e3) / 1e12
            r["gemm_fraction"] = r["tflops"] * 1e12 / rate
            r["kernels"] = cuda_kernels.describe()
            out["mpicube"][key] = r
            save()
            log(f"{label} mpicube {key}: {r['ms']:.1f} ms/step, {r['tflops']:.1f} TFLOP/s, "
                f"{100 * r['gemm_fraction']:.0f}% of the {mode} GEMM rate ({rate / 1e12:.1f} TFLOP/s)")
    set_tf32(cupy, False)
    cuda_kernels.use(False)


def time_torch(label, cfg, deadline, torch, out, save, store, x, y, flops) -> None:
    """PyTorch eager from mpicube's weights: the first loss (no grad), then
    each TF32 x attention configuration timed."""
    store.backend.synchronize()
    V = cfg.vocab_size
    weights = {n: torch.from_dlpack(d[:V] if n == "wte" else d).clone() for n, d in store.data.items()}
    tmodel = torch_model(torch, cfg, weights, sdpa=False)
    idx, tgt = torch.as_tensor(x, device="cuda"), torch.as_tensor(y, device="cuda")
    set_torch_tf32(torch, False)
    with torch.no_grad():
        out["torch_first_loss"] = float(tmodel(idx, tgt))
    log(f"{label}: first loss mpicube {out['mpicube_first_loss']:.6f}, torch {out['torch_first_loss']:.6f}")
    save()
    topt = torch.optim.AdamW(tmodel.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)

    def torch_step():
        topt.zero_grad(set_to_none=True)
        tmodel(idx, tgt).backward()
        torch.nn.utils.clip_grad_norm_(tmodel.parameters(), 1.0)
        topt.step()

    out["torch"] = {}
    for tf32 in (False, True):
        set_torch_tf32(torch, tf32)
        for sdpa in (False, True):
            key = f"{'tf32' if tf32 else 'fp32'}/{'sdpa' if sdpa else 'math'}"
            tmodel.sdpa = sdpa
            try:
                r = time_steps(torch_step, torch.cuda.synchronize, deadline)
            except Exception as exc:   # out of time or memory: keep what was measured
                out["torch"][key] = {"error": f"{type(exc).__name__}: {exc}"}
                continue
            r["tflops"] = flops / (r["ms"] / 1e3) / 1e12
            out["torch"][key] = r
            save()
            log(f"{label} torch {key}: {r['ms']:.1f} ms/step, {r['tflops']:.1f} TFLOP/s")
    set_torch_tf32(torch, False)


def add_ratios(out: dict) -> None:
    """mpicube's time over PyTorch's, per TF32 setting and attention kind,
    where both were measured (also on results merged from two processes)."""
    for key, r in out.get("mpicube", {}).items():
        for tkey, t in out.get("torch", {}).items():
            if tkey.split("/")[0] == key.split("/")[0] and "ms" in r and "ms" in t:
                r[f"over_torch_{tkey.split('/')[1]}"] = r["ms"] / t["ms"]


def torch_on_device(results: dict):
    """PyTorch if it sees a CUDA device, else None; ``results["torch"]``
    says which (mpicube's own figures are worth having either way)."""
    try:
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("torch sees no CUDA device")
        results["torch"] = torch.__version__
        return torch
    except Exception as exc:
        results["torch"] = f"unavailable: {type(exc).__name__}: {exc}"
        log(f"PyTorch {results['torch']}")
        return None


def release_device_memory() -> None:
    """Hand the last shape's arrays back to the device before the next one."""
    gc.collect()
    try:
        import cupy

        cupy.get_default_memory_pool().free_all_blocks()
    except Exception:
        pass


def run_checks(doc: str, seconds: float, quick_gemm: int, cases, argv=None) -> tuple:
    """The command line both device scripts share: ``--json`` (where the
    results go, rewritten after every case so a timeout keeps what ran),
    ``--quick`` and ``--deadline``. ``cases(quick, torch, deadline, results,
    save)`` yields (label, dict to fill, function filling it); a case that
    raises records its error and the next one runs. Returns (results, save)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--json", required=True, help="where to write the results")
    ap.add_argument("--quick", action="store_true", help="a tiny shape instead (checks the script, not the GPU)")
    ap.add_argument("--deadline", type=float, default=time.time() + seconds, help="epoch seconds to stop by")
    ap.add_argument("--part", choices=("both", "mpicube", "torch"), default="both",
                    help="time mpicube, PyTorch (from mpicube's weights, with the first losses) or both")
    ap.add_argument("--shapes", help="comma-separated shape labels to run (default: all)")
    ap.add_argument("--dry", action="store_true", help="--quick with 1 warm-up and 2 timed steps (CI's stand-in)")
    args = ap.parse_args(argv)
    global GEMM, PART, ONLY_SHAPES, WARMUP, TIMED
    PART, ONLY_SHAPES = args.part, None if not args.shapes else set(args.shapes.split(","))
    args.quick = args.quick or args.dry
    if args.dry:
        WARMUP, TIMED = 1, 2
    if args.quick:
        GEMM = quick_gemm
    results = {"ok": False, "shapes": {}}

    def save():
        Path(args.json).write_text(json.dumps(results, indent=2, default=str))

    torch = torch_on_device(results) if args.part != "mpicube" else None
    for label, out, fill in cases(args.quick, torch, args.deadline, results, save):
        try:
            fill()
        except Exception as exc:
            traceback.print_exc()
            out["error"] = f"{type(exc).__name__}: {exc}"
        finally:
            release_device_memory()
        save()
    return results, save


def main(argv=None) -> int:
    def cases(quick, torch, deadline, results, save):
        for label, (cfg, batch) in (QUICK if quick else SHAPES).items():
            if ONLY_SHAPES is not None and label not in ONLY_SHAPES and not quick:
                continue
            out = results["shapes"][label] = {}
            yield label, out, lambda: run_shape(label, cfg, batch, deadline, torch, out, save)

    results, save = run_checks(__doc__, 400, 512, cases, argv)
    shapes = results["shapes"].values()
    import cupy

    # the stand-in (a dry run) has no CUDA kernels; on a GPU every configuration must have run
    excused = {"CUDA kernels unavailable"} if getattr(cupy, "_mpicube_host_memory", False) else set()
    results["ok"] = bool(shapes) and all(
        "error" not in s and (PART == "torch" or all("ms" in r or r.get("error") in excused
                                                     for r in s.get("mpicube", {}).values()))
        for s in shapes)
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
