"""One run per directory, and what a job agrees on before it starts: the
run-directory lock, config.json's launch history, metrics.jsonl across a
resume, a signal during a save, the data every rank reads, `eval`'s
default data. Every run is a real `mpiexec ... python -m mpicube`."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
import lock_trials
from conftest import PYTHON, TINY, last_json, read_metrics
from mpirun import rank_pid

from mpicube.files import checkpoint, data

pytestmark = pytest.mark.timeout(300)


def wait_for(predicate, proc=None, timeout=60, what="the state"):
    """Poll until ``predicate()`` holds (the run has reached a state), failing
    if ``proc`` ends first or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the run ended before {what}: {proc.communicate()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} after {timeout}s")
        time.sleep(0.05)


def steps_logged(run_dir) -> int:
    try:
        return len(read_metrics(run_dir)[0])
    except (FileNotFoundError, ValueError):
        return 0


def dead_pid() -> int:
    """The pid of a process of this host that has ended."""
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


# --------------------------------------------------------------------------- the lock


def test_second_job_on_a_run_directory_is_refused(mpicube, tmp_path):
    first = mpicube.popen("train", *TINY, "--steps", "100000", "--log-every", "1000", "--out", "run")
    try:
        wait_for(lambda: steps_logged(tmp_path / "run") >= 2, first, what="two steps")
        r = mpicube.run("train", *TINY, "--steps", "100000", "--resume", "--out", "run")
        assert r.returncode == 2, r
        [line] = r.error_lines()
        rank0 = rank_pid(first.pid, 0)
        assert f"run is in use by pid {rank0} on host {socket.gethostname()}" in line, line
        os.kill(rank0, signal.SIGTERM)
        out, err = first.communicate(timeout=60)
    finally:
        if first.poll() is None:
            first.kill()
            first.communicate()
    assert first.returncode == 75, (out, err)
    done = steps_logged(tmp_path / "run")
    assert [s["step"] for s in read_metrics(tmp_path / "run")[0]] == list(range(1, done + 1))
    assert not (tmp_path / "run" / "mpicube.lock").exists()               # released at exit


def test_concurrent_jobs_never_both_hold_the_lock(tmp_path):
    """1,000 races of 3 processes for one run directory's lock, with no
    lock, a dead one, an unreadable one or a dead one with a dead taker's
    claim before each (tests/lock_trials.py): exactly one holder every time,
    the others refused with the holder's name, nothing left behind."""
    result = lock_trials.race(1000, tmp_path)
    assert (result["double"], result["none"], result["odd"], result["debris"]) == (0, 0, 0, 0), result


def test_lock_of_a_dead_process_is_taken_over(mpicube, tmp_path):
    (tmp_path / "run").mkdir()
    lock = tmp_path / "run" / "mpicube.lock"
    lock.write_text(json.dumps({"host": socket.gethostname(), "pid": dead_pid(), "since": time.time()}))
    r = mpicube.run("train", *TINY, "--steps", "2", "--resume", "--out", "run")
    assert r.returncode == 0, r
    assert "took over the lock" in r.stdout and "no longer running" in r.stdout, r
    assert not lock.exists()


def test_lock_from_another_host_needs_force_unlock(mpicube, tmp_path):
    (tmp_path / "run").mkdir()
    lock = tmp_path / "run" / "mpicube.lock"
    lock.write_text(json.dumps({"host": "node-elsewhere", "pid": 4242, "since": time.time(), "job": "SLURM_JOB_ID=7"}))
    r = mpicube.run("train", *TINY, "--steps", "2", "--resume", "--out", "run")
    assert r.returncode == 2, r
    [line] = r.error_lines()
    assert "pid 4242 on host node-elsewhere, SLURM_JOB_ID=7" in line and "--force-unlock" in line, line
    assert lock.exists() and not (tmp_path / "run" / "ckpt").exists()
    r = mpicube.run("train", *TINY, "--steps", "2", "--resume", "--force-unlock", "--out", "run")
    assert r.returncode == 0 and "took over the lock" in r.stdout and "--force-unlock" in r.stdout, r
    assert not lock.exists() and checkpoint.latest(tmp_path / "run") is not None


# --------------------------------------------------------------------------- config.json and metrics.jsonl


def test_each_launch_is_recorded_and_metrics_survive_a_resume(mpicube, tmp_path):
    opts = ["--steps", "6", "--ckpt-every", "2", "--eval-every", "2", "--dp", "2"]
    r = mpicube.run("train", *TINY, *opts, "--stop-after", "3", "--out", "run", n=2,
                    env={"MPICUBE_KERNELS": "numpy", "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r
    run = tmp_path / "run"
    # as if the job had died after logging step 3, before its step-3
    # checkpoint, in the middle of writing a record; with a line a user
    # added by hand after step 2
    shutil.rmtree(run / "ckpt" / "step_00000003")
    (run / "ckpt" / "latest").write_text("step_00000002\n")
    metrics = run / "metrics.jsonl"
    records = metrics.read_text().splitlines()
    kept = [line for line in records if json.loads(line)["step"] <= 2] + ['{"note": "checked by hand"}']
    later = [line for line in records if json.loads(line)["step"] > 2]
    metrics.write_text("\n".join(kept + later) + '\n{"step": 4, "lo')

    r = mpicube.run("train", *TINY, *opts, "--resume", "--out", "run", n=2)
    assert r.returncode == 0, r
    lines = metrics.read_text().splitlines()
    assert lines[:len(kept)] == kept                                 # byte for byte, never rewritten
    records = [json.loads(line) for line in lines]
    assert [rec["step"] for rec in records if "loss" in rec] == [1, 2, 3, 4, 5, 6]
    assert [rec["step"] for rec in records if "val_loss" in rec] == [2, 4, 6]

    config = json.loads((run / "config.json").read_text())
    first, second = config["launches"]
    assert (first["start_step"], second["start_step"]) == (1, 3)
    assert first["environment"]["MPICUBE_KERNELS"] == "numpy" and "MPICUBE_KERNELS" not in second["environment"]
    assert first["threads"]["threads"] == 1 and first["threads"]["source"] == "OMP_NUM_THREADS"
    assert second["threads"]["ranks_on_node"] == 2
    for launch in (first, second):
        assert launch["world_size"] == 2 and launch["train"]["stop_after"] in (3, None)
        assert {"mpicube", "numpy", "h5py", "mpi4py", "mpi", "python"} <= set(launch["versions"])
    assert config["train"]["stop_after"] is None                     # the run as the last launch sees it


def test_a_bad_line_in_metrics_loses_no_later_record(mpicube, tmp_path):
    """A line that is not JSON at step 3 (issue 24: it used to cut every
    record after it on resume) is passed over with a note and kept, and so
    are the records after it up to the step the run resumes from; the
    records from there on are cut and repeated, as always."""
    opts = ["--steps", "10", "--ckpt-every", "4"]
    r = mpicube.run("train", *TINY, *opts, "--stop-after", "7", "--out", "run")
    assert r.returncode == 0, r
    metrics = tmp_path / "run" / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    lines[2] = "\x00\x00 garbage from a disk"
    metrics.write_text("\n".join(lines) + "\n")                  # the checkpoint of step 7 is there: resume at 8

    r = mpicube.run("train", *TINY, *opts, "--resume", "--out", "run")
    assert r.returncode == 0, r
    [note] = [line for line in r.stdout.splitlines() if "metrics.jsonl" in line]
    assert note == ("note: run/metrics.jsonl: passed over 1 line(s) that are not JSON "
                    "(line 3); kept them and the records after them"), r
    after = metrics.read_text().splitlines()
    assert after[:7] == lines[:7]                                    # byte for byte, the bad line too
    assert [json.loads(line)["step"] for line in after[:2] + after[3:]] == [1, 2] + list(range(4, 11))

    # resumed from step 8 (steps 9 and 10 repeated): a torn line after them goes with them, unannounced
    shutil.rmtree(tmp_path / "run" / "ckpt" / "step_00000010")
    (tmp_path / "run" / "ckpt" / "latest").write_text("step_00000008\n")
    metrics.write_text("\n".join(after) + '\n{"step": 11, "lo')
    r = mpicube.run("train", *TINY, *opts, "--resume", "--out", "run")
    assert r.returncode == 0, r
    again = metrics.read_text().splitlines()
    assert again[:8] == after[:8] and "torn" not in r.stdout, r
    assert [json.loads(line)["step"] for line in again[:2] + again[3:]] == [1, 2] + list(range(4, 11))


def test_a_torn_last_line_is_cut_with_a_note(tmp_path):
    """open_metrics on its own: a torn last line before the resume step is
    cut and said; a blank line is no record and needs no note."""
    from mpicube.training import rundir

    records = [json.dumps({"step": s, "loss": 1.0}) for s in (1, 2)]
    (tmp_path / "metrics.jsonl").write_text(records[0] + "\n\n" + records[1] + '\n{"step": 3, "lo')
    notes = []
    log = rundir.open_metrics(tmp_path, 3, notes)
    log.write({"step": 3, "loss": 2.0})
    log.close()
    assert notes == [f"note: {tmp_path / 'metrics.jsonl'}: cut a torn last line (line 4, 15 bytes: a job stopped "
                     "mid-write)"]
    assert (tmp_path / "metrics.jsonl").read_text().splitlines() == \
        [records[0], "", records[1], json.dumps({"step": 3, "loss": 2.0})]


# --------------------------------------------------------------------------- a signal during a save


def test_signal_during_a_save_stops_right_after_it(mpicube, tmp_path):
    """SIGUSR1 lands on rank 1 as it starts the periodic save of step 4: the
    job stops after that save (exit 75) with the step-4 checkpoint, instead
    of training step 5 and saving again."""
    r = mpicube.run("train", *TINY, "--steps", "8", "--ckpt-every", "2", "--dp", "2", "--out", "run", n=2,
                    env={"MPICUBE_TEST_SIGNAL_IN_SAVE": "1:4:USR1"})
    assert r.returncode == 75, r
    assert "stopped by a signal after step 4" in r.stdout, r
    assert steps_logged(tmp_path / "run") == 4
    assert sorted(p.name for p in (tmp_path / "run" / "ckpt").iterdir()) == \
        ["latest", "step_00000002", "step_00000004"]


# --------------------------------------------------------------------------- the data every rank reads


def test_no_validation_shard_turns_validation_off(mpicube, tmp_path, tiny_shard):
    lone = tmp_path / "lone.bin"
    lone.write_bytes(tiny_shard.read_bytes())                        # no lone_val.bin beside it
    r = mpicube.run("train", *TINY, "--steps", "4", "--eval-every", "2", "--data", lone, "--out", "run")
    assert r.returncode == 0, r
    warnings = [line for line in r.stdout.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "validation is off" in warnings[0] and "--val-data" in warnings[0], r
    assert read_metrics(tmp_path / "run")[1] == []                    # never validated on the training data
    assert json.loads((tmp_path / "run" / "config.json").read_text())["data"]["val"] is None

    val = tiny_shard.with_name("tiny_val.bin")
    r = mpicube.run("train", *TINY, "--steps", "4", "--eval-every", "2", "--data", lone, "--val-data", val,
                    "--out", "named")
    assert r.returncode == 0 and "warning" not in r.stdout, r
    assert [e["step"] for e in read_metrics(tmp_path / "named")[1]] == [2, 4]


def mpmd_in_dirs(mpicube, *groups):
    """mpiexec with one rank per (working directory, arguments) group."""
    cmd = [mpicube.mpiexec]
    for i, (cwd, args) in enumerate(groups):
        cmd += ([":"] if i else []) + ["-n", "1", "-wdir", str(cwd), PYTHON, "-m", "mpicube", *map(str, args)]
    return cmd


def test_stale_copy_on_one_node_is_one_error(mpicube, tmp_path, tiny_shard):
    """Each rank reads `corpus_val.bin` from its own working directory, as
    from a node-local disk; rank 1's copy is stale (shorter, so it holds
    fewer evaluation batches). Rank 0 decides, every rank checks: one error
    naming rank 1 and the file, instead of ranks running different numbers
    of evaluation batches (a hang)."""
    node0, node1 = tmp_path / "node0", tmp_path / "node1"
    for node in (node0, node1):
        node.mkdir()
        (node / "corpus.bin").write_bytes(tiny_shard.read_bytes())
    val = data.read_shard(tiny_shard.with_name("tiny_val.bin"))
    data.write_shard(node0 / "corpus_val.bin", val)
    data.write_shard(node1 / "corpus_val.bin", val[: 4 * 16 * 3 + 1])
    args = ["train", *TINY, "--dp", "2", "--steps", "4", "--eval-every", "2", "--data", "corpus.bin", "--out", "run"]
    env = dict(mpicube.env, MPIEXEC_TIMEOUT="40")
    r = subprocess.run(mpmd_in_dirs(mpicube, (node0, args), (node1, args)), env=env, capture_output=True,
                       text=True, timeout=80)
    text = r.stdout + r.stderr
    assert r.returncode == 2, text
    lines = [line for line in text.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and lines[0].startswith("error: rank 1: corpus_val.bin: holds 193 tokens where rank 0 has"), text
    assert "Traceback" not in text and not (node0 / "run").exists()


def test_eval_defaults_to_the_data_the_model_was_trained_on(mpicube, tmp_path, tiny_shard):
    r = mpicube.run("train", *TINY, "--steps", "4", "--eval-every", "4", "--data", tiny_shard, "--out", "run",
                    "--dtype", "float64")
    assert r.returncode == 0, r
    logged = read_metrics(tmp_path / "run")[1][-1]["val_loss"]
    r = mpicube.run("eval", "run", "--dtype", "float64")
    assert r.returncode == 0, r
    assert f"evaluating on {tiny_shard.with_name('tiny_val.bin')}" in r.stdout, r
    result = last_json(r.stdout)
    assert result["data"] == str(tiny_shard.with_name("tiny_val.bin"))
    assert result["loss"] == pytest.approx(logged, rel=1e-12)

    tiny_shard.with_name("tiny_val.bin").rename(tmp_path / "moved_val.bin")
    try:
        r = mpicube.run("eval", "run")
        assert r.returncode == 2 and "name the data with --data" in r.error_lines()[0], r
    finally:
        (tmp_path / "moved_val.bin").rename(tiny_shard.with_name("tiny_val.bin"))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
