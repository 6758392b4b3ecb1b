"""llm.c token shards: a header of 256 little-endian int32 (magic, version,
token count, zeros), then the tokens.

Two layouts, told apart by the magic number, as llm.c writes them:

| magic    | version | tokens | for                                   |
|----------|---------|--------|---------------------------------------|
| 20240520 | 1       | uint16 | vocabularies up to 65,536 (GPT-2's)   |
| 20240801 | 7       | uint32 | larger ones (Llama 3's 128,256)       |

``write_shard`` picks the narrow layout whenever the ids fit, so every
shard GPT-2 tooling reads stays as it was; ``read_shard`` takes either.
A shard's tokens are read on demand (``TokenShard``), never mapped.
"""

import os
import stat
from pathlib import Path

import numpy as np

from .atomic import atomic_write
from ..core.errors import UserError

MAGIC, VERSION = 20240520, 1                 # uint16 tokens
WIDE_MAGIC, WIDE_VERSION = 20240801, 7       # uint32 tokens
LAYOUTS = {MAGIC: (VERSION, np.dtype("<u2")), WIDE_MAGIC: (WIDE_VERSION, np.dtype("<u4"))}
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4


class DataError(UserError, ValueError):
    """Bad or unreadable data input; message is shown to the user as is."""


def write_shard(path, tokens) -> None:
    """Write ``tokens`` as an llm.c shard: uint16 when every id fits, else
    uint32 (llm.c's Llama 3 layout)."""
    tokens = np.asarray(tokens)  # (N,) any integer dtype
    if tokens.ndim != 1:
        raise DataError(f"{path}: tokens must be a 1-D array, got shape {tokens.shape}")
    if tokens.size and not np.issubdtype(tokens.dtype, np.integer):
        raise DataError(f"{path}: token ids must be integers, got {tokens.dtype}")
    top = int(tokens.max()) if tokens.size else 0
    if tokens.size and (int(tokens.min()) < 0 or top > np.iinfo(np.uint32).max):
        raise DataError(f"{path}: token ids must be from 0 to {np.iinfo(np.uint32).max:,}")
    if tokens.size > np.iinfo(np.int32).max:
        raise DataError(f"{path}: too many tokens for one shard ({tokens.size})")
    magic = MAGIC if top <= np.iinfo(np.uint16).max else WIDE_MAGIC
    version, dtype = LAYOUTS[magic]
    header = np.zeros(HEADER_INTS, dtype="<i4")  # (256,) int32 little-endian
    header[:3] = (magic, version, tokens.size)
    body = tokens.astype(dtype, copy=False)      # (N,) uint16 or uint32, little-endian
    atomic_write(path, [header.tobytes(), body.tobytes()])


def prepare_hint(path) -> str:
    """What to run when ``path`` is not a shard at all (text, most likely):
    the ``prepare`` that tokenizes it into one beside it."""
    from pathlib import Path

    shard = Path(path).with_suffix(".bin") if Path(path).suffix != ".bin" else Path(path).with_name(
        Path(path).stem + "_tokens.bin")
    return f"; to train on a text file, tokenize it first: mpicube prepare {path} --out {shard}"


def parse_header(header: bytes, size: int, path) -> tuple:
    """(token count, token dtype) of a shard whose first bytes are
    ``header`` and whose file holds ``size`` bytes, or a DataError naming
    ``path``: the header is checked arithmetically against the real size
    before anything is read or allocated (docs/design.md section 5)."""
    if size < HEADER_BYTES or len(header) < HEADER_BYTES:
        raise DataError(f"{path}: file is shorter than the {HEADER_BYTES}-byte shard header ({size} bytes)"
                        + prepare_hint(path))
    magic, version, count = (int(v) for v in np.frombuffer(header, dtype="<i4", count=3))
    if magic not in LAYOUTS:
        raise DataError(f"{path}: wrong magic number {magic} (expected {MAGIC} or {WIDE_MAGIC}); "
                        f"not an llm.c token shard" + prepare_hint(path))
    want, dtype = LAYOUTS[magic]
    if version != want:
        raise DataError(f"{path}: unsupported shard version {version} (expected {want} with magic {magic})")
    expected = HEADER_BYTES + dtype.itemsize * count
    if count < 0 or size != expected:
        raise DataError(
            f"{path}: size mismatch: header says {count} tokens ({expected} bytes) but the file has {size} bytes"
        )
    return count, dtype


class TokenShard:
    """The tokens of one shard, read on demand with positioned reads.

    Why not a memory map: a page of a mapped file that is truncated or
    rewritten under a running job kills it with SIGBUS and no message. A
    ``pread`` of a window comes back short instead, and that is a DataError
    naming the file. The file stays open, so a shard *replaced* under the
    job (a new file renamed over it) is still read as it was when opened.

    Array-like enough for its users: ``len``, ``shape``, ``dtype`` (uint16
    or uint32, as the file holds them), an integer or a slice (a copy),
    ``np.asarray`` (the whole shard) and ``rows`` (the windows of a batch,
    one read each).
    """

    ndim = 1

    def __init__(self, path: Path, fd: int, count: int, dtype=np.dtype("<u2")):
        self.path = path
        self.dtype = np.dtype(dtype)
        self._fd = fd
        self._count = count

    def __len__(self) -> int:
        return self._count

    @property
    def shape(self) -> tuple:
        return (self._count,)

    def _read(self, start: int, n: int) -> np.ndarray:
        """Tokens [start, start + n) as a new (n,) array."""
        out = np.empty(n, dtype=self.dtype)                                     # (n,) uint16 or uint32
        if n:
            self._read_into(out, start)
        return out

    def _read_into(self, out: np.ndarray, start: int) -> None:
        """Fill the contiguous array ``out`` with the tokens from ``start`` on."""
        buf, want, got = memoryview(out).cast("B"), out.nbytes, 0
        try:
            while got < want:
                n = os.preadv(self._fd, [buf[got:]], HEADER_BYTES + self.dtype.itemsize * start + got)
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
        whole = self._read(0, self._count)                                      # (N,)
        return whole if dtype is None else whole.astype(dtype)

    def rows(self, starts, width: int) -> np.ndarray:
        """(B, width): row r holds tokens [starts[r], starts[r] + width)."""
        starts = np.asarray(starts, dtype=np.int64)                             # (B,)
        if starts.size and (starts.min() < 0 or starts.max() + width > self._count):
            raise IndexError(f"window past the end of {self.path} ({self._count} tokens)")
        out = np.empty((starts.size, width), dtype=self.dtype)                  # (B, width)
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
        return f"TokenShard({str(self.path)!r}, {self._count} tokens of {self.dtype.name})"


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
        count, dtype = parse_header(os.pread(fd, HEADER_BYTES, 0), st.st_size, path)
    except OSError as e:
        os.close(fd)
        raise DataError(f"{path}: cannot read token shard ({e.strerror})") from None
    except BaseException:
        os.close(fd)
        raise
    return TokenShard(path, fd, count, dtype)


def check_vocab(tokens, vocab_size: int, path) -> None:
    """DataError naming ``path`` and the first position holding an id that
    the model's vocabulary does not have. Shards hold any id of their
    layout (llm.c's GPT-2-tokenized data goes up to 50256); a model of a
    smaller vocabulary would otherwise index past its embedding. Scanned
    in chunks, so a shard is never read whole."""
    chunk = 1 << 24
    for lo in range(0, len(tokens), chunk):
        part = np.asarray(tokens[lo:lo + chunk])                                 # (chunk,)
        if part.size and int(part.max()) >= vocab_size:
            first = lo + int(np.argmax(part >= vocab_size))
            raise DataError(f"{path}: token {int(tokens[first])} at position {first:,} is outside the model's "
                            f"vocabulary of {vocab_size} (ids 0..{vocab_size - 1})")
