"""Hostile checkpoints and token shards (tests/hostile_files.py), through the
real command line.

A checkpoint is untrusted input (docs/design.md section 6): each hostile case
must be refused by every entry point that reads checkpoints (`eval`,
`inspect`, `convert`, `train --init-from`, `train --resume`) with exit
status 2 and exactly one `error:` line (`inspect`: its documented status 1,
`result: FAILED` and the problem listed), no traceback, nothing written,
within 10 s and under a 1 GB address-space limit: a file that makes a
reader hang, allocate without bound or crash fails here. Token shards with a
lying header, or truncated under a running job, are refused by `train
--data` and `eval --data` the same way.

Every case is also checked in-process (`open_checkpoint`, `open_model`,
`inspect`), which is cheap; the command line runs the cases the issue
reported through every entry point and each other case through one, in
turn. One good one-rank run is made per module and copied per case.
"""

from __future__ import annotations

import re
import resource
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from conftest import TINY, MpiCube
from hostile_files import CHECKPOINT_CASES, HEADER_BYTES, SHARD_CASES, raw_shard

from mpicube.files import checkpoint, formats
from mpicube.training.state import model_shapes

pytestmark = pytest.mark.timeout(300)

STEP_DIR = "step_00000002"
ADDRESS_SPACE = 1 << 30          # RLIMIT_AS of every process of a command; a normal one peaks near 0.5 GB
SECONDS = 10                     # a refusal takes about a second; a hang or a scan of a huge file is caught
REPORTED = ["external-storage", "elink-absolute", "elink-escape", "vds-escape", "vds-missing", "vds-unlisted",
            "symlinked-shard"]
ENTRY_POINTS = ["eval", "inspect", "convert", "init-from", "resume"]


@pytest.fixture(scope="module")
def good_run(tmp_path_factory, corpus_cache):
    """A one-rank serial run of 2 steps and its checkpoint."""
    cube = MpiCube(tmp_path_factory.mktemp("hostile"), corpus_cache)
    r = cube.run("train", *TINY, "--steps", "2", "--out", "good")
    assert r.returncode == 0, r
    assert checkpoint.latest(cube.cwd / "good") == cube.cwd / "good" / "ckpt" / STEP_DIR
    return cube.cwd / "good"


@pytest.fixture(scope="module")
def time_limit(good_run, corpus_cache):
    """SECONDS, or three times what a trivially refused command takes
    here, if the machine is so loaded that it takes more than a third of it."""
    cube = MpiCube(good_run.parent, corpus_cache)
    t0 = time.monotonic()
    cube.run("eval", good_run / "no-such-checkpoint")
    return max(SECONDS, 3 * (time.monotonic() - t0))


@pytest.fixture
def case(good_run, tmp_path):
    """(run, step, outside): this test's copy of the good run, its step
    directory, and a directory outside it (the commands' current directory)."""
    run, outside = tmp_path / "run", tmp_path / "outside"
    shutil.copytree(good_run, run)
    outside.mkdir()
    return run, run / "ckpt" / STEP_DIR, outside


def _limit_address_space():
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))


def run_limited(cube: MpiCube, cwd: Path, seconds: float, *args):
    """A command of one rank, in ``cwd``, every process of it (mpiexec's
    children inherit the limit) under ADDRESS_SPACE; (CompletedProcess, s).
    Past ``seconds`` it is killed and the test fails."""
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cube.command(*args), cwd=cwd, env=cube.env, capture_output=True, text=True,
                              timeout=seconds, preexec_fn=_limit_address_space)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"`mpicube {' '.join(map(str, args))}` still running after {seconds:.0f} s: {e.stderr}")
    return proc, time.monotonic() - t0


def assert_one_error(proc, message: str) -> None:
    text = proc.stdout + proc.stderr
    assert proc.returncode == 2, text
    assert "Traceback" not in text, text
    lines = [line for line in text.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, text
    assert re.search(message, lines[0]), (message, lines[0])


def files_of(path: Path) -> list:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


# --------------------------------------------------------------------------- in-process, every case


@pytest.mark.parametrize("name", list(CHECKPOINT_CASES))
def test_hostile_checkpoint_refused_by_the_library(case, name, monkeypatch):
    run, step, outside = case
    make, message = CHECKPOINT_CASES[name]
    make(step, outside)
    monkeypatch.chdir(outside)                     # where HDF5 looks for a relative source it cannot find
    with pytest.raises(checkpoint.CheckpointError, match=message):
        checkpoint.open_checkpoint(step).close()
    with pytest.raises(checkpoint.CheckpointError, match=message):
        formats.open_model(step).close()
    ok, report = checkpoint.inspect(step, expected=model_shapes)
    problems = [line for line in report.splitlines() if line.startswith("PROBLEM: ")]
    assert not ok and any(re.search(message, line) for line in problems), report


def test_good_checkpoint_passes_every_check(good_run):
    """The checks refuse nothing a save writes (here a one-rank save; the
    checkpoint tests load saves of every layout through the same checks)."""
    with checkpoint.open_checkpoint(good_run) as ck:
        for name in ck.names():
            problems, sources = ck.check_storage(name)
            assert not problems and set(sources) <= set(ck.shard_sha256), (name, problems, sources)
    assert checkpoint.inspect(good_run)[0]


# --------------------------------------------------------------------------- the command line


def entry_args(entry: str, run: Path, step: Path, outside: Path) -> list:
    if entry == "eval":
        return ["eval", step, "--layout", "serial"]
    if entry == "inspect":
        return ["inspect", step]
    if entry == "convert":
        return ["convert", step, outside / "hf", "--to", "hf"]
    if entry == "init-from":
        return ["train", *TINY, "--steps", "2", "--init-from", step, "--out", outside / "fresh"]
    return ["train", *TINY, "--steps", "4", "--resume", "--out", run]


def cli_cases() -> list:
    """The reported cases through every entry point (`--resume` for one of
    each kind: storage, link, virtual source), every other case through
    one, in turn."""
    out = [(name, entry) for name in REPORTED for entry in ENTRY_POINTS
           if entry != "resume" or name in ("external-storage", "elink-escape", "vds-missing")]
    others = [name for name in CHECKPOINT_CASES if name not in REPORTED]
    out += [(name, ENTRY_POINTS[k % len(ENTRY_POINTS)]) for k, name in enumerate(others)]
    return [pytest.param(name, entry, id=f"{name}-{entry}") for name, entry in out]


@pytest.mark.parametrize("name, entry", cli_cases())
def test_hostile_checkpoint_one_error(mpicube, case, time_limit, name, entry):
    run, step, outside = case
    make, message = CHECKPOINT_CASES[name]
    make(step, outside)
    before = files_of(run)
    proc, _ = run_limited(mpicube, outside, time_limit, *entry_args(entry, run, step, outside))
    if entry == "inspect":
        text = proc.stdout + proc.stderr
        assert proc.returncode == 1, text
        assert "Traceback" not in text and "error:" not in text and "result: FAILED" in proc.stdout, text
        problems = [line for line in proc.stdout.splitlines() if line.startswith("PROBLEM: ")]
        assert any(re.search(message, line) for line in problems), text
    else:
        assert_one_error(proc, message)
    assert files_of(run) == before                       # nothing written into the run
    assert not (outside / "hf").exists() and not (outside / "fresh" / "ckpt").exists()


# --------------------------------------------------------------------------- token shards


def shard_cli_cases() -> list:
    out = [(name, "train") for name in SHARD_CASES]
    out += [(name, "eval") for name in ("wrong-magic", "count-past-end", "fifo")]
    return [pytest.param(name, entry, id=f"{name}-{entry}") for name, entry in out]


@pytest.mark.parametrize("name, entry", shard_cli_cases())
def test_hostile_token_shard_one_error(mpicube, case, time_limit, name, entry):
    run, step, outside = case
    make, message = SHARD_CASES[name]
    bad = outside / "bad.bin"
    make(bad)
    if entry == "train":
        args = ["train", *TINY, "--steps", "2", "--data", bad, "--out", outside / "fresh"]
    else:
        args = ["eval", step, "--layout", "serial", "--data", bad]
    proc, _ = run_limited(mpicube, outside, time_limit, *args)
    assert_one_error(proc, rf"{re.escape(str(bad))}: {message}")
    assert not (outside / "fresh" / "ckpt").exists()


def test_shard_truncated_under_a_running_job(mpicube, tmp_path, time_limit):
    """Training reads windows of a shard; the shard is cut to its header
    plus a few tokens while the job runs. With a memory map the next read
    of a lost page was SIGBUS: a dead job and no message. Now: one line
    naming the file, exit 2, soon after the cut."""
    shard = raw_shard(tmp_path / "big.bin", tokens=1 << 17)
    args = ["train", *TINY, "--steps", "100000", "--log-every", "1", "--data", shard, "--out", tmp_path / "r"]
    proc = subprocess.Popen(mpicube.command(*args), cwd=tmp_path, env=mpicube.env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=_limit_address_space)
    try:
        for line in proc.stdout:                       # the job is training: it has read windows
            if line.startswith("step "):
                break
        else:
            pytest.fail(f"the job ended before its first step: {proc.communicate()}")
        t0 = time.monotonic()
        with open(shard, "r+b") as fh:                 # cut in place, as a copy over it would
            fh.truncate(HEADER_BYTES + 64)
        out, err = proc.communicate(timeout=time_limit)
        seconds = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    proc_result = subprocess.CompletedProcess(args, proc.returncode, out, err)
    assert_one_error(proc_result, rf"{re.escape(str(shard))}: token shard changed under this job")
    assert seconds < time_limit
