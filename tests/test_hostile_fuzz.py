"""Property-based fuzzing of the parsers of untrusted headers (hypothesis).

Any bytes as a token shard's header, any values as a checkpoint's root
attributes or ``config``: the result is either valid (and then consistent
with what was given) or the module's own error, DataError or
CheckpointError, never another exception, which would be a traceback
instead of a message. Fixed budgets, derandomized and without an example
database, so every run (and CI) tries the same examples in a few seconds.
"""

from __future__ import annotations

import json
import os
import tempfile

import h5py
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mpicube.files import data, shards
from mpicube.files.checkpoint import CheckpointError, FORMAT, VERSION
from mpicube.files.checkpoint.header import CONFIG_KEYS, parse_root, model_config, read_attrs

FUZZ = settings(max_examples=300, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow])
FUZZ_FILES = settings(FUZZ, max_examples=60)

INT32 = st.integers(-2**31, 2**31 - 1)


# --------------------------------------------------------------------------- token shard headers


def header_bytes(magic, version, count, rest: bytes, length: int) -> bytes:
    """The three fields, the rest of the header drawn, all cut or padded to ``length`` bytes."""
    raw = np.array([magic, version, count], "<i4").tobytes() + rest
    return raw[:length].ljust(length, b"\0")


# a header near the valid one (each field right or anything), mostly of the full
# size, sometimes cut short; or any bytes at all
HEADERS = st.one_of(
    st.builds(header_bytes, st.sampled_from([data.MAGIC, shards.WIDE_MAGIC]) | INT32,
              st.sampled_from([data.VERSION, shards.WIDE_VERSION]) | INT32,
              st.integers(-3, 600) | INT32, st.binary(max_size=32),
              st.just(data.HEADER_BYTES) | st.integers(0, data.HEADER_BYTES + 8)),
    st.binary(max_size=data.HEADER_BYTES + 16),
)


def sizes(raw: bytes):
    """A file size: the one a valid header needs, or near it, or anything."""
    count = int(np.frombuffer(raw[:12].ljust(12, b"\0"), "<i4")[2])
    rights = [data.HEADER_BYTES + width * count for width in (2, 4)]      # uint16 or uint32 tokens
    return st.sampled_from([r + d for r in rights for d in (0, -1, 2)] + [len(raw)]) | st.integers(-1, 2**33)


@FUZZ
@given(HEADERS.flatmap(lambda raw: st.tuples(st.just(raw), sizes(raw))))
def test_shard_header_parses_or_says_why(raw_size):
    raw, size = raw_size
    try:
        count, dtype = data.parse_header(raw, size, "shard.bin")
    except data.DataError as e:
        assert str(e).startswith("shard.bin: ")
        return
    assert len(raw) >= data.HEADER_BYTES and count >= 0 and size == data.HEADER_BYTES + dtype.itemsize * count
    layout = [data.MAGIC, data.VERSION] if dtype == np.uint16 else [shards.WIDE_MAGIC, shards.WIDE_VERSION]
    assert dtype in (np.uint16, np.uint32) and np.frombuffer(raw, "<i4", 3).tolist() == layout + [count]


@FUZZ_FILES
@given(HEADERS, st.booleans(), st.binary(max_size=64))
def test_shard_file_opens_or_says_why(raw, pad, body):
    """Real files: a header (padded to its size, or as drawn), then any body."""
    content = (raw[: data.HEADER_BYTES].ljust(data.HEADER_BYTES, b"\0") if pad else raw) + body
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "s.bin")
        with open(path, "wb") as fh:
            fh.write(content)
        try:
            tokens = data.read_shard(path)
        except data.DataError as e:
            assert path in str(e)
            return
        got = np.asarray(tokens)
        tokens.close()
    assert got.dtype in (np.uint16, np.uint32) and got.tobytes() == content[data.HEADER_BYTES:]


# --------------------------------------------------------------------------- checkpoint root attributes


JSONS = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                     lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4),
                     max_leaves=12)
ANY_VALUE = st.one_of(
    st.text(max_size=20), st.binary(max_size=20), st.integers(), st.floats(), st.booleans(),
    JSONS.map(json.dumps),
    st.builds(lambda n: "[" * n + "]" * n, st.integers(0, 5000)),                # nested past the stack
    st.lists(st.integers(-2**63, 2**63 - 1), max_size=4).map(lambda v: np.array(v, np.int64)),
    st.integers(-2**63, 2**63 - 1).map(np.int64), st.floats(width=32).map(np.float32),
)
CONFIG = {"vocab_size": 256, "n_ctx": 16, "n_layer": 1, "n_head": 2, "n_embd": 16}
GOOD_ROOT = {"format": FORMAT, "version": np.int64(VERSION), "step": np.int64(2),
             "tensors": json.dumps(["model/wte", "model/wpe"]), "shard_sha256": json.dumps({"shards/a.h5": "ab"}),
             "config": json.dumps(CONFIG)}
CONFIG_VALUES = st.one_of(st.integers(-5, 2**70), st.floats(), st.text(max_size=4), st.booleans(), st.none(), JSONS)


@st.composite
def roots(draw):
    """The good root attributes with one of them (or one config key)
    replaced by anything, then maybe a few more replaced, dropped or added."""
    root, cfg = dict(GOOD_ROOT), dict(CONFIG)
    key = draw(st.sampled_from(sorted(GOOD_ROOT) + [f"config.{k}" for k in CONFIG_KEYS]))
    if key.startswith("config."):
        cfg[key[len("config."):]] = draw(CONFIG_VALUES)
    else:
        root[key] = draw(ANY_VALUE)
    for key in draw(st.lists(st.sampled_from(CONFIG_KEYS), max_size=2)):
        cfg.pop(key, None)
    if "config" not in key:
        root["config"] = json.dumps(cfg)
    for key in draw(st.lists(st.sampled_from(sorted(GOOD_ROOT)) | st.text(max_size=6), max_size=2)):
        if draw(st.booleans()):
            root[key] = draw(ANY_VALUE)
        else:
            root.pop(key, None)
    return root


def check_root(raw: dict) -> None:
    """Parse; a valid header must be what ``raw`` says."""
    try:
        head = parse_root(raw, "ck.h5")
    except CheckpointError as e:
        assert str(e).startswith("ck.h5: ")
        return
    assert head.step >= 0 and all(isinstance(n, str) for n in head.names)
    try:
        cfg = model_config(head.attrs.get("config"), "ck.h5")
    except CheckpointError as e:
        assert str(e).startswith("ck.h5: ")
        return
    assert set(cfg) == set(CONFIG_KEYS) and all(1 <= v <= 2**31 - 1 for v in cfg.values())


@FUZZ
@given(roots())
def test_root_attributes_parse_or_say_why(raw):
    check_root(raw)


@settings(FUZZ, max_examples=150)
@given(st.dictionaries(st.sampled_from(sorted(GOOD_ROOT)) | st.text(max_size=6), ANY_VALUE, max_size=8))
def test_any_root_attributes_parse_or_say_why(raw):
    check_root(raw)


@FUZZ_FILES
@given(roots())
def test_root_attributes_from_a_real_file(raw):
    """The same, with the values as h5py gives them back from a file."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "checkpoint.h5")
        with h5py.File(path, "w") as f:
            for key, value in raw.items():
                try:
                    f.attrs[key] = value
                except (TypeError, ValueError, RuntimeError):
                    pass                        # a name or value HDF5 cannot hold cannot be in a file either
        with h5py.File(path, "r") as f:
            try:
                attrs = read_attrs(f.attrs, "ck.h5")
            except CheckpointError:
                return
        check_root(attrs)
