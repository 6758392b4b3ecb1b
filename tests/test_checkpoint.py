"""Checkpoints (docs/design.md section 6): real 4-rank saves, plain-h5py reads,
partial reads, keep/latest, corruption detection and atomic commit."""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import h5py
import numpy as np
import pytest

from mpicube.files import checkpoint as C
from mpirun import mpiexec

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SCRIPT = HERE / "ckpt_mpi_script.py"
_spec = importlib.util.spec_from_file_location("ckpt_mpi_script", SCRIPT)
S = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(S)

pytestmark = pytest.mark.timeout(120)


def _mpirun(mode: str, run_dir: Path, env_extra: dict | None = None):
    return mpiexec(S.NRANKS, ["-m", "mpi4py", SCRIPT, mode, run_dir], timeout=60, env=env_extra)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """One 4-rank launch: steps 1, 2, 3 with keep=2, then step 3 overwritten."""
    d = tmp_path_factory.mktemp("ckpt") / "run"
    p = _mpirun("save", d)
    assert p.returncode == 0 and "SAVE-OK" in p.stdout, p.stdout + p.stderr
    return d


@pytest.fixture
def copy_run(run_dir, tmp_path):
    dst = tmp_path / "run"
    shutil.copytree(run_dir, dst)
    return dst


def _expected_block(arr, index, shape):
    """numpy fancy-index of the expected array, padding positions -> 0."""
    padded = np.zeros(tuple(max(s, int(np.max(ix)) + 1) for s, ix in zip(shape, index)), arr.dtype)
    padded[tuple(slice(0, s) for s in shape)] = arr
    return padded[np.ix_(*index)]


# --------------------------------------------------------------------------
# committed layout, latest, keep

def test_layout_latest_and_keep(run_dir):
    ck = run_dir / "ckpt"
    assert sorted(p.name for p in ck.iterdir()) == ["latest", "step_00000002", "step_00000003"]
    assert (ck / "latest").read_text().strip() == "step_00000003"
    assert C.latest(run_dir) == ck / "step_00000003"
    shards = sorted(p.name for p in (ck / "step_00000003" / "shards").iterdir())
    assert shards == [f"rank_{r:05d}.h5" for r in range(4)]
    assert C.latest(run_dir.parent / "nothing-here") is None


def test_plain_h5py_reads_moved_copy(run_dir, tmp_path):
    """No mpicube, another cwd, the step dir moved: whole tensors, no padding."""
    moved = tmp_path / "elsewhere" / "my-checkpoint"
    shutil.copytree(run_dir / "ckpt" / "step_00000003", moved)
    np.savez(tmp_path / "expected.npz", **{k.replace("/", "|"): v
                                          for k, v in S.expected(3, version=1).items()})
    code = textwrap.dedent(f"""
        import json, sys, h5py, numpy as np
        assert not any(m.startswith("mpicube") for m in sys.modules)
        exp = np.load({str(tmp_path / 'expected.npz')!r})
        with h5py.File({str(moved / 'checkpoint.h5')!r}, "r") as f:
            assert f.attrs["format"] == "mpicube-checkpoint" and f.attrs["version"] == 1
            assert f.attrs["step"] == 3
            assert json.loads(f.attrs["config"])["vocab_size"] == 7
            assert json.loads(f.attrs["layout"])["ranks"] == 4
            for key in exp.files:
                name = key.replace("|", "/")
                got = f[name][()]
                assert got.shape == exp[key].shape and got.dtype == exp[key].dtype, name
                np.testing.assert_array_equal(got, exp[key], err_msg=name)
            assert f["model/test.qkv"].is_virtual
        print("PLAIN-OK")
    """)
    p = subprocess.run([sys.executable, "-I", "-c", code], cwd=str(tmp_path), capture_output=True,
                       text=True, timeout=60, env={k: v for k, v in os.environ.items()
                                                   if k != "PYTHONPATH"})
    assert p.returncode == 0 and "PLAIN-OK" in p.stdout, p.stdout + p.stderr


def test_read_blocks_attrs_and_paths(run_dir):
    ex3 = S.expected(3, version=1)
    for where in (run_dir, run_dir / "ckpt" / "step_00000003",
                  run_dir / "ckpt" / "step_00000003" / "checkpoint.h5"):
        with C.open_checkpoint(where) as ck:
            assert ck.step == 3 and ck.path == run_dir / "ckpt" / "step_00000003"
    with C.open_checkpoint(run_dir) as ck:
        assert ck.names() == sorted(ex3)
        assert ck.shape(S.A_NAME) == (10, 12) and ck.shape(S.W_NAME) == (7, 4)
        assert ck.shape(S.S_NAME) == ()
        assert ck.attrs["config"]["n_embd"] == 4              # JSON decoded
        assert ck.attrs["train"] == {"lr": 0.001, "batch_size": 4}
        assert ck.attrs["layout"] == {"name": "test", "ranks": 4}
        assert ck.attrs["note"] == "plain string" and ck.attrs["loss"] == 3.25
        for name, arr in ex3.items():
            np.testing.assert_array_equal(ck.read(name), arr, err_msg=name)
        # arbitrary, unordered, non-contiguous, with padding past the shape
        rows = np.array([7, 2, 3, 4, 9, 0, 11])
        cols = np.array([11, 0, 1, 2, 5, 6, 13, 3])
        got = ck.read(S.A_NAME, (rows, cols))
        np.testing.assert_array_equal(got, _expected_block(ex3[S.A_NAME], (rows, cols), (10, 12)))
        vrows, vcols = np.array([6, 7, 0, 5]), np.array([3, 1])
        got = ck.read(S.W_NAME, (vrows, vcols), dtype=np.float64)
        assert got.dtype == np.float64
        np.testing.assert_array_equal(got, _expected_block(ex3[S.W_NAME], (vrows, vcols), (7, 4)))
        np.testing.assert_array_equal(ck.read(S.P_NAME, (np.arange(8),)),
                                      _expected_block(ex3[S.P_NAME], (np.arange(8),), (5,)))
        with pytest.raises(C.CheckpointError, match="model/nope"):
            ck.read("model/nope")
        with pytest.raises(C.CheckpointError, match="negative"):
            ck.read(S.A_NAME, (np.array([-1]), np.array([0])))
    with C.open_checkpoint(run_dir / "ckpt" / "step_00000002") as ck:
        np.testing.assert_array_equal(ck.read(S.A_NAME), S.expected(2)[S.A_NAME])
    ok, report = C.inspect(run_dir)
    assert ok, report
    for text in ("result: OK", S.A_NAME, "(10, 12)", "float64", '"ranks": 4', "rank_00003.h5"):
        assert text in report


def test_many_runs_read_matches_fancy_index(run_dir):
    rng = np.random.default_rng(0)
    with C.open_checkpoint(run_dir, verify=False) as ck:
        for _ in range(5):
            rows = rng.permutation(12)[:rng.integers(1, 12)]
            cols = rng.permutation(15)[:rng.integers(1, 15)]
            np.testing.assert_array_equal(
                ck.read(S.A_NAME, (rows, cols)),
                _expected_block(S.expected(3, 1)[S.A_NAME], (rows, cols), (10, 12)))


def test_one_mapping_per_piece_in_index_files(run_dir):
    """checkpoint.h5 links each tensor to a virtual dataset in its owner's
    index file, which maps each rank's block once, however many runs it
    spans (the q | k | v columns of test.qkv are three per rank)."""
    step = run_dir / "ckpt" / "step_00000003"
    with h5py.File(step / "checkpoint.h5", "r") as f:
        link = f.get(S.A_NAME, getlink=True)
        assert isinstance(link, h5py.ExternalLink) and link.filename.startswith("index/rank_"), link
        files = [m.file_name for m in f[S.A_NAME].virtual_sources()]
    assert sorted(files) == [f"../shards/rank_{r:05d}.h5" for r in range(4)]
    assert len(list((step / "index").iterdir())) <= 4


def _verify_run(run: Path):
    p = _mpirun("verify", run)
    assert p.returncode == 0, p.stdout + p.stderr
    line = next(ln for ln in p.stdout.splitlines() if ln.startswith("VERIFY "))
    return json.loads(line[len("VERIFY "):])


def test_load_spreads_hashing_over_the_ranks(run_dir):
    """Opening on 4 ranks hashes every file once, each rank the files
    numbered like itself (on the saving layout, those it wrote and reads)."""
    ranks = _verify_run(run_dir)
    with C.open_checkpoint(run_dir, verify=False) as ck:
        files = sorted(ck.shard_sha256)
    assert all(error is None for _, error in ranks), ranks
    assert sorted(f for hashed, _ in ranks for f in hashed) == files
    for r, (hashed, _) in enumerate(ranks):
        assert hashed and all(f.endswith(f"rank_{r:05d}.h5") for f in hashed), (r, hashed)


def test_damage_found_by_one_rank_stops_every_rank(copy_run):
    shard = copy_run / "ckpt" / "step_00000003" / "shards" / "rank_00002.h5"
    raw = bytearray(shard.read_bytes())
    raw[-100] ^= 0xFF
    shard.write_bytes(bytes(raw))
    ranks = _verify_run(copy_run)
    assert [len(hashed) for hashed, _ in ranks] != [0] * 4
    errors = {error for _, error in ranks}
    assert len(errors) == 1 and "rank_00002.h5: shard file is corrupt" in errors.pop(), ranks


# --------------------------------------------------------------------------
# damage is detected and named

def test_flipped_byte_in_shard(copy_run):
    shard = copy_run / "ckpt" / "step_00000003" / "shards" / "rank_00002.h5"
    with h5py.File(shard, "r") as f:
        off = f[S.A_NAME].id.get_chunk_info(0).byte_offset
    with open(shard, "r+b") as fh:
        fh.seek(off + 5)
        b = fh.read(1)
        fh.seek(off + 5)
        fh.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(C.CheckpointError, match="rank_00002.h5.*corrupt"):
        C.open_checkpoint(copy_run)
    ok, report = C.inspect(copy_run)
    assert not ok
    bad = [ln for ln in report.splitlines() if ln.startswith("PROBLEM")]
    assert bad and all("rank_00002.h5" in ln for ln in bad), report
    assert any("sha256" in ln for ln in bad) and any(S.A_NAME in ln for ln in bad), report


def test_missing_shard(copy_run):
    (copy_run / "ckpt" / "step_00000003" / "shards" / "rank_00001.h5").unlink()
    with pytest.raises(C.CheckpointError, match="rank_00001.h5.*missing"):
        C.open_checkpoint(copy_run)
    ok, report = C.inspect(copy_run)
    assert not ok and "rank_00001.h5" in report and "MISSING" in report


def test_truncated_checkpoint_file(copy_run):
    f = copy_run / "ckpt" / "step_00000003" / "checkpoint.h5"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 3])
    with pytest.raises(C.CheckpointError, match="checkpoint.h5"):
        C.open_checkpoint(copy_run)
    ok, report = C.inspect(copy_run)
    assert not ok and "checkpoint.h5" in report


def test_wrong_version_and_format(copy_run):
    f = copy_run / "ckpt" / "step_00000003" / "checkpoint.h5"
    with h5py.File(f, "r+") as h:
        h.attrs["version"] = 2
    with pytest.raises(C.CheckpointError, match="'version' is 2"):
        C.open_checkpoint(copy_run)
    with h5py.File(f, "r+") as h:
        h.attrs["version"] = 1
        del h.attrs["format"]
    with pytest.raises(C.CheckpointError, match="'format' is missing"):
        C.open_checkpoint(f)
    assert not C.inspect(f)[0]


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(C.CheckpointError, match="no checkpoint found"):
        C.open_checkpoint(tmp_path)
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "latest").write_text("step_00000009\n")
    with pytest.raises(C.CheckpointError, match="step_00000009"):
        C.open_checkpoint(tmp_path)


# --------------------------------------------------------------------------
# atomic commit under failures

def test_failed_saves_keep_previous_checkpoint(copy_run):
    p = _mpirun("fault", copy_run, {"CKPT_FAULT_RANK": "2"})
    out = p.stdout + p.stderr
    assert p.returncode != 0, out
    assert "RENAME-FAULT-OK" in p.stdout, out
    assert "injected fault on rank 2" in out and "UNREACHABLE" not in out, out
    ck = copy_run / "ckpt"
    assert sorted(q.name for q in ck.iterdir()) == ["latest", "step_00000002", "step_00000003"]
    assert C.latest(copy_run) == ck / "step_00000003"
    with C.open_checkpoint(copy_run) as c:
        assert c.step == 3
        for name, arr in S.expected(3, version=1).items():
            np.testing.assert_array_equal(c.read(name), arr, err_msg=name)


# --------------------------------------------------------------------------
# single process (comm=None): argument checks

def _blk(name, arr, shape, index, writer=True):
    return C.Block(name, np.asarray(arr), shape, tuple(np.asarray(i) for i in index), writer)


def test_serial_save_and_cover_checks(tmp_path):
    x = np.arange(12.0).reshape(3, 4)
    good = [_blk("model/x", x[:, :2], (3, 4), (np.arange(3), [0, 1])),
            _blk("model/x", x[:, 2:], (3, 4), (np.arange(3), [2, 3]))]
    p = C.save(tmp_path, 5, good, {"layout": "serial"})
    with C.open_checkpoint(tmp_path) as ck:
        np.testing.assert_array_equal(ck.read("model/x"), x)
        assert ck.attrs["layout"] == "serial" and ck.step == 5
    bad_cases = [
        ([good[0]], "element \\(0, 2\\) is not written"),                       # gap
        (good + [_blk("model/x", x[:1, :1], (3, 4), ([0], [0]))], "written 2 times"),
        ([_blk("model/x", x, (3, 4), (np.arange(3), np.arange(4)), writer=False)], "no rank"),
        ([_blk("model/x", x[:, :3], (3, 4), (np.arange(3), [0, 1, 1]))], "repeated"),
        ([_blk("model/x", x, (3, 4), (np.arange(2), np.arange(4)))], "local array shape"),
    ]
    for blocks, msg in bad_cases:
        with pytest.raises(C.CheckpointError, match=msg) as e:
            C.save(tmp_path, 6, blocks, {}, keep=1)
        assert "step_00000006" in str(e.value)
    assert sorted(q.name for q in (tmp_path / "ckpt").iterdir()) == ["latest", p.name]
    with pytest.raises(C.CheckpointError, match="reserved"):
        C.save(tmp_path, 6, good, {"version": 3})


# --------------------------------------------------------------------------
# a run directory after jobs that died

def test_latest_falls_back_and_recover_restores(copy_run):
    """A job killed between the commit's renames while overwriting step 3
    leaves `latest` naming a step that is not there: `latest` falls back to
    the newest complete checkpoint (saying so), and `recover` moves the
    step aside back."""
    ck = copy_run / "ckpt"
    aside = ck / ".old_step_00000003_0badf00d"
    os.replace(ck / "step_00000003", aside)
    notes = []
    assert C.latest(copy_run, notes) == ck / "step_00000002"
    assert len(notes) == 1 and "'step_00000003', which is not a complete checkpoint" in notes[0], notes
    with C.open_checkpoint(copy_run) as c:
        assert c.step == 2
    (ck / ".tmp_step_00000004_dead_0123").mkdir()
    done = C.recover(copy_run)
    assert any("restored" in line for line in done) and any(".tmp_step_00000004" in line for line in done), done
    assert sorted(p.name for p in ck.iterdir()) == ["latest", "step_00000002", "step_00000003"]
    assert C.latest(copy_run) == ck / "step_00000003"
    (ck / "latest").unlink()
    assert C.latest(copy_run) == ck / "step_00000003"          # no `latest` at all: the newest complete


def test_save_removes_only_its_own_temporary_dirs(tmp_path):
    """Another saver's temporary directory (a job still writing, as far as
    this one can know) survives this saver's pruning."""
    x = np.arange(6.0).reshape(2, 3)
    block = [_blk("model/x", x, (2, 3), (np.arange(2), np.arange(3)))]
    C.save(tmp_path, 1, block, owner="first")
    theirs = tmp_path / "ckpt" / ".tmp_step_00000007_other_0a1b2c"
    theirs.mkdir()
    (theirs / "checkpoint.h5").write_bytes(b"in progress")
    C.save(tmp_path, 2, block, keep=1, owner="second")
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [theirs.name, "latest", "step_00000002"]
    with pytest.raises(C.CheckpointError, match="owner"):
        C.save(tmp_path, 3, block, owner="not/this")


def test_metadata_benchmark_runs(capsys):
    """tools/ckpt_meta_bench.py at a small size: every tensor of the model
    indexed, one mapping per writer block (the 3-D weights are unique to
    each of the 8 ranks)."""
    spec = importlib.util.spec_from_file_location("ckpt_meta_bench", ROOT / "tools" / "ckpt_meta_bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    figures = bench.main(["--ranks", "8", "--n-layer", "1", "--n-embd", "64", "--n-head", "4", "--seq-len", "16"])
    assert figures["tensors"] == 3 * (4 + 12)
    weights = 3 * (4 + 1)                    # c_attn, c_proj, c_fc, mlp.c_proj, wte; with m and v
    assert figures["mappings"] >= weights * 8
    assert "rank 0:" in capsys.readouterr().out


def test_a_failed_fsync_fails_the_save_and_keeps_the_last_checkpoint(tmp_path, monkeypatch):
    """fsync's EIO means the shard may not be on disk: the save fails,
    nothing is committed, and the previous checkpoint is still `latest`.
    EINVAL (a file system with nothing to flush) is not a failure."""
    import errno
    import os

    from mpicube.files import atomic

    x = np.arange(12.0).reshape(3, 4)
    good = [_blk("model/x", x, (3, 4), (np.arange(3), np.arange(4)))]
    first = C.save(tmp_path, 1, good, {})
    real_fsync = os.fsync

    def failing(code):
        def fsync(fd):
            raise OSError(code, os.strerror(code))
        return fsync

    monkeypatch.setattr(atomic.os, "fsync", failing(errno.EINVAL))
    C.save(tmp_path, 2, good, {})
    monkeypatch.setattr(atomic.os, "fsync", failing(errno.EIO))
    with pytest.raises(C.CheckpointError, match="Input/output error"):
        C.save(tmp_path, 3, good, {})
    monkeypatch.setattr(atomic.os, "fsync", real_fsync)
    with C.open_checkpoint(tmp_path) as ck:
        assert ck.step == 2
        np.testing.assert_array_equal(ck.read("model/x"), x)
    assert first.exists() and not (tmp_path / "ckpt" / "step_00000003").exists()
