"""Errors whose message is meant for the user, not for a traceback."""

import os


class UserError(Exception):
    """Bad input: the CLI prints the message once (rank 0) and exits non-zero."""


class ConfigError(UserError, ValueError):
    """A model, batch or world size that does not fit the chosen layout."""


EXIT_IO = 74            # EX_IOERR (sysexits.h): the run directory could not be read or written


class RunDirError(UserError):
    """The run directory failed under the job: a full disk, a read-only or
    vanished file system, while taking the lock or writing config.json,
    metrics.jsonl or a checkpoint. Not bad input (2) and not a bug (1): its
    own status, so that a batch script stops instead of resubmitting a job
    that would fail the same way, and a person knows to look at the disk."""

    exit_code = EXIT_IO


def io_reason(exc: OSError) -> str:
    """The errno text of ``exc`` ("No space left on device"): short, where
    ``str(exc)`` of an HDF5 error runs to a few hundred characters."""
    if exc.errno:
        return os.strerror(exc.errno)
    return exc.strerror or str(exc) or type(exc).__name__
