"""The run directory failing under a job (issue 24): a disk that fills up
while metrics.jsonl is appended to or a checkpoint is written, a read-only
file system. Each is one `error:` line naming the file and exit status 74,
after an attempt to checkpoint when training is under way; the last good
checkpoint is never touched. The disks are real: small tmpfs mounts
(tests/fs_faults.py; skipped without root). Every run is a real `mpiexec
... python -m mpicube`."""

import json
import math

import pytest
from conftest import TINY, read_metrics
from fs_faults import PAGE, fill, small_disks

from mpicube.files import checkpoint

pytestmark = pytest.mark.timeout(300)

EXIT_IO = 74
ONE_RANK_EACH = {"OMP_NUM_THREADS": "1"}


@pytest.fixture
def disks(tmp_path):
    with small_disks(tmp_path) as tools:
        yield tools


def only_error(r) -> str:
    """The one `error:` line of a failed run, with no traceback anywhere."""
    text = r.stdout + r.stderr
    assert "Traceback" not in text, r
    [line] = r.error_lines()
    return line


def pages_for_a_resume(run) -> int:
    """Free pages a resumed launch needs before its first metrics record:
    the lock, config.json rewritten with one more launch (old and new side by
    side for a moment), and one to spare."""
    return 2 + math.ceil(3 * (run / "config.json").stat().st_size / PAGE)


def test_full_disk_under_metrics_checkpoints_and_exits_74(mpicube, tmp_path, disks):
    """The run folder's disk fills while rank 0 appends to metrics.jsonl
    (the checkpoints live on another disk, mounted on RUN/ckpt): both ranks
    stop at the end of that step, save it, and exit 74 with one line; no
    torn line is left. Once the disk has room, --resume continues from the
    saved step."""
    mount, bind, _ = disks
    disk = mount(tmp_path / "disk", 1024)
    run = disk / "run"
    bind(tmp_path / "roomy", run / "ckpt")
    args = ["train", *TINY, "--dp", "2", "--steps", "3000", "--log-every", "1000", "--out", run]
    r = mpicube.run(*args, "--stop-after", "2", n=2, env=ONE_RANK_EACH)
    assert r.returncode == 0, r
    filler = fill(disk, pages_for_a_resume(run))

    r = mpicube.run(*args, "--resume", n=2, env=ONE_RANK_EACH)
    assert r.returncode == EXIT_IO, r
    line = only_error(r)
    steps = [rec["step"] for rec in read_metrics(run)[0]]            # every line whole
    s = steps[-1] + 1                                                # the step whose record did not fit
    assert 2 < s < 3000 and steps == list(range(1, s)), (steps, r)
    assert line == (f"error: {run}/metrics.jsonl: cannot append a record (No space left on device) after step {s}; "
                    f"saved {run}/ckpt/step_{s:08d}: fix the disk and continue with --resume"), r
    assert checkpoint.latest(run) == run / "ckpt" / f"step_{s:08d}"
    assert not (run / "mpicube.lock").exists()

    filler.unlink()
    r = mpicube.run(*args[:-4], "--steps", s + 2, "--out", run, "--resume", n=2, env=ONE_RANK_EACH)
    assert r.returncode == 0 and f"at step {s}" in r.stdout, r
    assert [rec["step"] for rec in read_metrics(run)[0]] == list(range(1, s)) + [s + 1, s + 2]


def test_full_disk_for_metrics_and_checkpoint_keeps_the_last_good_one(mpicube, tmp_path, disks):
    """The same on one disk: the save after the failed record fails too. One
    line says both, the checkpoint of step 2 stays as it was and loads, and
    the failed save leaves nothing behind."""
    mount, _, _ = disks
    disk = mount(tmp_path / "disk", 1024)
    run = disk / "run"
    args = ["train", *TINY, "--steps", "3000", "--log-every", "1000", "--out", run]
    r = mpicube.run(*args, "--stop-after", "2")
    assert r.returncode == 0, r
    fill(disk, pages_for_a_resume(run))

    r = mpicube.run(*args, "--resume")
    assert r.returncode == EXIT_IO, r
    line = only_error(r)
    s = read_metrics(run)[0][-1]["step"] + 1
    assert line.startswith(f"error: {run}/metrics.jsonl: cannot append a record (No space left on device) "
                           f"after step {s}; and the checkpoint failed too: saving checkpoint "
                           f"{run}/ckpt/step_{s:08d} failed"), r
    assert line.endswith(f"No space left on device; the last good checkpoint, {run}/ckpt/step_00000002, "
                         "is intact"), r
    assert len(line.replace(str(run), "RUN")) < 320, line
    assert sorted(p.name for p in (run / "ckpt").iterdir()) == ["latest", "step_00000002"]
    with checkpoint.open_checkpoint(run) as ck:                     # checksums verified
        assert ck.step == 2


def test_full_disk_during_a_save_is_one_short_line(mpicube, tmp_path, disks):
    """metrics.jsonl still has room, the periodic checkpoint of step 4 does
    not: every rank's HDF5 error used to be joined into one line of 3,000
    characters (exit 2); now it is the path and the errno text, exit 74."""
    mount, _, _ = disks
    disk = mount(tmp_path / "disk", 2048)
    run = disk / "run"
    args = ["train", *TINY, "--dp", "2", "--steps", "8", "--ckpt-every", "2", "--out", run]
    r = mpicube.run(*args, "--stop-after", "2", n=2, env=ONE_RANK_EACH)
    assert r.returncode == 0, r
    fill(disk, pages_for_a_resume(run) + 4)                         # room for metrics, not for a checkpoint

    r = mpicube.run(*args, "--resume", n=2, env=ONE_RANK_EACH)
    assert r.returncode == EXIT_IO, r
    line = only_error(r)
    assert line.startswith(f"error: saving checkpoint {run}/ckpt/step_00000004 failed (2 ranks), nothing was "
                           "committed: rank 0: No space left on device"), r
    assert line.endswith(f"; the last good checkpoint, {run}/ckpt/step_00000002, is intact"), r
    assert len(line.replace(str(run), "RUN")) < 200 and "HDF5" not in line and "errno =" not in line, line
    assert [rec["step"] for rec in read_metrics(run)[0]] == [1, 2, 3, 4]
    assert sorted(p.name for p in (run / "ckpt").iterdir()) == ["latest", "step_00000002"]


def test_read_only_run_directory_is_one_line(mpicube, tmp_path, disks):
    """A run folder on a file system that went read-only: the lock cannot be
    written; a new run folder there cannot be made. Exit 74, no traceback."""
    mount, _, read_only = disks
    disk = mount(tmp_path / "disk", 1024)
    r = mpicube.run("train", *TINY, "--steps", "2", "--out", disk / "run")
    assert r.returncode == 0, r
    read_only(disk)

    r = mpicube.run("train", *TINY, "--dp", "2", "--steps", "4", "--resume", "--out", disk / "run", n=2,
                    env=ONE_RANK_EACH)
    assert r.returncode == EXIT_IO, r
    assert only_error(r) == (f"error: {disk}/run/mpicube.lock: cannot take the run directory's lock "
                             "(Read-only file system)"), r
    r = mpicube.run("train", *TINY, "--steps", "2", "--out", disk / "new")
    assert r.returncode == EXIT_IO, r
    assert only_error(r) == f"error: --out {disk}/new: cannot create the run directory (Read-only file system)", r


def test_unwritable_config_and_metrics_name_the_file(mpicube, tmp_path):
    """Without a mount: config.json, then metrics.jsonl, that cannot be
    opened (a directory stands in their place) stop the launch before
    training, with one line naming the file and exit 74, on every rank."""
    (tmp_path / "run" / "config.json").mkdir(parents=True)
    r = mpicube.run("train", *TINY, "--dp", "2", "--steps", "2", "--out", "run", n=2, env=ONE_RANK_EACH)
    assert r.returncode == EXIT_IO, r
    assert only_error(r) == "error: run/config.json: cannot read the run's configuration (Is a directory)", r
    (tmp_path / "run" / "config.json").rmdir()
    (tmp_path / "run" / "metrics.jsonl").mkdir()
    r = mpicube.run("train", *TINY, "--dp", "2", "--steps", "2", "--out", "run", n=2, env=ONE_RANK_EACH)
    assert r.returncode == EXIT_IO, r
    assert only_error(r) == "error: run/metrics.jsonl: cannot open the run's metrics (Is a directory)", r
    assert json.loads((tmp_path / "run" / "config.json").read_text())["launches"]
    assert not (tmp_path / "run" / "mpicube.lock").exists()
