"""A rank that stops must not hang the job (--collective-timeout): the
watchdog's one line, exit status 76, an intact checkpoint, and waiting
ranks that sleep instead of spinning; the pieces it is made of."""

import json
import os
import re
import signal
import subprocess
import time

import pytest
from click.testing import CliRunner
from mpirun import mpiexec, rank_pid
from conftest import read_metrics

from mpicube.cli.main import cli
from mpicube.files import checkpoint
from mpicube.parallel import waiting
from mpicube.parallel.watchdog import EXIT_NO_PROGRESS, describe_wait, ranks_text

ONE_D = ["--layout", "1d", "--n-layer", "1", "--n-head", "4", "--n-embd", "16", "--seq-len", "16",
         "--batch-size", "4"]
LINE = (r"error: rank (?P<rank>\d) (waited (?P<waited>\d+) s in \S+.* over axis \w+|made no progress for "
        r"(?P<idle>\d+) s .*) \(.*step \d+\): no progress; no answer from rank 2 \(stopped, dead or unreachable\); "
        r"aborting the job \(exit status 76\)")


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (all its threads) so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_stopped_rank_ends_the_job_with_one_line(mpicube, tmp_path):
    """4 ranks, 1-D; rank 2 gets SIGSTOP mid-run. Within 60 s the job ends
    with status 76 and one line naming the rank that waited, where, and
    rank 2 as the one that did not answer; the ranks that wait use almost
    no CPU meanwhile; the last checkpoint is whole and resumable."""
    proc = mpicube.popen("train", *ONE_D, "--steps", "100000", "--ckpt-every", "5", "--log-every", "1000",
                         "--out", "run", "--collective-timeout", "15", n=4)
    stopped = None
    try:
        deadline = time.monotonic() + 120
        while len(_steps(tmp_path / "run")) < 6:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.01)
        waiting_pids = [rank_pid(proc.pid, r) for r in (0, 1, 3)]
        stopped = rank_pid(proc.pid, 2)
        os.kill(stopped, signal.SIGSTOP)
        t_stop = time.monotonic()
        time.sleep(3)                                        # the others reach their wait
        before = sum(map(_cpu_seconds, waiting_pids))
        time.sleep(8)
        cores = (sum(map(_cpu_seconds, waiting_pids)) - before) / 8
        out, err = proc.communicate(timeout=60)
        ended = time.monotonic() - t_stop
    finally:
        if proc.poll() is None:
            proc.kill()
        if stopped is not None:
            try:
                os.kill(stopped, signal.SIGKILL)
            except ProcessLookupError:
                pass
    print(f"\nrank 2 stopped: the job ended {ended:.1f} s later; the 3 waiting ranks used {cores:.3f} cores")
    assert proc.returncode == EXIT_NO_PROGRESS, out + err
    assert ended < 60, ended
    lines = [line for line in (out + err).splitlines() if line.startswith("error:")]
    print("\n".join(lines))
    assert len(lines) == 1 and re.fullmatch(LINE, lines[0]), out + err
    assert "Traceback" not in out + err
    assert cores < 0.3, cores                              # a blocking MPI wait spins: about 1 core per rank

    ok, report = checkpoint.inspect(tmp_path / "run")
    assert ok, report
    saved = int(checkpoint.latest(tmp_path / "run").name.split("_")[1])
    assert saved % 5 == 0 and 5 <= saved <= len(_steps(tmp_path / "run")), saved
    r = mpicube.run("train", *ONE_D, "--steps", "100000", "--out", "run", "--resume", "--stop-after", saved + 1,
                    n=4)
    assert r.returncode == 0 and f"step_{saved:08d}" in r.stdout, r


def _steps(run_dir):
    try:
        return read_metrics(run_dir)[0]
    except (FileNotFoundError, ValueError):
        return []


def test_watchdogs_agree_on_one_speaker():
    """tests/watchdog_check.py on 3 ranks: one line per case, from the rank
    the rules choose, naming the silent rank or where each rank waits."""
    proc = mpiexec(3, ["tests/watchdog_check.py"], timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    printed = json.loads(proc.stdout.strip().splitlines()[-1])
    tail = "; aborting the job (exit status 76)"
    assert printed["stopped"] == [[f"error: rank 0 waited 1 s in allreduce over axis tp (step 7): no progress; "
                                   f"no answer from rank 1 (stopped, dead or unreachable){tail}"], [], []], printed
    assert printed["deadlock"] == [[f"error: rank 0 waited 1 s in allreduce over axis tp (step 7): no progress; "
                                    "every rank answered: rank 1 in allreduce over axis tp (step 7); "
                                    f"rank 2 in allgather over axis dp (step 7){tail}"], [], []], printed
    [speaker] = printed["first"][2]
    assert printed["first"][:2] == [[], []] and speaker.startswith("error: rank 2 waited 1 s in bcast over axis row "
                                                                   "(step 7): no progress; every rank answered: "
                                                                   "rank 0 in allreduce over axis tp (step 7); "
                                                                   "rank 1 outside communication (step 7)"), printed


def test_ranks_and_waits_in_words():
    assert ranks_text([5]) == "rank 5"
    assert ranks_text([7, 0, 1, 2, 4, 5]) == "ranks 0-2, 4-5, 7"
    assert describe_wait(("allreduce", "tp", 10.0), 12, "step", 25.0) == (15.0, "in allreduce over axis tp (step 12)")
    assert describe_wait(None, 12, "step", 25.0) == (None, "outside communication (step 12)")
    assert describe_wait(None, 12, "checkpoint save", 1.0) == (None, "in the checkpoint save (step 12)")
    assert describe_wait(("barrier", "world", 0.0), None, "setup", 3.0)[1] == "in barrier over axis world (setup)"


class _Request:
    """Completes on its ``n``-th Test."""

    def __init__(self, n):
        self.n = n

    def Test(self):
        self.n -= 1
        return self.n <= 0


def _polls(n_yields: int) -> int:
    """Tests of a young wait that yields ``n_yields`` times: each round is one test, a burst and a yield."""
    return 1 + n_yields * (1 + waiting.BURST)


def test_complete_yields_while_young_then_sleeps_a_tenth_of_the_wait():
    """A young wait tests and yields the core (never sleeps: a sleeping rank
    stalls every round of a collective on a shared core); past YIELD_S it
    sleeps a tenth of the time waited, at most NAP_MAX_S."""
    clock = [0.0]
    naps, yields = [], []

    def tick():
        clock[0] += 1e-4                  # each round (a test, a burst, a yield) takes 0.1 ms
        return clock[0]

    def sleep(seconds):
        naps.append(seconds)
        clock[0] += seconds

    def yield_core():
        yields.append(clock[0])

    waiting.complete(_Request(1), tick, sleep, yield_core)
    assert naps == [] and yields == []                         # done at once: no clock read, no yield
    waiting.complete(_Request(1 + _polls(498)), tick, sleep, yield_core)
    assert naps == [] and len(yields) == 498                   # 50 ms: young, every round yields
    yields.clear()
    young_rounds = int(waiting.YIELD_S / 1e-4)
    waiting.complete(_Request(_polls(young_rounds) + 200), tick, sleep, yield_core)
    assert abs(len(yields) - young_rounds) <= 2, len(yields)
    assert naps[0] == pytest.approx(waiting.NAP_FRACTION * waiting.YIELD_S, rel=0.01) or \
        naps[0] == waiting.NAP_MAX_S
    assert all(b >= a for a, b in zip(naps, naps[1:])) and max(naps) == waiting.NAP_MAX_S


def test_complete_block_mode_calls_mpi_wait():
    """MPICUBE_WAIT=block (the benchmark's baseline) hands the wait to MPI."""
    class Blocking:
        waited = False

        def Test(self):
            return False

        def Wait(self):
            self.waited = True

    request = Blocking()
    waiting.set_mode("block")
    try:
        waiting.complete(request, sleep=pytest.fail, yield_core=pytest.fail)
    finally:
        waiting.set_mode("yield")
    assert request.waited
    with pytest.raises(ValueError, match="unknown wait mode 'spin'"):
        waiting.set_mode("spin")


def test_collective_timeout_option():
    runner = CliRunner()
    for command in ("train", "eval", "bench"):
        text = " ".join(runner.invoke(cli, [command, "--help"]).output.split())
        assert "--collective-timeout SECONDS" in text and "(exit status 76)" in text, text
    result = runner.invoke(cli, ["bench", "--collective-timeout", "-5"])
    assert result.exit_code == 2 and "0 (off) or a number of seconds" in result.output, result.output



def test_a_bad_wait_mode_is_one_line_and_exit_2(mpicube):
    """MPICUBE_WAIT is read before any command runs: a value that is not a
    mode is one line from rank 0 and exit status 2 on every rank."""
    r = mpicube.run("info", "--layout", "1d", "-n", "2", n=2, env={"MPICUBE_WAIT": "spin"})
    assert r.returncode == 2, r
    assert r.error_lines() == ["error: MPICUBE_WAIT: unknown wait mode 'spin'; choose one of yield, block"], r
