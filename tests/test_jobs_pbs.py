"""The PBS scripts of jobs/ without PBS: Debian has no PBS, so the scheduler's
commands are STUBS. `qsub` and `qstat` below are small scripts put first on
PATH that record how they were called (qstat also answers with a walltime);
they are not PBS, and nothing here proves that PBS itself behaves so. What
runs for real: the script, its logic in jobs/common.sh (shared with the Slurm
scripts that tests/test_jobs_slurm.py runs under a real Slurm), mpiexec with
the node file, and mpicube.

What is PBS-specific, and tested here: the walltime left becomes
--time-limit, too little walltime is refused, status 75 resubmits the script
with qsub (after this job, settings carried in RUN_DIR/job-env.sh), the
resubmitted job resumes from the checkpoint, and MAX_RESUBMITS ends the chain;
status 74 (the run folder failed) ends it too.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
from pathlib import Path

import pytest

from conftest import read_metrics
from fs_faults import small_disks
from mpirun import ROOT, descendants, job_env, mpiexec
from slurm_jobs import held, mpicube_ranks, pending, wait_for

MODEL = ["--layout", "1d", "--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--seq-len", "16",
         "--batch-size", "4", "--lr", "1e-3", "--warmup", "20"]
STEPS = 120
LONG = 100000          # a run that cannot end before the test's signal lands
PREEMPTED = 1500       # a run the test holds after 3 steps: 120 steps can end first, in milliseconds
JOB_ID = "1234.stub-pbs"

# STUB, not PBS: records its arguments, prints a new job id.
QSUB_STUB = """#!/bin/bash
# STUB standing in for PBS's qsub in tests/test_jobs_pbs.py: records the call.
printf '%s\\n' "$(printf '%q ' "$@")" >>"$STUB_LOG/qsub.calls"
echo 1235.stub-pbs
"""
# STUB, not PBS: `qstat -f JOBID` answers with the walltime the test chose.
QSTAT_STUB = """#!/bin/bash
# STUB standing in for PBS's qstat in tests/test_jobs_pbs.py: records the call.
printf '%s\\n' "$*" >>"$STUB_LOG/qstat.calls"
echo "Job Id: $2"
echo "    Resource_List.walltime = $STUB_WALLTIME"
"""


class PbsJob:
    """jobs/pbs_8gpu.sh run by bash as PBS would run it, with stubbed qsub/qstat."""

    def __init__(self, tmp_path: Path, tiny_shard: Path):
        self.dir = tmp_path
        self.stubs = tmp_path / "stub-bin"
        self.stubs.mkdir()
        for name, text in (("qsub", QSUB_STUB), ("qstat", QSTAT_STUB)):
            (self.stubs / name).write_text(text)
            (self.stubs / name).chmod(0o755)
        self.nodefile = tmp_path / "nodefile"
        self.nodefile.write_text("localhost\nlocalhost\n")          # select=...:mpiprocs=2 on one host
        self.run_dir = tmp_path / "run"
        self.data = tiny_shard

    def env(self, **variables) -> dict:
        """What PBS gives a job (no submitter environment: qsub without -V), plus ``variables``."""
        base = job_env()            # PATH to python and the venv's mpiexec, MPICH's oversubscription setting
        env = {k: base[k] for k in ("PATH", "HOME", "LANG", "MPIR_CVAR_ENABLE_HEAVY_YIELD", "MPIEXEC_TIMEOUT")
               if k in base}
        # The machine's OpenBLAS settings (a site sets them in every login
        # shell, so a PBS job has them too). The losses are compared bit for
        # bit with a plain mpiexec run, which inherits them: without them the
        # job would pick another GEMM kernel and differ in the last bits.
        env.update({k: v for k, v in base.items() if k.startswith("OPENBLAS_")})
        env.update(PATH=f"{self.stubs}:{env['PATH']}", STUB_LOG=str(self.dir), PBS_JOBID=JOB_ID,
                   PBS_NODEFILE=str(self.nodefile), PBS_O_WORKDIR=str(ROOT))
        env.update({k: str(v) for k, v in variables.items()})
        return env

    def settings(self, **variables) -> dict:
        """The environment of a first submission: the test's run settings."""
        run = dict(REPO_DIR=ROOT, RUN_DIR=self.run_dir, DATA=self.data, DEVICE="cpu", LAYOUT="1d", N_LAYER=1,
                   N_HEAD=2, N_EMBD=16, SEQ_LEN=16, BATCH_SIZE=4, LR="1e-3", WARMUP=20, STEPS=STEPS,
                   CKPT_EVERY=100000)
        return self.env(**{**run, **variables})

    def start(self, env: dict, script: Path = ROOT / "jobs" / "pbs_8gpu.sh") -> subprocess.Popen:
        """Start the script, its output going to a new log file (``log()``) as PBS's -j oe would.

        The job shell starts with the default action for every signal, as
        pbs_mom starts it, whatever this test process inherited or ignores
        (``env --default-signal``: an ignored SIGUSR1 would pass through exec
        and bash could not trap it)."""
        self.logs = getattr(self, "logs", 0) + 1
        with open(self.log_path(), "w") as log:
            return subprocess.Popen(["env", "--default-signal", "bash", str(script)], cwd=self.dir, env=env,
                                    stdout=log, stderr=subprocess.STDOUT)

    def log_path(self) -> Path:
        return self.dir / f"job{self.logs}.log"

    def log(self) -> str:
        return self.log_path().read_text(errors="replace")

    def finish(self, proc: subprocess.Popen, timeout: float = 240):
        try:
            proc.wait(timeout=timeout)
        finally:
            if proc.poll() is None:
                proc.kill()
        return proc.returncode, self.log()

    def run(self, env: dict, timeout: float = 240):
        return self.finish(self.start(env), timeout)

    def calls(self, command: str) -> list:
        path = self.dir / f"{command}.calls"
        return path.read_text().splitlines() if path.exists() else []

    def losses(self) -> list:
        return [r["loss"] for r in read_metrics(self.run_dir)[0]]


@pytest.fixture
def pbs(tmp_path, tiny_shard):
    return PbsJob(tmp_path, tiny_shard)


def reference_losses(tmp_path, tiny_shard, steps: int = STEPS) -> list:
    out = tmp_path / "reference"
    r = mpiexec(2, ["-m", "mpicube", "train", *MODEL, "--steps", steps, "--data", tiny_shard, "--out", out],
                env={"OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stdout + r.stderr
    return [rec["loss"] for rec in read_metrics(out)[0]]


def time_limit(out: str) -> int:
    [line] = [line for line in out.splitlines() if "] running: " in line]
    return int(re.search(r"--time-limit (\d+)", line).group(1))


@pytest.mark.parametrize("source", ["qstat", "PBS_WALLTIME"])
def test_walltime_left_becomes_the_time_limit(pbs, source):
    """An hour of walltime, 300 s kept back (TIME_MARGIN): mpicube gets 3300 s
    less what the script has used. PBS Pro tells it through qstat (STUB),
    Torque through PBS_WALLTIME in seconds."""
    extra = {"STUB_WALLTIME": "01:00:00"} if source == "qstat" else {"PBS_WALLTIME": "3600"}
    status, out = pbs.run(pbs.settings(STEPS=5, **extra))
    assert status == 0, out
    assert 3290 <= time_limit(out) <= 3300, out
    assert pbs.calls("qstat") == ([f"-f {JOB_ID}"] if source == "qstat" else [])
    assert pbs.calls("qsub") == []                      # finished: nothing resubmitted


def test_too_little_walltime_is_refused_before_training(pbs):
    status, out = pbs.run(pbs.settings(STUB_WALLTIME="00:05:30"))
    assert status == 1, out
    assert re.search(r"error: only \d+s left for training after TIME_MARGIN=300s", out), out
    assert "running:" not in out and not (pbs.run_dir / "config.json").exists()


def test_status_75_resubmits_and_the_next_job_resumes_bit_for_bit(pbs, tmp_path, tiny_shard):
    """SIGUSR1 to the job's shell (what `qsig -s USR1` does) reaches the ranks
    through mpiexec; mpicube checkpoints and exits 75; the script qsubs itself
    (STUB) to run after this job. The test then runs that submission as PBS
    would: the recorded script with only the -v variables, no settings."""
    proc = pbs.start(pbs.settings(STUB_WALLTIME="01:00:00", STEPS=PREEMPTED))
    try:
        def training_ranks():
            pids = mpicube_ranks(descendants(proc.pid))
            trained = (pbs.run_dir / "metrics.jsonl").exists() and len(read_metrics(pbs.run_dir)[0]) >= 3
            return pids if len(pids) == 2 and trained else None

        pids = wait_for(training_ranks, 120, "2 ranks training", pbs.log)
        with held(pids):
            os.kill(proc.pid, signal.SIGUSR1)
            wait_for(lambda: all(pending(p, signal.SIGUSR1) is not False for p in pids), 60,
                     "SIGUSR1 passed on to both ranks", pbs.log)
    finally:
        status, out = pbs.finish(proc)
    assert status == 75, out
    assert "got SIGUSR1" in out and "passed SIGUSR1 on to the ranks through mpiexec" in out, out
    stopped = len(read_metrics(pbs.run_dir)[0])
    assert 3 <= stopped < PREEMPTED

    [call] = pbs.calls("qsub")
    args = shlex.split(call)
    env_file = pbs.run_dir / "job-env.sh"
    assert args == ["-W", f"depend=afterany:{JOB_ID}", "-v",
                    f"MPICUBE_RESUBMITS=1,MPICUBE_JOB_ENV={env_file}", str(ROOT / "jobs" / "pbs_8gpu.sh")], call
    assert f"export RUN_DIR={pbs.run_dir}" in env_file.read_text()

    variables = dict(item.split("=", 1) for item in args[3].split(","))
    second = pbs.start(pbs.env(PBS_JOBID="1235.stub-pbs", STUB_WALLTIME="01:00:00", **variables),
                       script=Path(args[4]))
    status, out = pbs.finish(second)
    assert status == 0, out
    assert "restart 1" in out and f"latest checkpoint: step {stopped}" in out, out
    assert pbs.losses() == reference_losses(tmp_path, tiny_shard, PREEMPTED)
    assert len(pbs.calls("qsub")) == 1


def test_early_signal_waits_for_mpicube_and_max_resubmits_ends_the_chain(pbs):
    """SIGUSR1 as soon as the script has its trap, before mpicube is up (as a
    Slurm signal due before the job starts comes): the script holds it until
    this launch of mpicube has its handler, so no rank dies of it; mpicube
    stops after a step with 75. This is the third job of a chain with
    MAX_RESUBMITS=2, so it submits no fourth."""
    # A schedule far longer than the test: the signal is passed on once mpicube
    # is up, and a 120-step run can end first (it takes under a second).
    proc = pbs.start(pbs.settings(STUB_WALLTIME="01:00:00", MAX_RESUBMITS=2, MPICUBE_RESUBMITS=2, STEPS=LONG))
    try:
        wait_for(lambda: "[mpicube job" in pbs.log(), 60, "the script to start", pbs.log)
        os.kill(proc.pid, signal.SIGUSR1)
    finally:
        status, out = pbs.finish(proc)
    assert status == 75, out
    lines = out.splitlines()
    got = next(i for i, line in enumerate(lines) if "got SIGUSR1" in line)
    running = next(i for i, line in enumerate(lines) if "] running: " in line)
    passed = next(i for i, line in enumerate(lines) if "passed SIGUSR1 on to the ranks" in line)
    # The signal comes once the script has logged its first line; whether the
    # trap runs before or after "running:" depends on how long the MPI probe
    # takes. What is guaranteed: it is passed on only after both.
    assert got < passed and running < passed, out
    assert "stopped by a signal after step" in out and "Traceback" not in out, out
    assert "MAX_RESUBMITS=2 resubmissions reached: not resubmitting" in out, out
    assert pbs.calls("qsub") == []
    assert 1 <= len(read_metrics(pbs.run_dir)[0]) < LONG


def test_status_74_ends_the_chain(pbs, tmp_path):
    """A run folder on a file system gone read-only: mpicube stops with 74
    (one `error:` line naming the lock it cannot write), and the script ends
    the job with 74 instead of resubmitting one that would fail alike."""
    with small_disks(tmp_path) as (mount, _, read_only):
        disk = mount(tmp_path / "disk", 256)
        (disk / "run").mkdir()
        read_only(disk)
        pbs.run_dir = disk / "run"
        status, out = pbs.run(pbs.settings(STUB_WALLTIME="01:00:00"))
    assert status == 74, out
    assert f"error: {disk}/run/mpicube.lock: cannot take the run directory's lock (Read-only file system)" in out
    assert "mpicube failed with status 74 (the run folder" in out and "not resubmitting" in out, out
    assert "Traceback" not in out and pbs.calls("qsub") == []
