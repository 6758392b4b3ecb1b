"""The device check: one prepared script for a session that is lent a GPU.

A lease is 15 minutes including the machine's start, so the check fits in
``--budget`` seconds (default 300) and is ordered by what matters most:
correctness first, then mpicube's speed, then PyTorch's. ``summary.json``
and ``gpu_check.log`` under ``$OUT`` (or ``--out DIR``) are rewritten after
every step, and the timing scripts write their JSON there as each
configuration finishes, so a run that is killed still leaves every figure
measured so far. Each step runs in its own process with a time limit; a
failing or hanging step is recorded and the next one runs.

  env          mpi4py.get_config(), the MPI library, CuPy / CUDA / driver
               versions, the device, whether MPI is CUDA-aware, mpiexec
  kernels      pytest tests/test_cuda_kernels.py -k gpu: every CUDA kernel
               against the array path on the GPU (the emulated half runs in CI)
  serial       float64, one process: the serial GPT on NumPy and on CuPy
               from the same seed, with dropout, 2 AdamW steps, to 1e-10;
               CUDA kernels off, then on
  parallel     mpiexec -n 8 tests/parallel_check.py 3d (2x2x2) on the one GPU
               against the serial CPU model, staged and, if this MPI says
               it is CUDA-aware, with MPICUBE_CUDA_AWARE=1; then 2d x dp 2
  resume       mpicube train --device gpu (dropout on): 6 steps straight
               against 3 + --resume 3, bit for bit; kernels off and on
  half         tests/parallel_check.py serial in float16 and bfloat16 on the
               GPU against the CPU in the same format (cuBLAS's 16-bit paths)
  perf         tools/gpu_perf.py --part mpicube: GPT-2 small float32 step
               time, TF32 off and on, kernels off and on, beside the same
               process's GEMM rate (random operands)
  mixed        tools/gpu_mixed.py --part mpicube: the 1.3B shape in float16
               and bfloat16 beside the 16-bit GEMM rate
  torch        both scripts with --part torch: PyTorch eager (autocast for
               16 bits) from the same weights; first losses must agree with
               mpicube's (relative 1e-4 in float32, 2e-2 in 16 bits) and are
               part of the verdict; over-PyTorch ratios are added
The CPU references run with MPICUBE_KERNELS=numpy (the serial step switches
numba off in-process), so numba never compiles a cache inside the lease.

On the device machine (the repository is copied there, the venv is not;
its image has CuPy, PyTorch, mpi4py, h5py, click, numba and pytest):

    python tools/gpu_check.py --budget 300       # everything, into $OUT
    python tools/gpu_check.py --only env,kernels --out /tmp/check
    python tools/gpu_check.py --dry-run --out /tmp/dry   # here, on CI's stand-in

``--dry-run`` runs every step on tests/fake_gpu (small shapes, no PyTorch,
GPU-only tests skipped) to check the script itself, in under 5 minutes.

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
STEPS = ("env", "kernels", "serial", "parallel", "resume", "half", "perf", "mixed", "torch")
CORRECTNESS = ("env", "kernels", "serial", "parallel", "resume", "half")
# the most seconds a step may take; while correctness steps run, PERF_RESERVE
# seconds are kept back for the GPT-2-small figure
CAPS = {"env": 30, "kernels": 60, "serial": 50, "parallel": 70, "resume": 60, "half": 50, "perf": 90,
        "mixed": 90, "torch": 120}
PERF_RESERVE = 45
FIRST_LOSS_RTOL = {"float32": 1e-4, "float16": 2e-2, "bfloat16": 2e-2}
DRY = {"on": False}                       # --dry-run: children see CI's CuPy stand-in


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
        steps = self.summary["steps"]
        self.summary["elapsed_s"] = round(time.time() - self.start, 1)
        # the verdict: no step failed (a step skipped, ok None, is listed apart), first losses included
        self.summary["ok"] = bool(steps) and all(s.get("ok") is not False for s in steps.values())
        self.summary["failed"] = sorted(k for k, s in steps.items() if s.get("ok") is False)
        self.summary["skipped"] = sorted(k for k, s in steps.items() if s.get("ok") is None)
        tmp = self.out / "summary.json.tmp"
        tmp.write_text(json.dumps(self.summary, indent=2, default=str) + "\n")
        tmp.replace(self.out / "summary.json")


def env_for(extra: dict | None = None) -> dict:
    """The environment of every child: this repository importable, output
    unbuffered, mpiexec allowed to run as root (Open MPI refuses otherwise)."""
    env = dict(os.environ)
    first = [str(ROOT / "tests" / "fake_gpu")] if DRY["on"] else []
    env["PYTHONPATH"] = os.pathsep.join(first + [str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
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


def worker(report: Report, name: str, timeout: float, args: list | None = None, script: Path = None,
           file: str | None = None) -> dict:
    """Run an in-process step (``--worker NAME`` of this script, or another
    script) in a child writing ``OUT/NAME.json`` as it goes (so a killed
    check keeps it); its JSON result, with ok False if it failed."""
    result_path = report.out / f"{file or name}.json"
    result_path.unlink(missing_ok=True)
    cmd = [sys.executable, str(script or Path(__file__))]
    cmd += ([] if script else ["--worker", name]) + ["--json", str(result_path)] + (args or [])
    status, output = run(report, cmd, timeout)
    try:
        result = json.loads(result_path.read_text()) if result_path.exists() else {}
    except ValueError:                     # killed while writing
        result = {}
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
    if DRY["on"]:
        return {"ok": None, "skipped": "dry run: needs a CUDA device (the emulated kernels run in CI)"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "tests/test_cuda_kernels.py",
           "-k", "gpu"]
    status, output = run(report, cmd, timeout)
    skipped_gpu = [line for line in output.splitlines()
                   if line.startswith("SKIPPED") and any(w in line for w in ("cupy", "CUDA device", "stand-in"))]
    last = next((line for line in reversed(output.splitlines()) if line.strip()), "")
    return {"ok": status == 0 and not skipped_gpu, "exit": status, "result": last.strip("= "),
            "gpu_tests_skipped": len(skipped_gpu), "skip_reasons": sorted(set(skipped_gpu))[:5]}


def step_serial(report, args, timeout):
    results = {}
    for kernels in ("off", "on"):
        results[f"kernels {kernels}"] = worker(report, "serial", timeout / 2, ["--kernels", kernels],
                                               file=f"serial-kernels-{kernels}")
    return verdict(results)


def verdict(results: dict) -> dict:
    """ok: every run ok (a run skipped in a dry run, ok None, does not count against it)."""
    oks = [r.get("ok") for r in results.values()]
    return {"ok": all(o is not False for o in oks) and any(o for o in oks), **results}


def check_run(report, cmd: list, timeout: float, extra: dict) -> dict:
    """A tests/parallel_check.py run: ok when it prints its OK line."""
    t0 = time.time()
    status, output = run(report, cmd, timeout, {"MPICUBE_KERNELS": "numpy", **extra})
    ok_line = next((line for line in output.splitlines() if line.startswith("OK ")), None)
    return {"ok": status == 0 and ok_line is not None, "exit": status, "seconds": round(time.time() - t0, 1),
            "result": ok_line or output[-1500:]}


def step_parallel(report, args, timeout, env_result):
    mpiexec = env_result.get("mpiexec") or find_mpiexec(args.mpiexec)
    if mpiexec is None:
        return {"ok": False, "error": "no mpiexec (carry the mpich wheel: see the docstring)"}
    aware = env_result.get("mpi_cuda_aware")
    cases = [("3d", "1", "staged", {})]
    if aware is True or DRY["on"]:          # the stand-in's memory is host memory: any MPI reads it
        cases.append(("3d", "1", "cuda-aware", {"MPICUBE_CUDA_AWARE": "1"}))
    else:
        report.log(f"CUDA-aware run skipped: the MPI says {aware!r} (True needed)")
    cases.append(("2d", "2", "staged", {}))
    runs, end = {}, time.time() + timeout
    for layout, dp, mode, mode_env in cases:
        left = end - time.time()
        if left < 15:
            runs[f"{layout} dp={dp} {mode}"] = {"ok": None, "skipped": "out of time"}
            continue
        runs[f"{layout} dp={dp} {mode}"] = check_run(
            report, [mpiexec, "-n", "8", sys.executable, "-m", "mpi4py", "tests/parallel_check.py", layout, dp, "1",
                     "0.1"], min(left, 60), {"MPICUBE_CHECK_DEVICE": "gpu", **mode_env})
    return {"aware_checked": aware is True, **verdict(runs)}


def step_half(report, args, timeout):
    runs, end = {}, time.time() + timeout
    for dtype in ("float16", "bfloat16"):
        left = end - time.time()
        if left < 10:
            runs[dtype] = {"ok": None, "skipped": "out of time"}
            continue
        runs[dtype] = check_run(report, [sys.executable, "-m", "mpi4py", "tests/parallel_check.py", "serial", "1",
                                         "1", "0.1"], min(left, 40),
                                {"MPICUBE_CHECK_DEVICE": "gpu", "MPICUBE_CHECK_DTYPE": dtype})
    return verdict(runs)


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
        for kernels in ("0",) if DRY["on"] else ("0", "1"):      # the stand-in runs no CUDA source
            name = f"kernels {'on' if kernels == '1' else 'off'}"
            straight, split = Path(tmp) / f"straight{kernels}", Path(tmp) / f"split{kernels}"
            statuses = []
            for extra in (["--out", straight], ["--out", split, "--stop-after", "3"], ["--out", split, "--resume"]):
                left = end - time.time()
                if left < 10:
                    statuses.append("out of time")
                    break
                statuses.append(run(report, base + extra, min(left, 40), {"MPICUBE_CUDA_KERNELS": kernels})[0])
                if statuses[-1] != 0:
                    break
            if statuses != [0, 0, 0]:
                results[name] = {"ok": False, "exits": statuses}
                continue
            a, b = metrics(straight / "metrics.jsonl"), metrics(split / "metrics.jsonl")
            equal = sorted(a) == list(range(1, 7)) and a == b
            results[name] = {"ok": equal, "straight": a, "resumed": b}
            report.log(f"resume, {name}: {'bit for bit' if equal else 'DIFFERS'}")
    return verdict(results)


def timing(report, args, timeout, script: str, part: str, file: str) -> dict:
    extra = ["--deadline", str(time.time() + timeout - 5), "--part", part]
    if DRY["on"]:
        extra.append("--dry")
    elif args.quick:
        extra.append("--quick")
    elif script == "gpu_perf.py":
        extra += ["--shapes", "gpt2-small"]         # the 1.3B shape in float32 does not fit the lease
    result = worker(report, file, timeout, extra, script=HERE / script)
    result.setdefault("ok", False)
    return result


def step_perf(report, args, timeout):
    return timing(report, args, timeout, "gpu_perf.py", "mpicube", "perf")


def step_mixed(report, args, timeout):
    return timing(report, args, timeout, "gpu_mixed.py", "mpicube", "mixed")


def first_losses(shapes: dict, dtype_of_entry) -> dict:
    """Per shape (and dtype): mpicube's and PyTorch's first loss and whether they agree."""
    found = {}
    for label, entry in shapes.items():
        for key, r in ([(label, entry)] if "mpicube_first_loss" in entry else
                       [(f"{label}/{d}", v) for d, v in entry.items() if isinstance(v, dict)]):
            if "mpicube_first_loss" in r and "torch_first_loss" in r:
                a, b = r["mpicube_first_loss"], r["torch_first_loss"]
                tol = FIRST_LOSS_RTOL[dtype_of_entry(key)]
                found[key] = {"mpicube": a, "torch": b, "agree": abs(a - b) <= tol * abs(b), "rtol": tol}
    return found


def merge(mine: dict, theirs: dict, script: str) -> None:
    """PyTorch's timings into mpicube's records of the same shapes, with the
    over-PyTorch ratios the scripts would compute in one process."""
    sys.path.insert(0, str(HERE))
    module = __import__(script[:-3])
    for label, entry in theirs.items():
        target = mine.get(label)
        if not isinstance(target, dict):
            continue
        pairs = [(target, entry)] if script == "gpu_perf.py" else [
            (target.get(d, {}), v) for d, v in entry.items() if isinstance(v, dict)]
        for t, e in pairs:
            for key in ("torch", "torch_autocast", "torch_first_loss"):
                if key in e:
                    t[key] = e[key]
            module.add_ratios(t)


def step_torch(report, args, timeout):
    """PyTorch's side of perf and mixed; merges the ratios into their
    records and judges the first losses."""
    if DRY["on"]:
        return {"ok": None, "skipped": "dry run: no PyTorch on the stand-in"}
    out, end = {}, time.time() + timeout
    for script, file, dtype_of_entry in (("gpu_perf.py", "perf", lambda k: "float32"),
                                         ("gpu_mixed.py", "mixed", lambda k: k.split("/")[-1])):
        left = end - time.time()
        if left < 20:
            out[file] = {"ok": None, "skipped": "out of time"}
            continue
        r = timing(report, args, min(left, timeout * 0.6), script, "torch", f"{file}-torch")
        merge(report.summary["steps"].get(file, {}).get("shapes", {}), r.get("shapes", {}), script)
        losses = first_losses(r.get("shapes", {}), dtype_of_entry)
        out[file] = {"ok": bool(losses) and all(v["agree"] for v in losses.values()), "first_losses": losses,
                     "torch": r.get("torch")}
        report.log(f"first losses, {file}: {losses}")
    return verdict(out)


# --- main -------------------------------------------------------------------------------
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="folder for summary.json and gpu_check.log (default $OUT, else ./gpu_check_out)")
    ap.add_argument("--only", default=",".join(STEPS), help=f"comma-separated steps of {','.join(STEPS)}")
    ap.add_argument("--budget", "--budget-s", dest="budget", type=float, default=300.0,
                    help="seconds for the whole check (default 300); no step starts past it")
    ap.add_argument("--mpiexec", help="the launcher for the 8-rank checks (default: beside python, else on PATH)")
    ap.add_argument("--quick", action="store_true", help="small perf shapes (a dry run of the script itself)")
    ap.add_argument("--dry-run", action="store_true", help="every step on CI's CuPy stand-in (tests/fake_gpu)")
    ap.add_argument("--worker", choices=("env", "serial"), help=argparse.SUPPRESS)
    ap.add_argument("--json", help=argparse.SUPPRESS)
    ap.add_argument("--kernels", choices=("off", "on"), default="off", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.worker:
        sys.path.insert(0, str(ROOT))
        sys.path.insert(0, str(HERE))
        try:
            import gpu_check_workers as w

            result = w.worker_env() if args.worker == "env" else w.worker_serial(args.kernels)
        except Exception as exc:
            traceback.print_exc()
            result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        Path(args.json).write_text(json.dumps(result, default=str))
        return 0

    only = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = sorted(set(only) - set(STEPS))
    if unknown:
        ap.error(f"unknown step(s) {', '.join(unknown)}; choose from {', '.join(STEPS)}")
    DRY["on"] = args.dry_run
    out = Path(args.out or os.environ.get("OUT") or "gpu_check_out")
    report = Report(out, args.budget)
    report.summary["dry_run"] = args.dry_run
    report.log(f"gpu_check: steps {', '.join(only)}; budget {args.budget:.0f} s; writing to {out}"
               + ("; DRY RUN on CI's CuPy stand-in" if args.dry_run else ""))
    env_result = {}
    chosen = [name for name in STEPS if name in only]
    for name in chosen:
        reserve = PERF_RESERVE if name in CORRECTNESS and "perf" in chosen else 0
        timeout = min(CAPS[name], report.remaining() - reserve)
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
        state = {True: "ok", False: "FAILED", None: "skipped"}[result.get("ok")]
        report.log(f"=== {name}: {state} in {result['seconds']} s")
    report.log(f"done in {time.time() - report.start:.0f} s: {'all ok' if report.summary['ok'] else 'NOT all ok'}")
    return 0 if report.summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
