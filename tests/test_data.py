import multiprocessing
import sys
import sysconfig

import numpy as np
import pytest

from mpicube.files import data
from mpicube.files.shards import HEADER_INTS
from mpicube.files.data import (MAGIC, VERSION, DataError, TokenShard, TrainLoader, builtin_corpus,
                                decode_tokens, encode_bytes, eval_batch, eval_batch_count, prepare,
                                read_shard, write_shard)

HEADER_BYTES = HEADER_INTS * 4


def raw_shard(path, header_values, tokens, extra=b""):
    """Write a shard by hand, bypassing write_shard, to build broken files."""
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[: len(header_values)] = header_values
    path.write_bytes(header.tobytes() + np.asarray(tokens, dtype="<u2").tobytes() + extra)
    return path


# --------------------------------------------------------------------------- shards


def test_shard_round_trip(tmp_path):
    tokens = np.array([0, 1, 255, 256, 65535, 42], dtype=np.int64)
    path = tmp_path / "a.bin"
    write_shard(path, tokens)
    raw = path.read_bytes()
    assert len(raw) == HEADER_BYTES + 2 * len(tokens)
    header = np.frombuffer(raw[:HEADER_BYTES], dtype="<i4")
    assert header[:3].tolist() == [MAGIC, VERSION, len(tokens)]
    assert not header[3:].any()
    got = read_shard(path)
    assert isinstance(got, TokenShard) and len(got) == len(tokens)       # read on demand, never memory-mapped
    assert got.dtype == np.uint16
    assert np.asarray(got).tolist() == tokens.tolist()
    assert got[1:4].tolist() == [1, 255, 256] and got[::-2].tolist() == [42, 256, 1] and int(got[-2]) == 65535
    assert [p.name for p in tmp_path.iterdir()] == ["a.bin"]  # no temp file left behind


def test_wide_shard_holds_llama3_ids(tmp_path):
    """Ids past 65,535 (Llama 3's vocabulary of 128,256) go to llm.c's
    uint32 layout: magic 20240801, version 7; read back as written, and
    batched like any shard."""
    tokens = np.array([0, 65535, 65536, 128255, 7, 2**32 - 1], dtype=np.int64)
    path = tmp_path / "w.bin"
    write_shard(path, tokens)
    raw = path.read_bytes()
    assert len(raw) == HEADER_BYTES + 4 * len(tokens)
    assert np.frombuffer(raw[:12], dtype="<i4").tolist() == [20240801, 7, len(tokens)]
    got = read_shard(path)
    assert got.dtype == np.uint32 and np.asarray(got).tolist() == tokens.tolist()
    assert got[2:4].tolist() == [65536, 128255] and got.rows([1, 3], 2).tolist() == [[65535, 65536], [128255, 7]]
    x, y = eval_batch(got, 2, 2, 0)
    assert x.tolist() == [[0, 65535], [65536, 128255]] and y.tolist() == [[65535, 65536], [128255, 7]]
    with pytest.raises(DataError, match="outside the model's vocabulary of 128256"):
        data.check_vocab(got, 128256, path)
    raw_shard(tmp_path / "mixed.bin", [20240801, 1, 3], [1, 2, 3, 4, 5, 6])      # wide magic, narrow version
    with pytest.raises(DataError, match="version 1 .expected 7 with magic 20240801"):
        read_shard(tmp_path / "mixed.bin")


def test_write_shard_replaces_and_rejects_out_of_range(tmp_path):
    path = tmp_path / "a.bin"
    write_shard(path, [1, 2, 3])
    write_shard(path, [7])
    assert np.asarray(read_shard(path)).tolist() == [7]
    with pytest.raises(DataError, match="from 0 to 4,294,967,295"):
        write_shard(path, [2**32])
    with pytest.raises(DataError, match="from 0 to"):
        write_shard(path, [-1])
    with pytest.raises(DataError, match="must be integers"):
        write_shard(path, [1.5])
    assert np.asarray(read_shard(path)).tolist() == [7]


def test_empty_shard_round_trip(tmp_path):
    write_shard(tmp_path / "e.bin", np.zeros(0, dtype=np.uint16))
    assert read_shard(tmp_path / "e.bin").shape == (0,)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda p: raw_shard(p, [MAGIC + 1, VERSION, 3], [1, 2, 3]), "wrong magic"),
        (lambda p: raw_shard(p, [MAGIC, VERSION + 1, 3], [1, 2, 3]), "version"),
        (lambda p: raw_shard(p, [MAGIC, VERSION, 4], [1, 2, 3]), "size mismatch"),  # truncated body
        (lambda p: raw_shard(p, [MAGIC, VERSION, 3], [1, 2, 3], extra=b"xx"), "size mismatch"),  # extra bytes
        (lambda p: p.write_bytes(b"\0" * (HEADER_BYTES - 1)), "shorter than"),  # truncated header
        (lambda p: None, "not found"),  # missing file
    ],
    ids=["magic", "version", "truncated", "extra", "short-header", "missing"],
)
def test_read_shard_rejects(tmp_path, make, message):
    path = tmp_path / "bad.bin"
    make(path)
    with pytest.raises(DataError, match=message) as info:
        read_shard(path)
    assert str(path) in str(info.value)


# --------------------------------------------------------------------------- tokenizer


def test_encode_decode():
    text = "héllo\n"
    tokens = encode_bytes(text.encode())
    assert tokens.dtype == np.uint16
    assert tokens.tolist() == list(text.encode())
    assert decode_tokens(tokens) == text
    assert decode_tokens(tokens[:2]) == "h\ufffd"  # cut mid-character
    assert data.VOCAB_SIZE == 256


# --------------------------------------------------------------------------- prepare


def test_prepare_exact_bytes_and_split(tmp_path):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "b.txt").write_bytes(b"BBB")
    (src / "a.py").write_bytes(b"AA")
    (src / "sub" / "c.md").write_bytes(b"C")
    (src / "z.rst").write_bytes(b"ZZZZ")
    (src / "skip.bin").write_bytes(b"nope")
    single = tmp_path / "single.dat"  # named explicitly: included whatever its suffix
    single.write_bytes(b"0123456789")

    out = tmp_path / "out" / "corpus.bin"
    train, val = prepare([src, single], out, val_fraction=0.2)
    assert train == out
    assert val == tmp_path / "out" / "corpus_val.bin"

    # a.py, b.txt, sub/c.md, z.rst, then single.dat: 25 bytes, the last round(25 * 0.2) = 5 are val
    assert bytes(np.asarray(read_shard(train)).astype(np.uint8)) == b"AA\nBBB\nC\nZZZZ\n012345"
    assert bytes(np.asarray(read_shard(val)).astype(np.uint8)) == b"6789\n"


@pytest.mark.parametrize(
    "setup, message",
    [
        (lambda d: None, "no input files"),
        (lambda d: (d / "empty.txt").write_bytes(b""), "empty"),
        (lambda d: (d / "x.txt").write_bytes(b"x"), "too small"),  # 2 tokens, val would take both
    ],
)
def test_prepare_rejects(tmp_path, setup, message):
    src = tmp_path / "src"
    src.mkdir()
    setup(src)
    with pytest.raises(DataError, match=message):
        prepare([src], tmp_path / "c.bin", val_fraction=0.9)
    assert not (tmp_path / "c.bin").exists()


def test_prepare_missing_input(tmp_path):
    with pytest.raises(DataError, match="not found"):
        prepare([tmp_path / "nope"], tmp_path / "c.bin")


# --------------------------------------------------------------------------- built-in corpus


def test_builtin_corpus_file_selection(tmp_path, monkeypatch):
    fake = tmp_path / "stdlib"
    files = {
        "os.py": b"os",
        "json/decoder.py": b"dec",
        "json/__init__.py": b"init",
        "json.py": b"j",  # after json/ : order is by path components, not by string
        "notes.txt": b"not python",
        "test_os.py": b"x",
        "test/foo.py": b"x",
        "json/tests/t.py": b"x",
        "site-packages/pkg.py": b"x",
        "dist-packages/pkg.py": b"x",
        "idlelib/idle.py": b"x",
        "idlelib/idle_test/t.py": b"x",
        "lib2to3/fixer.py": b"x",
        "__pycache__/os.py": b"x",
    }
    for rel, content in files.items():
        (fake / rel).parent.mkdir(parents=True, exist_ok=True)
        (fake / rel).write_bytes(content)
    monkeypatch.setattr(data.sysconfig, "get_paths", lambda: {"stdlib": str(fake)})

    train, val = builtin_corpus(tmp_path / "cache")
    stream = b"init\ndec\nj\nos\n"  # json/__init__.py, json/decoder.py, json.py, os.py
    got = b"".join(bytes(np.asarray(read_shard(p)).astype(np.uint8)) for p in (train, val))
    assert got == stream
    assert len(read_shard(val)) == 1  # max(1, round(14 * 0.05))


@pytest.fixture(scope="module")
def real_corpus(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    return cache, builtin_corpus(cache)


def test_builtin_corpus_real(real_corpus):
    cache, (train, val) = real_corpus
    assert train.parent == cache and train.name.startswith("stdlib-py3.") and train.suffix == ".bin"
    assert val == train.with_name(train.stem + "_val.bin")
    n_train, n_val = len(read_shard(train)), len(read_shard(val))
    assert n_train + n_val > 5_000_000
    assert n_val == max(1, round((n_train + n_val) * 0.05))

    files = data._stdlib_files()
    root = sysconfig.get_paths()["stdlib"]
    rels = [f.relative_to(root) for f in files]
    assert rels == sorted(rels, key=lambda r: r.parts)
    for r in rels:
        assert not set(r.parts[:-1]) & data.STDLIB_EXCLUDED_DIRS, r
        assert not r.name.startswith("test_") and r.suffix == ".py", r
    names = {r.as_posix() for r in rels}
    assert {"os.py", "json/decoder.py"} <= names
    # the shards hold exactly these files plus one separator each
    assert n_train + n_val == sum(f.stat().st_size + 1 for f in files)


def test_builtin_corpus_reused(real_corpus, monkeypatch):
    cache, (train, val) = real_corpus
    before = [(p.stat().st_mtime_ns, p.stat().st_ino) for p in (train, val)]
    monkeypatch.setattr(data, "_stdlib_files", lambda: pytest.fail("corpus was rebuilt"))
    assert builtin_corpus(cache) == (train, val)
    assert [(p.stat().st_mtime_ns, p.stat().st_ino) for p in (train, val)] == before


def test_builtin_corpus_default_cache_env(tmp_path, monkeypatch):
    fake = tmp_path / "stdlib"
    fake.mkdir()
    (fake / "a.py").write_bytes(b"print(1)\n" * 10)
    monkeypatch.setattr(data.sysconfig, "get_paths", lambda: {"stdlib": str(fake)})
    monkeypatch.setenv("MPICUBE_CACHE", str(tmp_path / "envcache"))
    train, _ = builtin_corpus()
    assert train.parent == tmp_path / "envcache"


def test_builtin_corpus_rebuilds_damaged_cache(tmp_path, monkeypatch):
    fake = tmp_path / "stdlib"
    fake.mkdir()
    (fake / "a.py").write_bytes(b"print(1)\n" * 10)
    monkeypatch.setattr(data.sysconfig, "get_paths", lambda: {"stdlib": str(fake)})
    train, val = builtin_corpus(tmp_path / "c")
    expected, expected_val = np.asarray(read_shard(train)).tolist(), np.asarray(read_shard(val)).tolist()
    train.write_bytes(b"garbage")
    assert builtin_corpus(tmp_path / "c") == (train, val)
    assert np.asarray(read_shard(train)).tolist() == expected
    val.unlink()
    assert builtin_corpus(tmp_path / "c") == (train, val)
    assert np.asarray(read_shard(val)).tolist() == expected_val


def _corpus_worker(cache):
    return [p.read_bytes() for p in builtin_corpus(cache)]


def test_builtin_corpus_concurrent_ranks(tmp_path, monkeypatch):
    fake = tmp_path / "stdlib"
    fake.mkdir()
    for i in range(20):
        (fake / f"m{i:02d}.py").write_bytes(bytes([65 + i]) * 100_000)
    monkeypatch.setattr(data.sysconfig, "get_paths", lambda: {"stdlib": str(fake)})
    cache = tmp_path / "cache"
    ctx = multiprocessing.get_context("fork")  # forked children inherit the patched stdlib path
    with ctx.Pool(4) as pool:
        results = pool.map(_corpus_worker, [cache] * 4)
    assert all(r == results[0] for r in results)
    assert len(results[0][0]) == HEADER_BYTES + 2 * (2_000_020 - 100_001)
    version = "%d.%d" % sys.version_info[:2]
    assert sorted(p.name for p in cache.iterdir()) == [f"stdlib-py{version}.bin", f"stdlib-py{version}_val.bin"]


# --------------------------------------------------------------------------- TrainLoader

T, B, N_WINDOWS = 4, 3, 10
TOKENS = np.arange(N_WINDOWS * T + 1 + 2, dtype=np.uint16) + 300  # 2 spare tokens that start no window


def window_ids(x):
    return ((x[:, 0] - 300) // T).tolist()


def test_loader_shapes_and_shift():
    loader = TrainLoader(TOKENS, B, T, seed=0)
    assert loader.n_windows == N_WINDOWS
    for step in range(5):
        x, y = loader.batch(step)
        assert x.shape == y.shape == (B, T)
        assert x.dtype == y.dtype == np.int64
        assert x.flags.c_contiguous and y.flags.c_contiguous
        np.testing.assert_array_equal(y, x + 1)  # tokens are consecutive integers
        assert all((x[:, 0] - 300) % T == 0)


def test_loader_determinism():
    a, b, c = TrainLoader(TOKENS, B, T, 7), TrainLoader(TOKENS, B, T, 7), TrainLoader(TOKENS, B, T, 8)
    steps = range(8)
    xa = [a.batch(s)[0] for s in steps]
    assert all(np.array_equal(p, b.batch(s)[0]) for p, s in zip(xa, steps))
    assert not all(np.array_equal(p, c.batch(s)[0]) for p, s in zip(xa, steps))


def test_loader_epochs_cover_all_windows_and_follow_spec():
    seed = 5
    loader = TrainLoader(TOKENS, B, T, seed)
    n_steps = 3 * N_WINDOWS // B  # 10 steps: through the middle of epoch 2
    order = sum((window_ids(loader.batch(s)[0]) for s in range(n_steps)), [])
    assert sorted(order[:N_WINDOWS]) == list(range(N_WINDOWS))
    assert sorted(order[N_WINDOWS : 2 * N_WINDOWS]) == list(range(N_WINDOWS))
    assert order[:N_WINDOWS] != order[N_WINDOWS : 2 * N_WINDOWS]  # reshuffled each epoch
    expected = np.concatenate([np.random.default_rng([seed, e]).permutation(N_WINDOWS) for e in range(3)])
    assert order == expected[: n_steps * B].tolist()
    # step 3 straddles the epoch boundary (positions 9, 10, 11)
    assert window_ids(loader.batch(3)[0]) == [expected[9], expected[10], expected[11]]


def test_loader_random_access_resume():
    seq = TrainLoader(TOKENS, B, T, 1)
    seq_batches = [seq.batch(s) for s in range(12)]
    fresh = TrainLoader(TOKENS, B, T, 1)
    for s in (11, 3, 0, 7):
        x, y = fresh.batch(s)
        np.testing.assert_array_equal(x, seq_batches[s][0])
        np.testing.assert_array_equal(y, seq_batches[s][1])


def test_loader_only_builds_needed_permutations(monkeypatch):
    loader = TrainLoader(TOKENS, B, T, 0)
    calls = []
    real = np.random.default_rng
    monkeypatch.setattr(np.random, "default_rng", lambda s: calls.append(list(s)) or real(s))
    s = 10**6 + 6  # positions 3000018..3000020: straddles epochs 300001 and 300002
    loader.batch(s)
    loader.batch(s)
    loader.batch(s + 1)  # positions 3000021..3000023: epoch 300002 only
    assert sorted(c[1] for c in calls) == [300001, 300002]
    assert all(c[0] == 0 for c in calls)


def test_loader_on_shard(tmp_path):
    write_shard(tmp_path / "t.bin", TOKENS)
    x, y = TrainLoader(read_shard(tmp_path / "t.bin"), B, T, 3).batch(2)
    x2, y2 = TrainLoader(TOKENS, B, T, 3).batch(2)
    np.testing.assert_array_equal(x, x2)
    assert type(x) is np.ndarray


def test_loader_too_small():
    with pytest.raises(DataError, match="batch size"):
        TrainLoader(np.arange(2 * T + 1, dtype=np.uint16), 3, T, 0)  # only 2 windows
    TrainLoader(np.arange(3 * T + 1, dtype=np.uint16), 3, T, 0)  # exactly 3 windows is fine


# --------------------------------------------------------------------------- eval batches


def test_eval_batches():
    tokens = np.arange(50, dtype=np.uint16)  # 49 // 4 = 12 rows -> 4 batches of 3
    assert eval_batch_count(tokens, 3, 4) == 4
    assert eval_batch_count(tokens[:49], 3, 4) == 4  # 48 // 4 = 12 rows still
    assert eval_batch_count(tokens[:48], 3, 4) == 3  # last row would need token 48
    for k in range(4):
        x, y = eval_batch(tokens, 3, 4, k)
        assert x.shape == y.shape == (3, 4) and x.dtype == y.dtype == np.int64
        for r in range(3):
            start = (k * 3 + r) * 4
            assert x[r].tolist() == list(range(start, start + 4))
            assert y[r].tolist() == list(range(start + 1, start + 5))
    with pytest.raises(IndexError):
        eval_batch(tokens, 3, 4, 4)


def test_llama3_sized_vocabulary_trains_from_wide_shards(mpicube, tmp_path):
    """A vocabulary past 65,536 ids trains from uint32 shards end to end:
    the first loss is near ln(vocab) (every id of a random stream equally
    likely), and the run's checkpoint is written."""
    rng = np.random.default_rng(0)
    write_shard(tmp_path / "t.bin", rng.integers(0, 70_000, 4000))               # (4000,) ids past uint16
    write_shard(tmp_path / "v.bin", rng.integers(0, 70_000, 600))
    r = mpicube.run("train", "--arch", "llama", "--vocab-size", "70000", "--data", tmp_path / "t.bin",
                    "--val-data", tmp_path / "v.bin", "--n-embd", "16", "--n-layer", "1", "--n-head", "2",
                    "--n-kv-head", "1", "--steps", "2", "--batch-size", "2", "--seq-len", "16",
                    "--out", tmp_path / "run")
    assert r.returncode == 0, r
    first = float(next(line for line in r.stdout.splitlines() if line.startswith("step 1/")).split("loss ")[1].split()[0])
    assert abs(first - np.log(70_000)) < 0.2 and (tmp_path / "run" / "ckpt" / "step_00000002").is_dir()
