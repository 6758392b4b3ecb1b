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


def current_umask() -> int:
    """This process's umask, read without changing it where Linux says it
    (/proc/self/status, since 4.7), else set and set back at once."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def honour_umask(fd_or_path, directory: bool = False) -> None:
    """Give a file made by mkstemp (0600) or a directory made by mkdtemp
    (0700) the mode open() and mkdir() would have given it: 0666 or 0777
    less the umask. On a shared cluster colleagues read each other's
    shards, exports and profiles, as they read checkpoints."""
    mode = (0o777 if directory else 0o666) & ~current_umask()
    if isinstance(fd_or_path, int):
        os.fchmod(fd_or_path, mode)
    else:
        os.chmod(fd_or_path, mode)


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
        honour_umask(fd)
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
