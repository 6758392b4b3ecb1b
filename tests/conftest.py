"""Shared fixtures: run ``mpiexec -n N python -m mpicube ...`` for real, and
small token shards.

Every command runs under the ``mpiexec`` that sits beside this Python (the
MPICH wheel's), with the environment of ``mpirun.job_env``: MPIEXEC_TIMEOUT
so a hung job is killed by the launcher, a subprocess timeout on top of that.
"""

import os
import signal
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from mpicube.files import data
from mpirun import MPIEXEC, job_env

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
TIMEOUT = 60            # seconds a single mpicube command may take in these tests

# Model options small enough that a step takes about a millisecond.
TINY = ["--layout", "serial", "--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--seq-len", "16",
        "--batch-size", "4"]


@dataclass
class Result:
    """A finished command: the CompletedProcess and how long it took."""

    proc: subprocess.CompletedProcess
    seconds: float

    @property
    def returncode(self):
        return self.proc.returncode

    @property
    def stdout(self):
        return self.proc.stdout

    @property
    def stderr(self):
        return self.proc.stderr

    def error_lines(self):
        return [line for line in (self.stdout + self.stderr).splitlines() if line.startswith("error:")]

    def __str__(self):
        return (f"exit status {self.returncode} after {self.seconds:.1f}s\n--- stdout\n{self.stdout}"
                f"\n--- stderr\n{self.stderr}")


class MpiCube:
    """Runs the mpicube command line under mpiexec in a test's directory."""

    def __init__(self, cwd: Path, cache: Path):
        self.cwd = cwd
        if not MPIEXEC.exists():
            raise RuntimeError(f"no mpiexec next to {PYTHON}: install the venv with `make install`")
        self.mpiexec = str(MPIEXEC)
        self.env = job_env({"MPICUBE_CACHE": str(cache),      # the built-in corpus, prepared once per session
                            "PYTHONUNBUFFERED": "1"}, timeout=TIMEOUT)
        self.env["PATH"] = os.pathsep.join([str(MPIEXEC.parent), self.env.get("PATH", "")])

    def command(self, *args, n: int = 1, env: dict = None) -> list:
        """``mpiexec -n N python -m mpicube ARGS``; ``env`` goes to every rank."""
        cmd = [self.mpiexec, "-n", str(n)]
        for key, value in (env or {}).items():
            cmd += ["-genv", key, str(value)]
        return cmd + [PYTHON, "-m", "mpicube", *map(str, args)]

    def mpmd(self, *groups) -> list:
        """Several programs in one job: each group is (n, args, env or None),
        e.g. different arguments or environment on rank 1 only."""
        cmd = [self.mpiexec]
        for i, (n, args, env) in enumerate(groups):
            if i:
                cmd.append(":")
            cmd += ["-n", str(n)]
            for key, value in (env or {}).items():
                cmd += ["-env", key, str(value)]
            cmd += [PYTHON, "-m", "mpicube", *map(str, args)]
        return cmd

    def run(self, *args, n: int = 1, env: dict = None, timeout: float = TIMEOUT + 15, cmd=None) -> Result:
        cmd = cmd or self.command(*args, n=n, env=env)
        t0 = time.monotonic()
        proc = subprocess.run(cmd, cwd=self.cwd, env=self.env, capture_output=True, text=True,
                              timeout=timeout)
        return Result(proc, time.monotonic() - t0)

    def popen(self, *args, n: int = 1, env: dict = None) -> subprocess.Popen:
        return subprocess.Popen(self.command(*args, n=n, env=env), cwd=self.cwd, env=self.env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="session")
def corpus_cache(tmp_path_factory) -> Path:
    """A private MPICUBE_CACHE, so tests never write to the user's ~/.cache."""
    path = tmp_path_factory.mktemp("mpicube-cache")
    data.builtin_corpus(path)
    return path


@pytest.fixture
def mpicube(tmp_path, corpus_cache) -> MpiCube:
    return MpiCube(tmp_path, corpus_cache)


def sample_text_files() -> list:
    """A few fixed standard-library sources: real text, the same on every run."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return [stdlib / "textwrap.py", stdlib / "shlex.py"]


@pytest.fixture(scope="session")
def tiny_shard(tmp_path_factory) -> Path:
    """A prepared train shard (and its ``_val`` sibling) of a few ten thousand tokens."""
    out = tmp_path_factory.mktemp("data") / "tiny.bin"
    train, val = data.prepare(sample_text_files(), out, val_fraction=0.1)
    assert len(data.read_shard(val)) > 4 * 16 * 8 + 1        # room for 8 evaluation batches of 4 x 16
    return train


def read_metrics(run_dir: Path):
    """(step records, evaluation records) of a run's metrics.jsonl."""
    import json

    records = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "loss" in r], [r for r in records if "val_loss" in r]


def last_json(stdout: str) -> dict:
    """The JSON object on the last line of a command's stdout."""
    import json

    return json.loads(stdout.strip().splitlines()[-1])


def paired(a, b) -> zip:
    """``zip(a, b)`` for comparing two runs' records (or cases with their
    results), after asserting both hold the same, non-zero number of items.

    A bare ``zip`` stops at the shorter list, so a comparison loop passes
    when the run under test logged nothing or stopped early; this fails
    instead, naming both lengths."""
    a, b = list(a), list(b)
    assert len(a) == len(b) and len(a) > 0, f"cannot compare {len(a)} items with {len(b)}"
    return zip(a, b)


def relerr(a, b) -> float:
    return abs(a - b) / abs(b)


def checkpoint_tensors(path) -> dict:
    """Every tensor of a checkpoint, whole (verified on open)."""
    from mpicube.files import checkpoint

    with checkpoint.open_checkpoint(path) as ck:
        return {name: ck.read(name) for name in ck.names()}


def wait_for_steps(proc, run_dir, n, timeout=120):
    """Wait until the run in ``run_dir`` has logged ``n`` steps while ``proc`` runs
    (a bounded wait that names what it waited for)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        try:
            if len(read_metrics(run_dir)[0]) >= n:
                return
        except (FileNotFoundError, ValueError):
            pass
        time.sleep(0.01)
    raise AssertionError(f"fewer than {n} steps after {timeout}s")


# The files that take minutes, first: `make test` runs two pytest-xdist
# workers that take whole files in collection order, and a long file
# handed out last would leave one worker running it alone at the end.
# (Slowest first, from `pytest --durations` over the suite; 2026-12-06.)
LONG_FILES = ("test_precision.py", "test_gpu_path.py", "test_trace.py", "test_jobs_slurm.py", "test_moe.py",
              "test_planted_bugs.py", "test_fused.py", "test_combo_matrix.py", "test_check_resume.py",
              "test_deepseek_moe.py", "test_check_dtensor.py")


def pytest_collection_modifyitems(config, items):
    """Move LONG_FILES' tests to the front, in that order; every file keeps its own order (a stable sort)."""
    rank = {name: i for i, name in enumerate(LONG_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONG_FILES)))


# The dispositions this pytest process started with, before any test or fixture ran.
_SESSION_SIGNALS = {sig: signal.getsignal(sig) for sig in (signal.SIGUSR1, signal.SIGTERM)}


def _restore_session_signals():
    for sig, handler in _SESSION_SIGNALS.items():
        if handler is not None:
            signal.signal(sig, handler)


@pytest.fixture(autouse=True)
def _signal_dispositions():
    """Each test starts and ends with the signal dispositions the process
    started with. mpicube run in this process leaves SIGUSR1 ignored after a
    run (training/stopping.py: a finished rank must not die of a scheduler's
    late warning), and an ignored signal is inherited through exec: a job
    script that a later test starts in the same worker could then not trap
    SIGUSR1 at all (bash cannot trap what was ignored on entry). The values
    are those of conftest's import, not of the test's start: a module-scoped
    fixture that ran mpicube has already changed them by then."""
    _restore_session_signals()
    yield
    _restore_session_signals()
