"""Damaged checkpoints, end to end through the command line.

* ``kill -9`` of one rank while a run saves: the previous checkpoint stays
  the committed one and still loads, inspects and resumes.
* A corrupted byte in a shard (caught by the sha256 check on rank 0, or,
  with the digest rewritten, only by the fletcher32 check on the one rank
  that reads it), a deleted shard, a truncated checkpoint.h5, a wrong format
  version and a checkpoint of another model shape, each read through every
  entry point that reads checkpoints (`eval`, `inspect`, `train --init-from`,
  `train --resume`): one clear message naming the file or tensor, a non-zero
  exit, no traceback, nothing written, and (on 2 ranks) no hang (a hang
  would end in MPIEXEC_TIMEOUT's kill, not in exit status 2).

One good 2-rank (1-D) run is made per module; every test damages its own copy.
"""

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import time

import h5py
import pytest
from mpirun import rank_pid
from conftest import MpiCube, last_json, read_metrics

from mpicube.files import checkpoint

pytestmark = pytest.mark.timeout(300)

NRANKS = 2
MODEL = ["--layout", "1d", "--n-layer", "2", "--n-head", "2", "--n-embd", "16", "--seq-len", "16",
         "--batch-size", "4", "--steps", "4"]
GOOD_STEP = 2
STEP_DIR = f"step_{GOOD_STEP:08d}"
SHARD = "rank_00001.h5"                  # written by rank 1, not by the rank that commits
TENSOR = "model/wte"                     # split over both ranks by the 1-D layout


@pytest.fixture(scope="module")
def good_run(tmp_path_factory, corpus_cache):
    """A 2-rank run stopped after step 2 with its checkpoint (the schedule runs to step 4)."""
    cube = MpiCube(tmp_path_factory.mktemp("faults"), corpus_cache)
    r = cube.run("train", *MODEL, "--stop-after", GOOD_STEP, "--out", "good", n=NRANKS)
    assert r.returncode == 0, r
    run = cube.cwd / "good"
    step = run / "ckpt" / STEP_DIR
    assert checkpoint.latest(run) == step
    assert sorted(p.name for p in (step / "shards").iterdir()) == ["rank_00000.h5", SHARD]
    with h5py.File(step / "shards" / SHARD, "r") as f:
        assert TENSOR in f
    return run


@pytest.fixture
def cube(tmp_path, corpus_cache) -> MpiCube:
    return MpiCube(tmp_path, corpus_cache)


@pytest.fixture
def run(good_run, tmp_path):
    """This test's copy of the good run."""
    dst = tmp_path / "run"
    shutil.copytree(good_run, dst)
    return dst


def visible(ckpt_dir) -> list:
    return sorted(p.name for p in ckpt_dir.iterdir() if not p.name.startswith("."))


# --------------------------------------------------------------------------- kill -9 during a save


def stopped(pid) -> bool:
    """Whether process ``pid`` is stopped (state T in /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except OSError:
        return False


def test_kill_9_during_save_keeps_previous_checkpoint(cube, run):
    """Resume to step 4; rank 1 stops itself (SIGSTOP, a test hook) as it
    starts saving step 4, while rank 0 has begun the save and waits for it;
    then rank 1 is killed with SIGKILL. Nothing of step 4 may become
    visible, and the step-2 checkpoint must still be `latest` and load
    everywhere. The test waits for states (rank 1 stopped, rank 0's
    temporary directory there), never for a number of milliseconds."""
    ckpt = run / "ckpt"
    cmd = cube.command("train", *MODEL, "--resume", "--out", run, n=NRANKS,
                       env={"MPICUBE_TEST_SIGNAL_IN_SAVE": "1:4:STOP"})
    proc = subprocess.Popen(cmd, cwd=cube.cwd, env=cube.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        deadline = time.monotonic() + 60
        rank1 = None
        while rank1 is None or not stopped(rank1) or not list(ckpt.glob(".tmp_step_00000004_*")):
            assert proc.poll() is None, ("the run ended before saving step 4", proc.communicate())
            assert time.monotonic() < deadline, "rank 1 did not stop in the step-4 save within 60 s"
            rank1 = rank1 or rank_pid(proc.pid, 1)
            time.sleep(0.05)
        os.kill(rank1, signal.SIGKILL)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode != 0, (out, err)
    logged = [(s["step"], s["loss"]) for s in read_metrics(run)[0]]
    assert [s for s, _ in logged] == [1, 2, 3, 4], (out, err)

    # the kill landed before the commit: step 4 exists only as hidden debris
    assert visible(ckpt) == ["latest", STEP_DIR], (sorted(os.listdir(ckpt)), out, err)
    assert [p.name for p in ckpt.glob(".tmp_step_00000004_*")], sorted(os.listdir(ckpt))
    assert (ckpt / "latest").read_text().strip() == STEP_DIR
    assert checkpoint.latest(run) == ckpt / STEP_DIR

    r = cube.run("inspect", run)
    assert r.returncode == 0 and "result: OK" in r.stdout and f"step {GOOD_STEP}" in r.stdout, r
    r = cube.run("eval", run, "--layout", "1d", n=NRANKS)
    assert r.returncode == 0, r
    result = last_json(r.stdout)
    assert result["step"] == GOOD_STEP and result["checkpoint"].endswith(STEP_DIR), result

    # resuming again repeats steps 3 and 4 exactly, commits step 4 and clears the debris
    r = cube.run("train", *MODEL, "--resume", "--out", run, n=NRANKS)
    assert r.returncode == 0, r
    assert f"resuming from {ckpt / STEP_DIR} at step {GOOD_STEP}" in r.stdout, r
    assert [(s["step"], s["loss"]) for s in read_metrics(run)[0]] == logged
    assert sorted(os.listdir(ckpt)) == ["latest", STEP_DIR, "step_00000004"]
    assert checkpoint.inspect(run)[0]


# --------------------------------------------------------------------------- damaged checkpoints


def flip_byte(step):
    """One bit pattern changed in the stored data of a tensor in rank 1's shard."""
    shard = step / "shards" / SHARD
    with h5py.File(shard, "r") as f:
        info = f[TENSOR].id.get_chunk_info(0)
    offset = info.byte_offset + info.size // 2
    with open(shard, "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)[0]
        fh.seek(offset)
        fh.write(bytes([byte ^ 0x5A]))


def flip_byte_keep_digest(step):
    """The same damage, but the shard's recorded sha256 is of the damaged file
    (as if the bits flipped before the writer hashed them): no check on rank 0
    sees it; only the fletcher32 checksum fails, on rank 1, which alone reads
    that block when loading on the saving layout."""
    flip_byte(step)
    digest = hashlib.sha256((step / "shards" / SHARD).read_bytes()).hexdigest()
    with h5py.File(step / "checkpoint.h5", "r+") as f:
        digests = json.loads(f.attrs["shard_sha256"])
        digests[f"shards/{SHARD}"] = digest
        f.attrs["shard_sha256"] = json.dumps(digests)


def delete_shard(step):
    (step / "shards" / SHARD).unlink()


def truncate_main(step):
    f = step / "checkpoint.h5"
    raw = f.read_bytes()
    f.write_bytes(raw[: len(raw) // 2])


def bump_version(step):
    with h5py.File(step / "checkpoint.h5", "r+") as f:
        f.attrs["version"] = 2


def claim_other_shape(step):
    """For `eval` and `inspect`, which take the model from the checkpoint: its
    config attribute names a model of another shape than its tensors."""
    with h5py.File(step / "checkpoint.h5", "r+") as f:
        config = json.loads(f.attrs["config"])
        config["n_embd"] = 32
        f.attrs["config"] = json.dumps(config)


# fault: (damage applied to the step dir, message of eval and train, problem
# inspect must report). "other-shape" for train is instead a command asking
# for another model than the (intact) checkpoint's.
FAULTS = {
    "corrupt-byte": (flip_byte, rf"{STEP_DIR}/shards/{SHARD}: shard file is corrupt \(sha256",
                     rf"{STEP_DIR}/shards/{SHARD}: .*corrupt"),
    "corrupt-chunk": (flip_byte_keep_digest,
                      rf"^error: rank 1: .*{STEP_DIR}/checkpoint\.h5: tensor '{TENSOR}': read failed",
                      rf"{STEP_DIR}/shards/{SHARD}: dataset '{TENSOR}' unreadable"),
    "deleted-shard": (delete_shard, rf"{STEP_DIR}/shards/{SHARD}: shard file is missing",
                      rf"{STEP_DIR}/shards/{SHARD}.* missing"),
    "truncated": (truncate_main, rf"{STEP_DIR}/checkpoint\.h5: cannot open checkpoint \(truncated",
                  rf"{STEP_DIR}/checkpoint\.h5: cannot open checkpoint \(truncated"),
    "version": (bump_version, rf"{STEP_DIR}/checkpoint\.h5: attribute 'version' is 2; this mpicube reads version 1",
                rf"{STEP_DIR}/checkpoint\.h5: attribute 'version' is 2"),
    "other-shape": (claim_other_shape,
                    rf"{STEP_DIR}: tensor 'model/[^']+' has shape \([^)]*16[^)]*\) but this model needs "
                    rf"\([^)]*32[^)]*\)",
                    r"(config|n_embd).*(tensor|shape)|(tensor|shape).*(config|n_embd)"),
}
ENTRY_POINTS = ["eval", "inspect", "init-from", "resume"]

CASES = [pytest.param(fault, entry, id=f"{fault}-{entry}") for fault in FAULTS for entry in ENTRY_POINTS]


@pytest.mark.parametrize("fault, entry", CASES)
def test_damaged_checkpoint_gives_one_clear_error(cube, run, fault, entry):
    damage, message, problem = FAULTS[fault]
    step = run / "ckpt" / STEP_DIR
    model = list(MODEL)
    if fault == "other-shape" and entry in ("init-from", "resume"):
        model[model.index("--n-embd") + 1] = "32"        # the checkpoint is of the 16-wide model
    else:
        damage(step)
    before = sorted(str(p.relative_to(run)) for p in run.rglob("*"))

    if entry == "inspect":
        r = cube.run("inspect", run)
        text = r.stdout + r.stderr
        assert r.returncode == 1, r
        assert "Traceback" not in text and not r.error_lines(), r
        assert "result: FAILED" in r.stdout, r
        problems = [line for line in r.stdout.splitlines() if line.startswith("PROBLEM: ")]
        assert any(re.search(problem, line) for line in problems), r
        return

    if entry == "eval":
        r = cube.run("eval", step, "--layout", "1d", n=NRANKS)
    elif entry == "init-from":
        r = cube.run("train", *model, "--init-from", step, "--out", "fresh", n=NRANKS)
    else:
        r = cube.run("train", *model, "--resume", "--out", run, n=NRANKS)
    text = r.stdout + r.stderr
    assert r.returncode == 2, r
    assert "Traceback" not in text, r
    lines = r.error_lines()
    assert len(lines) == 1, r
    assert re.search(message, lines[0]), r
    if fault != "corrupt-chunk":                  # found by verification: agreed by both ranks
        assert not lines[0].startswith("error: rank "), r
    # nothing was written: not a checkpoint, not the run's files
    assert sorted(str(p.relative_to(run)) for p in run.rglob("*")) == before
    if entry == "init-from":
        assert not (cube.cwd / "fresh" / "ckpt").exists()
