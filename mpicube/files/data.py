"""Token data: llm.c-style shards, a byte-level tokenizer, corpus preparation and batching.

Everything here is deterministic on purpose: the same inputs give the same
shards, and the same (seed, batch size, sequence length) give the same batches
on any number of ranks, so a run can be resumed or re-split from just a step
number.
"""

import os
import sys
import sysconfig
from pathlib import Path

import numpy as np

from .shards import (HEADER_BYTES, MAGIC, VERSION, DataError, TokenShard, check_vocab, parse_header,  # noqa: F401
                     read_shard, write_shard)

VOCAB_SIZE = 256

TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst")
# Directories left out of the built-in corpus: installed third-party packages
# (they differ between machines) and test suites / IDLE / lib2to3 (large, and
# partly deliberately broken or unusual code that is a poor sample of Python).
STDLIB_EXCLUDED_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "idlelib", "lib2to3", "__pycache__"}
)


# --------------------------------------------------------------------------- tokenizer


def encode_bytes(data: bytes) -> np.ndarray:
    """Byte-level tokenizer: one token per byte, so any file is valid input and vocab is 256."""
    return np.frombuffer(bytes(data), dtype=np.uint8).astype(np.uint16)  # (N,) uint16


def decode_tokens(tokens) -> str:
    """Inverse of encode_bytes; invalid UTF-8 (e.g. a sample cut mid-character) becomes U+FFFD."""
    tokens = np.asarray(tokens).ravel()
    if tokens.size and (tokens.min() < 0 or tokens.max() >= VOCAB_SIZE):
        raise DataError(f"token ids must be in 0..{VOCAB_SIZE - 1} for the byte tokenizer")
    return tokens.astype(np.uint8).tobytes().decode("utf-8", errors="replace")


# --------------------------------------------------------------------------- corpus preparation


def _walk(root, suffixes, excluded_dirs=frozenset(), skip_file=lambda name: False):
    """Files under `root` with one of `suffixes`, sorted by relative path so the order is the same everywhere."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in excluded_dirs]
        for name in filenames:
            if name.endswith(suffixes) and not skip_file(name):
                found.append(Path(dirpath, name))
    return sorted(found, key=lambda p: p.relative_to(root).parts)


def _input_files(inputs):
    """Expand prepare()'s inputs: files as given, directories recursively (text suffixes only)."""
    if isinstance(inputs, (str, os.PathLike)):
        inputs = [inputs]
    files = []
    for item in inputs:
        item = Path(item)
        if item.is_dir():
            files.extend(_walk(item, TEXT_SUFFIXES))
        elif item.is_file():
            files.append(item)
        else:
            raise DataError(f"{item}: input file or directory not found")
    return files


def _concat(files, encode=None) -> np.ndarray:
    """Tokens of all files, each followed by a b"\\n" separator: bytes, or
    ``encode(text)`` (e.g. GPT-2's BPE) of the whole stream decoded as UTF-8."""
    parts = []
    content = 0
    for f in files:
        try:
            data = Path(f).read_bytes()
        except OSError as e:
            raise DataError(f"{f}: cannot read input ({e.strerror})") from None
        content += len(data)
        parts.append(data)
        parts.append(b"\n")
    if not files:
        raise DataError("no input files found")
    if content == 0:
        raise DataError("the corpus is empty (all input files are empty)")
    stream = b"".join(parts)
    if encode is None:
        return encode_bytes(stream)  # (N,) uint16
    ids = np.asarray(encode(stream.decode("utf-8", errors="replace")))      # (N,) whatever the tokenizer gives
    if ids.size and (not np.issubdtype(ids.dtype, np.integer) or int(ids.min()) < 0):
        raise DataError(f"the tokenizer gave ids that are not non-negative integers ({ids.dtype})")
    return ids.astype(np.uint16 if ids.size == 0 or int(ids.max()) <= np.iinfo(np.uint16).max
                      else np.uint32)  # (N,) uint16, or uint32 for a vocabulary past 65,536


def _val_path(out: Path) -> Path:
    return out.with_name(f"{out.stem}_val{out.suffix}")


def _write_split(tokens, out, val_fraction):
    """Write the first part of the stream to `out`, the last round(val_fraction*N) (>= 1) tokens to the val shard."""
    if not 0 < val_fraction < 1:
        raise DataError(f"val_fraction must be between 0 and 1, got {val_fraction}")
    out = Path(out)
    n = len(tokens)
    n_val = max(1, round(n * val_fraction))
    if n - n_val < 1:
        raise DataError(f"the corpus is too small ({n} tokens) to split into train and validation")
    val = _val_path(out)
    write_shard(out, tokens[: n - n_val])
    write_shard(val, tokens[n - n_val :])
    return out, val


def prepare(inputs, out, val_fraction=0.05, encode=None) -> tuple[Path, Path]:
    """Tokenize text files/directories into a train shard `out` and a val shard `<stem>_val<suffix>`.

    Bytes by default; ``encode`` (text -> ids) for another tokenizer: ids past
    65,535 (Llama 3's) make uint32 shards.

    The validation split is the tail of the stream (not a random sample) so
    that it is contiguous text, like the evaluation windows expect.
    Returns (train_path, val_path).
    """
    return _write_split(_concat(_input_files(inputs), encode), out, val_fraction)


def _stdlib_files():
    """The standard library's own .py files (no third-party packages, no tests), in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return _walk(root, (".py",), STDLIB_EXCLUDED_DIRS, skip_file=lambda name: name.startswith("test_"))


def builtin_corpus(cache_dir=None) -> tuple[Path, Path]:
    """The default corpus (Python stdlib sources), prepared once into a cache and reused.

    It needs no download, so every machine can train out of the box. The cache
    name includes the Python version because the sources differ between
    versions. Each shard is written atomically, so ranks racing here at worst
    do the same work twice and never read a half-written file.
    """
    if cache_dir is None:
        cache_dir = os.environ.get("MPICUBE_CACHE") or Path.home() / ".cache" / "mpicube"
    cache_dir = Path(cache_dir)
    out = cache_dir / f"stdlib-py{sys.version_info.major}.{sys.version_info.minor}.bin"
    val = _val_path(out)
    try:
        read_shard(out)
        read_shard(val)
        return out, val
    except DataError:
        pass  # missing or damaged: (re)build it
    files = _stdlib_files()
    if not files:
        raise DataError(f"no standard library sources found under {sysconfig.get_paths()['stdlib']}")
    return _write_split(_concat(files), out, 0.05)


# --------------------------------------------------------------------------- batching


def _windows(tokens, starts, seq_len):
    """Windows of T+1 tokens at `starts` (a read each from a shard, one fancy-indexing op on an array);
    return (x, y), y shifted by one."""
    if isinstance(tokens, TokenShard):
        chunk = tokens.rows(starts, seq_len + 1).astype(np.int64)  # (B, T+1) int64
    else:
        idx = np.asarray(starts, dtype=np.int64)[:, None] + np.arange(seq_len + 1)  # (B, T+1) int64
        chunk = np.asarray(tokens[idx], dtype=np.int64)  # (B, T+1) int64
    # contiguous copies: callers hand these to MPI and to matmuls
    return np.ascontiguousarray(chunk[:, :-1]), np.ascontiguousarray(chunk[:, 1:])  # (B, T) each


def _check_sizes(batch_size, seq_len):
    if batch_size < 1 or seq_len < 1:
        raise DataError(f"batch size and sequence length must be positive (got {batch_size}, {seq_len})")


class TrainLoader:
    """Training batches whose order depends only on (seed, global batch size, seq len): the token stream is cut into
    non-overlapping windows of T+1 tokens starting at multiples of T (window w covers tokens [w*T, w*T+T+1));
    each epoch e visits all windows in the order np.random.default_rng([seed, e]).permutation(n_windows);
    step s (0-based) takes the global batch of windows s*B ... s*B+B-1 of the concatenated epoch orders.
    Random access by step, so resuming needs only the step number."""

    def __init__(self, tokens, batch_size, seq_len, seed):
        _check_sizes(batch_size, seq_len)
        self.tokens = tokens  # (N,) uint16 or uint32, usually a TokenShard from read_shard
        self.batch_size = int(batch_size)
        self.seq_len = int(seq_len)
        self.seed = int(seed)
        self.n_windows = max(0, (len(tokens) - 1) // self.seq_len)
        if self.n_windows < self.batch_size:
            raise DataError(
                f"training data too small: {len(tokens)} tokens give {self.n_windows} windows of "
                f"{self.seq_len}+1 tokens, fewer than the batch size {self.batch_size}"
            )
        # Permutations are made on demand; a batch spans at most two epochs
        # (B <= n_windows), so keeping two avoids regenerating at a boundary.
        self._perms = {}

    def _perm(self, epoch):
        if epoch not in self._perms:
            if len(self._perms) >= 2:
                self._perms.pop(min(self._perms))
            rng = np.random.default_rng([self.seed, epoch])
            self._perms[epoch] = rng.permutation(self.n_windows)  # (n_windows,) int64
        return self._perms[epoch]

    def batch(self, step) -> tuple[np.ndarray, np.ndarray]:
        """Global batch `step`: (x, y), each (B, T) int64, y[:, t] == x[:, t+1] within the stream."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        g = step * self.batch_size + np.arange(self.batch_size)  # (B,) positions in the epoch-order stream
        epochs, pos = np.divmod(g, self.n_windows)
        windows = np.empty(self.batch_size, dtype=np.int64)  # (B,) window indices
        for e in np.unique(epochs):  # at most two epochs
            sel = epochs == e
            windows[sel] = self._perm(int(e))[pos[sel]]
        return _windows(self.tokens, windows * self.seq_len, self.seq_len)


def eval_batch_count(tokens, batch_size, seq_len) -> int:
    """How many full evaluation batches `tokens` holds (a row needs T+1 tokens from its start)."""
    _check_sizes(batch_size, seq_len)
    return max(0, (len(tokens) - 1) // seq_len) // batch_size


def eval_batch(tokens, batch_size, seq_len, k) -> tuple[np.ndarray, np.ndarray]:
    """Evaluation batch k: row r starts at token (k*B + r)*T; T inputs and the next T targets, (B, T) int64 each.

    Fixed, unshuffled offsets so validation loss is comparable across runs and rank counts.
    """
    n = eval_batch_count(tokens, batch_size, seq_len)
    if not 0 <= k < n:
        raise IndexError(f"eval batch {k} out of range (data holds {n} batches)")
    starts = (k * batch_size + np.arange(batch_size)) * seq_len  # (B,) int64
    return _windows(tokens, starts, seq_len)
