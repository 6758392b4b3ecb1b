"""Token data: llm.c-style shards, a byte-level tokenizer, corpus preparation and batching.

Everything here is deterministic on purpose: the same inputs give the same
shards, and the same (seed, batch size, sequence length) give the same batches
on any number of ranks, so a run can be resumed or re-split from just a step
number.
"""

import os
import stat
import sys
import sysconfig
from pathlib import Path

import numpy as np

from .atomic import atomic_write
from ..core.errors import UserError

MAGIC = 20240520
VERSION = 1
HEADER_INTS = 256  # llm.c token shard format: 256 int32 header, then uint16 tokens
HEADER_BYTES = HEADER_INTS * 4
VOCAB_SIZE = 256

TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst")
# Directories left out of the built-in corpus: installed third-party packages
# (they differ between machines) and test suites / IDLE / lib2to3 (large, and
# partly deliberately broken or unusual code that is a poor sample of Python).
STDLIB_EXCLUDED_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "idlelib", "lib2to3", "__pycache__"}
)


class DataError(UserError, ValueError):
    """Bad or unreadable data input; message is shown to the user as is."""


# --------------------------------------------------------------------------- shards


def write_shard(path, tokens) -> None:
    """Write `tokens` as an llm.c shard (header of 256 int32: magic, version, count; then uint16)."""
    tokens = np.asarray(tokens)  # (N,) any integer dtype
    if tokens.ndim != 1:
        raise DataError(f"{path}: tokens must be a 1-D array, got shape {tokens.shape}")
    if tokens.size and (tokens.min() < 0 or tokens.max() > np.iinfo(np.uint16).max):
        raise DataError(f"{path}: token ids must fit in uint16 (0..65535)")
    if tokens.size > np.iinfo(np.int32).max:
        raise DataError(f"{path}: too many tokens for one shard ({tokens.size})")
    header = np.zeros(HEADER_INTS, dtype="<i4")  # (256,) int32 little-endian
    header[:3] = (MAGIC, VERSION, tokens.size)
    body = tokens.astype("<u2", copy=False)  # (N,) uint16 little-endian
    atomic_write(path, [header.tobytes(), body.tobytes()])


def parse_header(header: bytes, size: int, path) -> int:
    """The token count of a shard whose first bytes are ``header`` and whose
    file holds ``size`` bytes, or a DataError naming ``path``: the header is
    checked arithmetically against the real size before anything is read
    or allocated (DESIGN.md section 5)."""
    if size < HEADER_BYTES or len(header) < HEADER_BYTES:
        raise DataError(f"{path}: file is shorter than the {HEADER_BYTES}-byte shard header ({size} bytes)")
    magic, version, count = (int(v) for v in np.frombuffer(header, dtype="<i4", count=3))
    if magic != MAGIC:
        raise DataError(f"{path}: wrong magic number {magic} (expected {MAGIC}); not an llm.c token shard")
    if version != VERSION:
        raise DataError(f"{path}: unsupported shard version {version} (expected {VERSION})")
    expected = HEADER_BYTES + 2 * count
    if count < 0 or size != expected:
        raise DataError(
            f"{path}: size mismatch: header says {count} tokens ({expected} bytes) but the file has {size} bytes"
        )
    return count


class TokenShard:
    """The tokens of one shard, read on demand with positioned reads.

    Why not a memory map: a page of a mapped file that is truncated or
    rewritten under a running job kills it with SIGBUS and no message. A
    ``pread`` of a window comes back short instead, and that is a DataError
    naming the file. The file stays open, so a shard *replaced* under the
    job (a new file renamed over it) is still read as it was when opened.

    Array-like enough for its users: ``len``, ``shape``, ``dtype``, an
    integer or a slice (a copy, uint16), ``np.asarray`` (the whole shard)
    and ``rows`` (the windows of a batch, one read each).
    """

    dtype = np.dtype("<u2")
    ndim = 1

    def __init__(self, path: Path, fd: int, count: int):
        self.path = path
        self._fd = fd
        self._count = count

    def __len__(self) -> int:
        return self._count

    @property
    def shape(self) -> tuple:
        return (self._count,)

    def _read(self, start: int, n: int) -> np.ndarray:
        """Tokens [start, start + n) as a new (n,) uint16 array."""
        out = np.empty(n, dtype=self.dtype)                                     # (n,) uint16
        if n:
            self._read_into(out, start)
        return out

    def _read_into(self, out: np.ndarray, start: int) -> None:
        """Fill the contiguous array ``out`` with the tokens from ``start`` on."""
        buf, want, got = memoryview(out).cast("B"), out.nbytes, 0
        try:
            while got < want:
                n = os.preadv(self._fd, [buf[got:]], HEADER_BYTES + 2 * start + got)
                if n == 0:                      # end of file: it is shorter than when it was opened
                    break
                got += n
        except OSError as e:
            raise DataError(f"{self.path}: cannot read token shard ({e.strerror})") from None
        if got != want:
            raise DataError(f"{self.path}: token shard changed under this job: read {got} of {want} bytes at "
                            f"token {start:,} of {self._count:,} (truncated or rewritten in place?)")

    def __getitem__(self, key):
        if isinstance(key, slice):
            start, stop, step = key.indices(self._count)
            lo, hi = (start, stop) if step > 0 else (stop + 1, start + 1)
            part = self._read(lo, max(0, hi - lo))
            return part[::step] if step > 0 else part[::-1][::-step]
        index = int(np.asarray(key).item()) if np.ndim(key) == 0 else None
        if index is None:
            raise TypeError("a token shard takes an integer or a slice (use rows() for windows)")
        if not -self._count <= index < self._count:
            raise IndexError(f"token {index} out of range for {self.path} ({self._count} tokens)")
        return self._read(index % self._count, 1)[0]

    def __array__(self, dtype=None, copy=None):
        whole = self._read(0, self._count)                                      # (N,) uint16
        return whole if dtype is None else whole.astype(dtype)

    def rows(self, starts, width: int) -> np.ndarray:
        """(B, width) uint16: row r holds tokens [starts[r], starts[r] + width)."""
        starts = np.asarray(starts, dtype=np.int64)                             # (B,)
        if starts.size and (starts.min() < 0 or starts.max() + width > self._count):
            raise IndexError(f"window past the end of {self.path} ({self._count} tokens)")
        out = np.empty((starts.size, width), dtype=self.dtype)                  # (B, width) uint16
        for r, start in enumerate(starts.tolist()):
            self._read_into(out[r], start)
        return out

    def __reduce_ex__(self, protocol):
        raise TypeError("a TokenShard holds an open file and is not copied: read_shard its path again")

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self):
        self.close()

    def __repr__(self):
        return f"TokenShard({str(self.path)!r}, {self._count} tokens)"


def read_shard(path) -> TokenShard:
    """Open a shard (its tokens as a ``TokenShard``, read on demand).

    Every way a file can be wrong is checked up front so that a bad input stops
    the run with a message naming the file, instead of training on garbage;
    size and header are those of the opened file, not of a path looked at
    earlier. Not a regular file (a FIFO would block forever): a DataError.
    """
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise DataError(f"{path}: token shard not found") from None
    except OSError as e:
        raise DataError(f"{path}: cannot read token shard ({e.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise DataError(f"{path}: not a regular file, so not a token shard")
        count = parse_header(os.pread(fd, HEADER_BYTES, 0), st.st_size, path)
    except OSError as e:
        os.close(fd)
        raise DataError(f"{path}: cannot read token shard ({e.strerror})") from None
    except BaseException:
        os.close(fd)
        raise
    return TokenShard(path, fd, count)


def check_vocab(tokens, vocab_size: int, path) -> None:
    """DataError naming ``path`` and the first position holding an id that
    the model's vocabulary does not have. Shards hold any uint16 (llm.c's
    GPT-2-tokenized data goes up to 50256); a model of a smaller vocabulary
    would otherwise index past its embedding. Scanned in chunks, so a
    shard is never read whole."""
    chunk = 1 << 24
    for lo in range(0, len(tokens), chunk):
        part = np.asarray(tokens[lo:lo + chunk])                                 # (chunk,) uint16
        if part.size and int(part.max()) >= vocab_size:
            first = lo + int(np.argmax(part >= vocab_size))
            raise DataError(f"{path}: token {int(tokens[first])} at position {first:,} is outside the model's "
                            f"vocabulary of {vocab_size} (ids 0..{vocab_size - 1})")


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
    return np.asarray(encode(stream.decode("utf-8", errors="replace")), dtype=np.uint16)  # (N,) uint16


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

    Bytes by default; ``encode`` (text -> ids below 65536) for another tokenizer.

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
        self.tokens = tokens  # (N,) uint16, usually a TokenShard from read_shard
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
