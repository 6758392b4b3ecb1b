"""Submitting the scripts of jobs/ to the test Slurm (tools/slurm_cluster.py)
and watching them: a job's state as Slurm reports it, its log, its training
metrics, and its ranks.

Every wait here is on a state (a job state, a line in the log, a signal
pending on a process), with a deadline, never a fixed sleep: the tests run
on 2 shared cores where a step may take 3 ms or 40 ms.

Preemption tests need the signal to land while training is still going. Slurm
sends --signal at its 30-second checks, and a tiny run can finish first, so a
test holds the ranks still (SIGSTOP) until the stop request is pending on
every one of them (/proc/PID/status), then lets them go on (SIGCONT): the
request then takes effect at the next step boundary, as it would in a long
run.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import slurm_cluster  # noqa: E402

# Job states after which nothing more happens to a job (while it is being
# requeued it passes through REQUEUED and PENDING instead).
FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
         "DEADLINE", "PREEMPTED"}


def wait_for(ready, timeout: float, what: str, detail=lambda: ""):
    """Poll ``ready()`` until it returns something true; its value."""
    deadline = time.monotonic() + timeout
    while True:
        value = ready()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}\n{detail()}")
        time.sleep(0.1)


class Job:
    """One sbatch job of the test cluster."""

    def __init__(self, cluster: slurm_cluster.Cluster, job_id: str, submit_dir: Path, run_dir: Path, ntasks: int):
        self.cluster, self.id, self.submit_dir, self.run_dir, self.ntasks = cluster, job_id, submit_dir, run_dir, ntasks

    # --- what Slurm says -------------------------------------------------------
    def fields(self) -> dict:
        """`scontrol show job` as a dict (JobState, ExitCode, Restarts, ...)."""
        out = self.cluster.run("scontrol", "show", "job", "-o", self.id).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def state(self) -> str:
        return self.fields().get("JobState", "?")

    def wait_end(self, timeout: float = 300) -> dict:
        """Wait until the job has finished for good; its fields."""
        wait_for(lambda: self.state() in FINAL, timeout, f"job {self.id} to finish", self.report)
        return self.fields()

    def cancel(self) -> None:
        self.cluster.run("scancel", "--full", self.id, check=False)

    def signal(self, *options: str) -> None:
        """`scancel --signal=USR1 [options] JOBID`."""
        self.cluster.run("scancel", "--signal=USR1", *options, self.id)

    # --- what the job wrote ----------------------------------------------------
    def log(self) -> str:
        """The job's output file (%x-%j.out in the submission folder, appended across restarts)."""
        files = list(self.submit_dir.glob(f"*-{self.id}.out"))
        return files[0].read_text(errors="replace") if files else ""

    def steps(self) -> list:
        """The metrics records of training steps, in order (rewritten on resume)."""
        path = self.run_dir / "metrics.jsonl"
        try:
            lines = path.read_text().splitlines()
        except OSError:
            return []
        records = []
        for line in lines:
            try:
                rec = json.loads(line)
            except ValueError:          # a line being written
                continue
            if "loss" in rec:
                records.append(rec)
        return records

    def report(self) -> str:
        try:
            fields = self.fields()
            state = {k: fields.get(k) for k in ("JobState", "Reason", "ExitCode", "Restarts", "RunTime")}
        except Exception as exc:        # the report must not hide the real failure
            state = repr(exc)
        return f"job {self.id}: {state}\n--- log\n{self.log()}"

    # --- its ranks -------------------------------------------------------------
    def ranks(self) -> list:
        """Pids of the job's running `mpicube train` ranks."""
        found = []
        for pid in mpicube_ranks(int(e) for e in os.listdir("/proc") if e.isdigit()):
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    env = f.read().split(b"\0")
            except OSError:
                continue
            if f"SLURM_JOB_ID={self.id}".encode() in env:
                found.append(pid)
        return found

    def latest_checkpoint(self) -> int:
        steps = [int(p.name[5:]) for p in self.run_dir.glob("ckpt/step_*") if p.name[5:].isdigit()]
        return max(steps, default=0)

    def training(self, target: int):
        """The ranks' pids once all of them run and the run has logged step ``target``, else None."""
        pids = self.ranks()
        done = self.steps()
        return pids if len(pids) == self.ntasks and done and done[-1]["step"] >= target else None

    def wait_training(self, steps: int = 3, timeout: float = 240) -> list:
        """Wait until all ranks run and have trained ``steps`` steps past the
        latest checkpoint (so this run of the job is up); the ranks' pids."""
        target = self.latest_checkpoint() + steps
        return wait_for(lambda: self.training(target), timeout,
                        f"job {self.id} to train to step {target} on {self.ntasks} ranks", self.report)


def mpicube_ranks(pids) -> list:
    """Those of ``pids`` that are `mpicube train` ranks: python running the
    mpicube script (not the launcher, whose command line names it too)."""
    found = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if (os.path.basename(argv[0]).startswith(b"python") and len(argv) > 2
                and argv[1].endswith(b"/mpicube") and argv[2] == b"train"):
            found.append(pid)
    return found


def pending(pid: int, sig: int):
    """Whether ``sig`` is pending on process ``pid``; None once the process is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            status = dict(line.split(":", 1) for line in f if ":" in line)
    except OSError:
        return None
    if status.get("State", "").strip().startswith("Z"):
        return None
    mask = int(status["ShdPnd"], 16) | int(status["SigPnd"], 16)
    return bool(mask & (1 << (sig - 1)))


@contextmanager
def held(pids: list):
    """Stop the processes for the duration of the block (SIGSTOP, then SIGCONT)."""
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass


def wait_pending(pids: list, sig: int, timeout: float, what: str, detail=lambda: "") -> None:
    """Wait until ``sig`` is pending on every process that still exists."""
    wait_for(lambda: all(pending(pid, sig) is not False for pid in pids), timeout, what, detail)


def submit(cluster: slurm_cluster.Cluster, script: str, submit_dir: Path, env: dict, ntasks: int,
           options=(), args=()) -> Job:
    """`sbatch` a script of jobs/ from ``submit_dir`` with ``env`` (RUN_DIR among it),
    on one node with ``ntasks`` tasks of one CPU; the script itself is unchanged."""
    cmd = ["sbatch", "--parsable", "--nodes=1", f"--ntasks={ntasks}", f"--ntasks-per-node={ntasks}",
           "--cpus-per-task=1", *options, str(ROOT / "jobs" / script), *args]
    proc = subprocess.run(cmd, cwd=submit_dir, env=cluster.env(env), capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, f"sbatch failed: {proc.stderr}"
    return Job(cluster, proc.stdout.strip().split(";")[0], submit_dir, Path(env["RUN_DIR"]), ntasks)
