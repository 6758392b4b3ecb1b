"""The device check: one prepared script for a session that is lent a GPU.

It records what a later session needs to judge mpicube's GPU path, in under
8 minutes (``--budget-s``, default 450 s), into ``summary.json`` and
``gpu_check.log`` under ``$OUT`` (or ``--out DIR``), printing as it goes.
Every step runs in its own process with a time limit, so a failing or
hanging step is recorded and the next one runs:

  env       mpi4py.get_config(), the MPI library, CuPy / CUDA / driver
            versions, the device, whether MPI is CUDA-aware, mpiexec
  kernels   pytest -q tests/test_cuda_kernels.py: the CUDA kernels against
            the array path on the GPU (and emulated on the CPU)
  serial    float64, one process: the serial GPT on NumPy and on CuPy from
            the same seed, with dropout; losses, gradients and norms of 2
            AdamW steps and the parameters after them agree to 1e-10;
            CUDA kernels off, then on
  parallel  mpiexec -n 8 python -m mpi4py tests/parallel_check.py for 3d
            (2x2x2) and 2d (dp 2 x 2x2), the layout on the one GPU and the
            serial reference on the CPU (MPICUBE_CHECK_DEVICE=gpu), staged
            and, if this MPI says it is CUDA-aware, with MPICUBE_CUDA_AWARE=1;
            kernels off and on
  resume    mpicube train --device gpu --dtype float32 (dropout on): 6
            steps straight against 3 + --resume 3, losses and gradient
            norms bit for bit; kernels off and on
  perf      tools/gpu_perf.py: float32 step time of GPT-2 small and of a
            1.3B shape, with and without TF32, kernels off and on, beside
            PyTorch eager with the same weights, as ms, TFLOP/s, ratios and
            the fraction of a large same-process GEMM
  mixed     tools/gpu_mixed.py: the 1.3B shape in float16 with loss
            scaling (and bfloat16 if CuPy has it) beside PyTorch eager
            autocast, same weights; against the 16-bit GEMM rate

On the device machine (the repository is copied there, the venv is not;
its image has CuPy, PyTorch, mpi4py, h5py, click, numba and pytest):

    python tools/gpu_check.py                    # everything, into $OUT
    python tools/gpu_check.py --only env,kernels --out /tmp/check

If the image's mpi4py finds no MPI library, or there is no mpiexec, carry
the MPICH wheel: here ``.venv/bin/pip download --no-deps --only-binary=:all:
-d wheels mpich`` (wheels/ is not ignored, so it travels), and there first
``pip install --no-index --no-deps wheels/mpich-*.whl``; its mpiexec lands
next to python, where this script looks first. The env step says which
MPI it found.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
STEPS = ("env", "kernels", "serial", "parallel", "resume", "perf", "mixed")
# seconds a step may take at most, and the least it needs (kept back while earlier steps run)
CAPS = {"env": 60, "kernels": 150, "serial": 120, "parallel": 170, "resume": 90, "perf": 400, "mixed": 240}
NEEDS = {"env": 10, "kernels": 40, "serial": 40, "parallel": 60, "resume": 40, "perf": 150, "mixed": 90}


class Report:
    """The log (printed and written line by line) and the JSON summary,
    rewritten after every step so that a run cut short still leaves one."""

    def __init__(self, out: Path, budget_s: float):
        out.mkdir(parents=True, exist_ok=True)
        self.out = out
        self.log_file = open(out / "gpu_check.log", "a", buffering=1)
        self.lock = threading.Lock()
        self.start = time.time()
        self.end = self.start + budget_s
        self.summary = {"started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                        "budget_s": budget_s, "argv": sys.argv[1:], "steps": {}}

    def log(self, line: str = "") -> None:
        stamped = f"[{time.time() - self.start:6.1f}s] {line}"
        with self.lock:
            print(stamped, flush=True)
            self.log_file.write(stamped + "\n")

    def remaining(self) -> float:
        return self.end - time.time()

    def save(self) -> None:
        steps = self.summary["steps"].values()
        self.summary["elapsed_s"] = round(time.time() - self.start, 1)
        self.summary["ok"] = bool(steps) and all(s.get("ok") for s in steps)
        tmp = self.out / "summary.json.tmp"
        tmp.write_text(json.dumps(self.summary, indent=2, default=str) + "\n")
        tmp.replace(self.out / "summary.json")


def env_for(extra: dict | None = None) -> dict:
    """The environment of every child: this repository importable, output
    unbuffered, mpiexec allowed to run as root (Open MPI refuses otherwise)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    env.update({"PYTHONUNBUFFERED": "1", "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"})
    env.update(extra or {})
    return env


def run(report: Report, cmd: list, timeout: float, extra_env: dict | None = None, cwd=None) -> tuple:
    """Run ``cmd`` in its own process group, logging its output as it comes;
    kill the whole group at ``timeout``. Returns (exit status or "timeout", output)."""
    report.log("$ " + " ".join(str(c) for c in cmd))
    env = env_for(extra_env)
    if "MPIEXEC_TIMEOUT" not in env:
        env["MPIEXEC_TIMEOUT"] = str(max(5, int(timeout)))
    proc = subprocess.Popen([str(c) for c in cmd], cwd=str(cwd or ROOT), env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, bufsize=1, start_new_session=True)
    lines = []

    def pump():
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            report.log("  | " + lines[-1])

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        status = proc.wait(timeout=max(1.0, timeout))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        status = "timeout"
        report.log(f"  killed after {timeout:.0f} s")
    reader.join(timeout=5)
    return status, "\n".join(lines)


def worker(report: Report, name: str, timeout: float, args: list | None = None, script: Path = None) -> dict:
    """Run an in-process step (``--worker NAME`` of this script, or another
    script) in a child; its JSON result, with ok False if it failed."""
    with tempfile.TemporaryDirectory() as tmp:
        result_path = Path(tmp) / "result.json"
        cmd = [sys.executable, str(script or Path(__file__))]
        cmd += ([] if script else ["--worker", name]) + ["--json", str(result_path)] + (args or [])
        status, output = run(report, cmd, timeout)
        result = json.loads(result_path.read_text()) if result_path.exists() else {}
    if status != 0:
        result.update(ok=False, exit=status, tail=output[-2000:])
    return result


# --- steps, in the driver ------------------------------------------------------------
def find_mpiexec(given: str | None) -> str | None:
    if given:
        return given
    beside = Path(sys.executable).parent / "mpiexec"
    return str(beside) if beside.exists() else shutil.which("mpiexec")


def step_env(report, args, timeout):
    result = worker(report, "env", timeout)
    result["mpiexec"] = find_mpiexec(args.mpiexec)
    if result["mpiexec"] is None:
        report.log("no mpiexec: the 8-rank checks cannot run (carry the mpich wheel, see this script's docstring)")
    result.setdefault("ok", True)
    return result


def step_kernels(report, args, timeout):
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "tests/test_cuda_kernels.py"]
    status, output = run(report, cmd, timeout)
    skipped_gpu = [line for line in output.splitlines()
                   if line.startswith("SKIPPED") and any(w in line for w in ("cupy", "CUDA device", "stand-in"))]
    last = next((line for line in reversed(output.splitlines()) if line.strip()), "")
    return {"ok": status == 0 and not skipped_gpu, "exit": status, "result": last.strip("= "),
            "gpu_tests_skipped": len(skipped_gpu), "skip_reasons": sorted(set(skipped_gpu))[:5]}


def step_serial(report, args, timeout):
    results = {}
    for kernels in ("off", "on"):
        results[f"kernels {kernels}"] = worker(report, "serial", timeout / 2, ["--kernels", kernels])
    return {"ok": all(r.get("ok") for r in results.values()), **results}


def step_parallel(report, args, timeout, env_result):
    mpiexec = env_result.get("mpiexec") or find_mpiexec(args.mpiexec)
    if mpiexec is None:
        return {"ok": False, "error": "no mpiexec (carry the mpich wheel: see the docstring)"}
    modes = [("staged", {})]
    aware = env_result.get("mpi_cuda_aware")
    if aware is True:
        modes.append(("cuda-aware", {"MPICUBE_CUDA_AWARE": "1"}))
    else:
        report.log(f"CUDA-aware runs skipped: the MPI says {aware!r} (True needed)")
    runs, end = {}, time.time() + timeout
    for layout, dp, depth in (("3d", "1", "1"), ("2d", "2", "1")):
        for mode, mode_env in modes:
            for kernels in ("0", "1"):
                name = f"{layout} dp={dp} {mode} kernels={'on' if kernels == '1' else 'off'}"
                left = end - time.time()
                if left < 20:
                    runs[name] = {"ok": False, "error": "skipped: out of time"}
                    continue
                extra = {"MPICUBE_CHECK_DEVICE": "gpu", "MPICUBE_CUDA_KERNELS": kernels, **mode_env}
                t0 = time.time()
                status, output = run(report, [mpiexec, "-n", "8", sys.executable, "-m", "mpi4py",
                                              "tests/parallel_check.py", layout, dp, depth, "0.1"],
                                     min(left, 90), extra)
                ok_line = next((line for line in output.splitlines() if line.startswith("OK ")), None)
                runs[name] = {"ok": status == 0 and ok_line is not None, "exit": status, "seconds": round(time.time() - t0, 1),
                              "result": ok_line or output[-1500:]}
    return {"ok": all(r["ok"] for r in runs.values()), "aware_checked": aware is True, "runs": runs}


def metrics(path: Path) -> dict:
    """{step: (loss, grad_norm)} from metrics.jsonl, the last line of each step winning."""
    found = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if "loss" in record and "step" in record:
            found[record["step"]] = (record["loss"], record.get("grad_norm"))
    return found


def step_resume(report, args, timeout):
    base = [sys.executable, "-m", "mpicube", "train", "--device", "gpu", "--dtype", "float32", "--n-layer", "2",
            "--n-head", "4", "--n-embd", "64", "--seq-len", "32", "--batch-size", "4", "--steps", "6",
            "--dropout", "0.1", "--warmup", "2", "--lr", "1e-3", "--log-every", "1"]
    results, end = {}, time.time() + timeout
    with tempfile.TemporaryDirectory() as tmp:
        for kernels in ("0", "1"):
            name = f"kernels {'on' if kernels == '1' else 'off'}"
            straight, split = Path(tmp) / f"straight{kernels}", Path(tmp) / f"split{kernels}"
            statuses = []
            for extra in (["--out", straight], ["--out", split, "--stop-after", "3"], ["--out", split, "--resume"]):
                left = end - time.time()
                if left < 10:
                    statuses.append("out of time")
                    break
                statuses.append(run(report, base + extra, min(left, 60), {"MPICUBE_CUDA_KERNELS": kernels})[0])
                if statuses[-1] != 0:
                    break
            if statuses != [0, 0, 0]:
                results[name] = {"ok": False, "exits": statuses}
                continue
            a, b = metrics(straight / "metrics.jsonl"), metrics(split / "metrics.jsonl")
            equal = sorted(a) == list(range(1, 7)) and a == b
            results[name] = {"ok": equal, "straight": a, "resumed": b}
            report.log(f"resume, {name}: {'bit for bit' if equal else 'DIFFERS'}")
    return {"ok": all(r["ok"] for r in results.values()), **results}


def step_mixed(report, args, timeout):
    """tools/gpu_mixed.py: the 1.3B shape in float16 (and bfloat16 where CuPy
    has it) beside PyTorch autocast, against the 16-bit GEMM rate."""
    extra = ["--deadline", str(time.time() + timeout - 10)] + (["--quick"] if args.quick else [])
    result = worker(report, "mixed", timeout, extra, script=HERE / "gpu_mixed.py")
    result.setdefault("ok", False)
    return result


def step_perf(report, args, timeout):
    extra = ["--deadline", str(time.time() + timeout - 10)] + (["--quick"] if args.quick else [])
    result = worker(report, "perf", timeout, extra, script=HERE / "gpu_perf.py")
    result.setdefault("ok", False)
    return result


# --- in-process workers (run in children) -----------------------------------------------
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
    info["ok"] = not str(info.get("cuda", "unavailable")).startswith("unavailable")
    return info


def worker_serial(kernels: str) -> dict:
    """float64 serial GPT, NumPy against CuPy: 2 steps with dropout."""
    import numpy as np
    from mpi4py import MPI

    from mpicube.device import cuda_kernels
    from mpicube.core.config import ModelConfig
    from mpicube.training.optim import AdamW
    from mpicube.parallel.gradients import global_grad_norm
    from mpicube.training.train import build_parts

    if kernels == "on" and not cuda_kernels.available():
        return {"ok": False, "error": "CUDA kernels unavailable (cuda_kernels.available() is False)"}
    # GELU's (B T, 4h) = (512, 512) and the softmax's rows exceed every CPU cache block
    cfg = ModelConfig(vocab_size=256, n_ctx=64, n_layer=2, n_head=4, n_embd=128)
    B = 8
    gen = np.random.default_rng(0)
    batches = [(gen.integers(0, 256, (B, 64)), gen.integers(0, 256, (B, 64))) for _ in range(2)]
    runs = {}
    for device in ("cpu", "gpu"):
        parts = build_parts(cfg, "serial", B, MPI.COMM_SELF, dtype="float64", device=device, seed=3, dropout=0.1)
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


# --- main -------------------------------------------------------------------------------
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="folder for summary.json and gpu_check.log (default $OUT, else ./gpu_check_out)")
    ap.add_argument("--only", default=",".join(STEPS), help=f"comma-separated steps of {','.join(STEPS)}")
    ap.add_argument("--budget-s", type=float, default=450.0, help="stop starting work after this many seconds")
    ap.add_argument("--mpiexec", help="the launcher for the 8-rank checks (default: beside python, else on PATH)")
    ap.add_argument("--quick", action="store_true", help="small perf shapes (a dry run of the script itself)")
    ap.add_argument("--worker", choices=("env", "serial"), help=argparse.SUPPRESS)
    ap.add_argument("--json", help=argparse.SUPPRESS)
    ap.add_argument("--kernels", choices=("off", "on"), default="off", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.worker:
        sys.path.insert(0, str(ROOT))
        try:
            result = worker_env() if args.worker == "env" else worker_serial(args.kernels)
        except Exception as exc:
            traceback.print_exc()
            result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        Path(args.json).write_text(json.dumps(result, default=str))
        return 0

    only = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = sorted(set(only) - set(STEPS))
    if unknown:
        ap.error(f"unknown step(s) {', '.join(unknown)}; choose from {', '.join(STEPS)}")
    out = Path(args.out or os.environ.get("OUT") or "gpu_check_out")
    report = Report(out, args.budget_s)
    report.log(f"gpu_check: steps {', '.join(only)}; budget {args.budget_s:.0f} s; writing to {out}")
    env_result = {}
    chosen = [name for name in STEPS if name in only]
    for k, name in enumerate(chosen):
        timeout = min(CAPS[name], report.remaining() - sum(NEEDS[later] for later in chosen[k + 1:]))
        report.log(f"=== {name} (up to {max(timeout, 0):.0f} s)")
        t0 = time.time()
        if timeout < 5:
            result = {"ok": False, "error": "skipped: out of time"}
        else:
            try:
                if name == "parallel":
                    result = step_parallel(report, args, timeout, env_result)
                else:
                    result = globals()[f"step_{name}"](report, args, timeout)
            except Exception as exc:  # a broken step must not stop the others
                report.log(traceback.format_exc())
                result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        result["seconds"] = round(time.time() - t0, 1)
        if name == "env":
            env_result = result
        report.summary["steps"][name] = result
        report.save()
        report.log(f"=== {name}: {'ok' if result.get('ok') else 'FAILED'} in {result['seconds']} s")
    report.log(f"done in {time.time() - report.start:.0f} s: {'all ok' if report.summary['ok'] else 'some steps failed'}")
    return 0 if report.summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
