"""The Slurm scripts of jobs/ under a real Slurm: a one-node cluster
(tools/slurm_cluster.py, Debian's slurmctld/slurmd/munge) brought up for this
module, real sbatch jobs, ranks started by srun over PMI2.

The scripts run unchanged: the tests set only environment variables (a CPU
device, a tiny model, the test's data and run folder) and the sbatch options
that fit 2 cores (one node, N tasks of one CPU; --time in the time-limit
test). Each job's losses are compared with the same run under plain mpiexec.

Installing the packages needs root and apt-get; .ci/run installs them before
the tests, so in CI (CI set) a cluster that cannot start fails these tests,
elsewhere it skips them with the reason.
"""

from __future__ import annotations

import os
import re
import signal

import pytest

from conftest import read_metrics
from mpirun import ROOT, job_env, mpiexec
from slurm_jobs import held, slurm_cluster, submit, wait_for, wait_pending

MODEL = {"N_LAYER": "1", "N_HEAD": "2", "N_EMBD": "16", "SEQ_LEN": "16", "BATCH_SIZE": "4",
         "LR": "1e-3", "WARMUP": "20", "DTYPE": "float32",
         # the bigger scripts default to a pipeline over replicas; on a few ranks, none
         "DP": "1", "PP": "1", "PP_SCHEDULE": "1f1b", "VIRTUAL_STAGES": "1", "GRAD_ACCUM": "1"}
STEPS = 120             # long enough to stop in the middle; a few seconds of training
# Runs a test stops: the ranks are held once they have trained a few steps
# past the latest checkpoint, and a 120-step run (or the 15 steps left after
# a resume) can end in milliseconds, before the test holds them; 1,500 steps
# leave a margin of seconds.
PREEMPTED_STEPS = 1500


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    try:
        slurm_cluster.install(quiet=True)
        cluster = slurm_cluster.Cluster(tmp_path_factory.mktemp("slurm")).up()
    except slurm_cluster.ClusterError as exc:
        if os.environ.get("CI"):
            pytest.fail(f"the test Slurm cannot run here: {exc}")
        pytest.skip(f"no test Slurm: {exc}")
    yield cluster
    cluster.down()


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_shard):
    """Per-step losses of uninterrupted runs under plain mpiexec, one per (ranks, layout, steps)."""
    done = {}

    def losses(ntasks: int, layout: str, steps: int) -> list:
        key = (ntasks, layout, steps)
        if key not in done:
            out = tmp_path_factory.mktemp("reference") / "run"
            args = ["-m", "mpicube", "train", "--layout", layout, "--dtype", MODEL["DTYPE"], "--device", "cpu",
                    "--n-layer", MODEL["N_LAYER"], "--n-head", MODEL["N_HEAD"], "--n-embd", MODEL["N_EMBD"],
                    "--seq-len", MODEL["SEQ_LEN"], "--batch-size", MODEL["BATCH_SIZE"], "--steps", steps,
                    "--lr", MODEL["LR"], "--warmup", MODEL["WARMUP"], "--data", tiny_shard, "--out", out]
            r = mpiexec(ntasks, args, env={"OMP_NUM_THREADS": "1"}, timeout=240)
            assert r.returncode == 0, r.stdout + r.stderr
            done[key] = [rec["loss"] for rec in read_metrics(out)[0]]
        return done[key]

    return losses


@pytest.fixture
def jobs(slurm, tmp_path, tiny_shard):
    """Submit a script of jobs/ with the test's settings; jobs still running at
    the end of the test are cancelled, so a failure does not load the next one."""
    submitted = []

    def run(script: str, ntasks: int = 2, layout: str = "1d", steps: int = STEPS, options=(), **variables):
        env = job_env({"REPO_DIR": str(ROOT), "RUN_DIR": str(tmp_path / f"run{len(submitted)}"),
                       "DATA": str(tiny_shard), "DEVICE": "cpu", "LAYOUT": layout, "STEPS": str(steps),
                       "CKPT_EVERY": "100000", "EXTRA_ARGS": "--log-every 100", **MODEL,
                       **{k: str(v) for k, v in variables.items()}})
        job = submit(slurm, script, tmp_path, env, ntasks, options)
        submitted.append(job)
        return job

    yield run
    for job in submitted:
        job.cancel()


def losses(job) -> list:
    records = job.steps()
    assert [r["step"] for r in records] == list(range(1, len(records) + 1)), "steps missing or repeated"
    return [r["loss"] for r in records]


def preempt(job, send, what: str) -> None:
    """Hold the job's ranks still mid-training, ``send()`` the stop request and
    let them go on once SIGUSR1 is pending on every rank."""
    pids = job.wait_training()
    with held(pids):
        send()
        wait_pending(pids, signal.SIGUSR1, 60, f"SIGUSR1 from {what} on every rank of job {job.id}", job.report)


def restarts_logged(job) -> list:
    return [int(line.rsplit("restart ", 1)[1].split(";")[0]) for line in job.log().splitlines()
            if f"job {job.id} (slurm), restart " in line]


@pytest.mark.parametrize("script, ntasks, layout, steps", [
    ("slurm_8gpu.sh", 8, "3d", 10),             # its own 2x2x2 cube
    ("slurm_64gpu.sh", 2, "1d", STEPS),         # the bigger scripts on 2 ranks: the same logic
    ("slurm_512gpu.sh", 2, "1d", STEPS),
])
def test_job_runs_to_the_end_with_the_losses_of_mpiexec(jobs, reference, script, ntasks, layout, steps):
    job = jobs(script, ntasks=ntasks, layout=layout, steps=steps)
    end = job.wait_end()
    assert (end["JobState"], end["ExitCode"], end["Restarts"]) == ("COMPLETED", "0:0", "0"), job.report()
    log = job.log()
    assert f"MPI world: {ntasks} ranks on 1 node(s)" in log and "training finished" in log, log
    assert losses(job) == reference(ntasks, layout, steps)


def test_time_limit_signal_checkpoints_requeues_and_resumes_bit_for_bit(jobs, reference):
    """--time=2 with the script's --signal=B:USR1@120: the signal is due as the
    job starts, and Slurm sends it at its first check after that (0-30 s in),
    perhaps before mpicube is up. Every run of the job would get one: once the
    first has its signal, the test gives the job 10 minutes, so that the run
    after the requeue finishes."""
    job = jobs("slurm_8gpu.sh", steps=PREEMPTED_STEPS, options=["--time=2"])

    def signalled():
        return "got SIGUSR1" in job.log()

    pids = wait_for(lambda: signalled() or job.training(3), 240, "training or Slurm's signal", job.report)
    if not signalled():
        with held(pids):
            wait_for(signalled, 60, "Slurm's --signal", job.report)
            wait_pending(pids, signal.SIGUSR1, 60, "SIGUSR1 passed on to every rank", job.report)
    job.cluster.run("scontrol", "update", f"JobId={job.id}", "TimeLimit=10")
    end = job.wait_end()
    assert (end["JobState"], end["ExitCode"], end["Restarts"]) == ("COMPLETED", "0:0", "1"), job.report()
    log = job.log()
    assert restarts_logged(job) == [0, 1], log
    assert "passed SIGUSR1 on to the ranks through srun" in log
    # "requeueing" is logged before `scontrol requeue`, which cancels the batch
    # step: nothing the script would write after that call is guaranteed.
    assert "mpicube stopped early (status 75)" in log and f"requeueing job {job.id}" in log, log
    assert losses(job) == reference(2, "1d", PREEMPTED_STEPS)


def test_scancel_to_the_steps_then_to_the_batch_shell_requeue_and_resume(jobs, reference):
    job = jobs("slurm_8gpu.sh", steps=PREEMPTED_STEPS)
    # `scancel --signal=USR1`: Slurm signals the job steps (the ranks), not the batch shell.
    preempt(job, lambda: job.signal(), "scancel --signal=USR1")
    wait_for(lambda: restarts_logged(job) == [0, 1], 120, "the requeued job to start again", job.report)
    assert "got SIGUSR1" not in job.log()
    # `--batch`: only the shell gets it, and passes it on to the ranks.
    preempt(job, lambda: job.signal("--batch"), "scancel --signal=USR1 --batch")
    end = job.wait_end()
    assert (end["JobState"], end["ExitCode"], end["Restarts"]) == ("COMPLETED", "0:0", "2"), job.report()
    log = job.log()
    assert log.count("got SIGUSR1") == 1 and log.count("passed SIGUSR1 on to the ranks") == 1, log
    assert log.count("mpicube stopped early (status 75)") == 2 and restarts_logged(job) == [0, 1, 2], log
    assert losses(job) == reference(2, "1d", PREEMPTED_STEPS)


def test_max_resubmits_stops_the_requeue_loop_with_status_75(jobs):
    job = jobs("slurm_8gpu.sh", steps=PREEMPTED_STEPS, MAX_RESUBMITS=0)
    preempt(job, lambda: job.signal("--batch"), "scancel --signal=USR1 --batch")
    end = job.wait_end()
    assert (end["JobState"], end["ExitCode"], end["Restarts"]) == ("FAILED", "75:0", "0"), job.report()
    assert "MAX_RESUBMITS=0 restarts reached: not requeueing" in job.log()
    assert 0 < len(job.steps()) < PREEMPTED_STEPS


def test_world_size_check_refuses_ranks_that_each_see_a_world_of_one(jobs):
    job = jobs("slurm_8gpu.sh", SRUN_ARGS="--mpi=none")
    end = job.wait_end()
    assert (end["JobState"], end["ExitCode"], end["Restarts"]) == ("FAILED", "1:0", "0"), job.report()
    log = job.log()
    assert "error: the launcher started 2 processes that each see an MPI world of 1" in log, log
    assert "running:" not in log and not (job.run_dir / "config.json").exists()


def test_failure_on_one_rank_ends_the_job_without_requeue(jobs):
    job = jobs("slurm_8gpu.sh", MPICUBE_TEST_CRASH_RANK=1)
    end = job.wait_end()
    assert (end["JobState"], end["Restarts"]) == ("FAILED", "0"), job.report()
    assert end["ExitCode"] == "1:0", job.report()
    log = job.log()
    # srun's own status is that of the ranks it killed once rank 1 aborted (137)
    assert re.search(r"mpicube failed with status \d+; not resubmitting \(job exit status 1\)", log), log
    assert "RuntimeError: MPICUBE_TEST_CRASH_RANK=1" in log


@pytest.mark.parametrize("status, extra", [
    (2, "--n-head 3"),                          # bad input: 3 heads do not split over 2 ranks
    (3, "--lr 1e30 --warmup 0"),                # diverges within a few steps
])
def test_exit_status_reaches_the_scheduler(jobs, status, extra):
    job = jobs("slurm_8gpu.sh", EXTRA_ARGS=extra)
    end = job.wait_end()
    assert (end["JobState"], end["ExitCode"], end["Restarts"]) == ("FAILED", f"{status}:0", "0"), job.report()
    assert f"mpicube failed with status {status} (" in job.log() and "not resubmitting" in job.log()
