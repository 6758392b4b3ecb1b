"""Real file-system failures for tests: a small tmpfs that fills up, a
read-only remount, a bind mount that puts one folder on another disk.

Mounting needs root (or CAP_SYS_ADMIN); where it is refused, the test that
asked is skipped with the reason. Every mount is undone when the test ends,
whatever happened.
"""

from __future__ import annotations

import errno
import os
import subprocess
from contextlib import contextmanager
from pathlib import Path

import pytest

PAGE = 4096             # tmpfs gives space by pages


def _mount(*args: str) -> None:
    r = subprocess.run(["mount", *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise OSError(f"mount {' '.join(args)}: {(r.stderr or r.stdout).strip()}")


@contextmanager
def small_disks(root: Path):
    """Yields ``mount(path, kib)`` (a fresh tmpfs of ``kib`` KiB at
    ``path``), ``bind(src, dst)`` and ``read_only(path)``; unmounts all of
    them, innermost first, at the end. The first mount that fails skips the
    test."""
    mounted = []

    def mount(path: Path, kib: int) -> Path:
        path.mkdir(parents=True, exist_ok=True)
        try:
            _mount("-t", "tmpfs", "-o", f"size={kib}k,mode=0755", "tmpfs", str(path))
        except OSError as exc:
            if not mounted:
                pytest.skip(f"cannot mount a tmpfs here (needs root): {exc}")
            raise
        mounted.append(path)
        return path

    def bind(src: Path, dst: Path) -> None:
        src.mkdir(parents=True, exist_ok=True)
        dst.mkdir(parents=True, exist_ok=True)
        _mount("--bind", str(src), str(dst))
        mounted.append(dst)

    def read_only(path: Path) -> None:
        _mount("-o", "remount,ro", str(path))

    try:
        yield mount, bind, read_only
    finally:
        for path in reversed(mounted):
            subprocess.run(["umount", "-l", str(path)], capture_output=True)


def fill(disk: Path, leave_pages: int = 0) -> Path:
    """Fill the file system of ``disk`` with one file, then give back
    ``leave_pages`` pages of it; returns the file (delete it to free the disk)."""
    filler = disk / "filler"
    chunk = b"\0" * PAGE
    with open(filler, "wb", buffering=0) as f:
        while True:
            try:
                f.write(chunk)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                break
    size = filler.stat().st_size
    os.truncate(filler, max(0, size - leave_pages * PAGE))
    return filler
