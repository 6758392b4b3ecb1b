"""New HDF5 files that survive a full disk: every file a save writes
(shards, indexes, checkpoint.h5) is created through ``create``.

Why: when a write fails under it (ENOSPC, EDQUOT, EIO), HDF5 2.0 / h5py
3.16 leave the file in a state that crashes the process in ``close()``
(a segmentation fault, after pages of "Exception ignored" tracebacks), so
a rank dies instead of reporting, and the job ends with signal 11 instead
of one line and the run directory's exit status. Here HDF5 writes through
a Python file object (h5py's file-object driver) that keeps the first
failure to itself and tells HDF5 the write succeeded: HDF5 finishes and
closes cleanly, then ``create`` raises that failure as a plain OSError.
The file is then incomplete, which does not matter: a save that fails
removes its temporary directory. On a disk with room nothing differs (the
bytes written are the same, and as fast, since HDF5 writes whole chunks).
"""

from __future__ import annotations

import io
from contextlib import contextmanager
from pathlib import Path

import h5py


class _KeepFirstError(io.FileIO):
    """A file whose writes never fail to the caller: the first OSError is
    kept in ``error`` and every later write is dropped."""

    error = None

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        if self.error is None:
            try:
                done = 0
                while done < len(view):          # a short write (the disk filling up) is finished or fails
                    done += super().write(view[done:])
            except OSError as exc:
                self.error = exc
        return len(view)


@contextmanager
def create(path: Path):
    """``h5py.File(path, "w")``, open for the ``with`` block; afterwards
    an OSError (its errno kept) if any write to the file failed."""
    raw = _KeepFirstError(path, "w+")
    try:
        with h5py.File(raw, "w", locking=False) as f:
            yield f
        if raw.error is None:
            raw.flush()
    finally:
        raw.close()
    if raw.error is not None:
        exc = raw.error
        raise OSError(exc.errno, exc.strerror, str(path)) from exc
