"""Files that appear whole or not at all."""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path

# fsync answers these where a file system (or file kind) has nothing to
# flush or cannot flush by this route: nothing was lost, so they are not
# errors. Anything else (EIO above all, ENOSPC, EDQUOT on NFS) means
# written data may not be on disk, and saying nothing would let a
# checkpoint that is not there be counted as saved.
NOTHING_TO_SYNC = {errno.EINVAL, errno.EROFS, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EBADF}


def sync_fd(fd: int) -> None:
    """fsync ``fd``; raise the OSError unless it only says there is nothing to sync."""
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in NOTHING_TO_SYNC:
            raise


def atomic_write(path, chunks) -> Path:
    """Write the byte chunks (any iterable, consumed lazily) to ``path``
    through a unique temporary file in the same directory, then rename it.

    Readers, or other MPI ranks writing the same file, then see either the
    old file or the complete new one, never a partial write; a failure
    midway (a full disk, an exception from the iterable) leaves no debris.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return path
