"""The ``mpicube`` console command: every command, run under the error
handling they share. The group and the shared options are ``cli.common``;
the commands are ``cli.train`` and ``cli.model``, imported here so that
they register on the group.

Run it as ``mpiexec -n P mpicube train ...`` (or ``python -m mpicube``).

Errors (docs/design.md section 7). Bad input - ``UserError`` (``ConfigError`` is
one), ``DataError``, ``CheckpointError``, a click usage error - is reported by
rank 0 as one line ``error: <message>`` on stderr, without a traceback, and
the job exits with status 2. Such an error is normally raised by every rank
at the same point (sizes are validated before any collective, and inputs
that only rank 0 reads are broadcast with their error); when it is raised by
only some ranks while others wait in a collective, the ranks that failed
wait ``MPICUBE_ERROR_GRACE`` seconds (default 3) for the rest, then print
their own message and abort the whole job. Any other exception prints its
traceback, each line prefixed with the rank, and aborts the job with status
1, so no rank is ever left waiting.

Exit statuses: 0 done (also after ``--stop-after``), 1 internal error,
2 bad input, 3 training diverged, 74 (EX_IOERR) the run directory could not
be written or read (a full disk, a read-only file system: the lock,
config.json, metrics.jsonl or a checkpoint; one line naming the file, after
an attempt to checkpoint when training was under way), 75 stopped by a
signal or ``--time-limit`` with a checkpoint written (resume with
``--resume``), 76 no progress: a collective waited, or a step stood still,
for ``--collective-timeout`` seconds (a rank stopped, died or was cut off);
the first rank to notice says so in one line and the job is aborted, its
last checkpoint intact (``mpicube.parallel.watchdog``), 130 interrupted
(a second Ctrl-C while training, which does not wait for the checkpoint
a first one asks for; or Ctrl-C outside training).
"""

from __future__ import annotations

import os
import sys
import time
import traceback

import click

from ..core.errors import UserError
from . import check, model, pictures, resume, train  # noqa: F401 (the commands register on ``cli`` as they are imported)
from .common import _mpi, cli, echo

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
ABORT_PAUSE = 1.0       # seconds between a rank's last words and MPI_Abort


def main(argv=None) -> None:
    """Console entry point: run a command, turn errors into exit statuses."""
    _init_mpi()
    try:
        _choose_wait()
        status = cli.main(args=argv, prog_name="mpicube", standalone_mode=False)
    except (KeyboardInterrupt, click.exceptions.Abort):
        _fail("interrupted", EXIT_INTERRUPTED, agree=False)
    except click.ClickException as exc:
        if type(exc).__name__ == "NoArgsIsHelpError":      # bare `mpicube` (click >= 8.2): the help
            echo(exc.format_message())
            sys.exit(EXIT_USAGE)
        _fail(_click_message(exc), EXIT_USAGE)
    except UserError as exc:          # DataError and CheckpointError are UserErrors too
        _fail(str(exc), getattr(exc, "exit_code", EXIT_USAGE))
    except Exception:  # noqa: BLE001 - anything else is a bug: traceback, abort the job
        _crash()
    sys.stdout.flush()
    sys.exit(status if isinstance(status, int) else 0)


def _choose_wait() -> None:
    """How a collective's wait passes the time: "yield" (default), or "block"
    (MPI's own Wait: the baseline tools/wait_bench.py measures against).
    Inside main's error handling, so a bad value is one line and exit 2."""
    from ..parallel import waiting

    try:
        waiting.set_mode(os.environ.get("MPICUBE_WAIT", "yield"))
    except ValueError as exc:
        raise UserError(f"MPICUBE_WAIT: {exc}") from None


def _init_mpi() -> None:
    # Before MPI_Init: MPICH's blocking calls yield the core with a nanosleep
    # instead of spinning, unless the user chose (mpicube.parallel.waiting).
    os.environ.setdefault("MPIR_CVAR_ENABLE_HEAVY_YIELD", "1")
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    _mpi["world"] = world
    if world.Get_size() > 1 and _mpi["errors"] is None:
        _mpi["errors"] = world.Dup()   # errors are agreed here, never in a communicator a collective may be using


def _click_message(exc: click.ClickException) -> str:
    message = " ".join(exc.format_message().split())
    ctx = getattr(exc, "ctx", None)
    if isinstance(exc, click.UsageError) and ctx is not None:
        message += f" (see '{ctx.command_path} --help')"
    return message


def _all_ranks_failed(timeout: float) -> bool:
    """Whether every rank reaches this point within ``timeout`` seconds."""
    request = _mpi["errors"].Ibarrier()
    deadline = time.monotonic() + timeout
    while not request.Test():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def _grace_seconds() -> float:
    try:
        return float(os.environ.get("MPICUBE_ERROR_GRACE", "3"))
    except ValueError:
        return 3.0


def _fail(message: str, status: int, agree: bool = True) -> None:
    """Report a user-facing error once and end the job with ``status``."""
    world = _mpi["world"]
    message = " ".join(message.split()) or "failed"
    if world is None or world.Get_size() == 1:
        click.echo(f"error: {message}", err=True)
        sys.exit(status)
    if agree and _all_ranks_failed(_grace_seconds()):
        if world.Get_rank() == 0:
            click.echo(f"error: {message}", err=True)
        sys.stdout.flush()
        sys.stderr.flush()
        sys.exit(status)
    # Other ranks are still busy or waiting in a collective: this rank speaks and ends the job.
    click.echo(f"error: rank {world.Get_rank()}: {message}", err=True)
    _abort(world, status)


def _abort(world, status: int) -> None:
    """MPI_Abort the job; it may return before the launcher has killed this
    process, and nothing may run after it. MPI_Abort tears the job down at
    once, and output this rank has just written may still be on its way
    through the launcher: pause a moment first so the message is not lost."""
    sys.stdout.flush()
    sys.stderr.flush()
    time.sleep(ABORT_PAUSE)
    world.Abort(status)
    os._exit(status)


def _crash() -> None:
    """An unexpected exception: traceback with the rank, then abort every rank."""
    world = _mpi["world"]
    text = traceback.format_exc()
    if world is not None and world.Get_size() > 1:
        rank = world.Get_rank()
        text = "".join(f"[rank {rank}] {line}" for line in text.splitlines(keepends=True))
    sys.stdout.flush()
    sys.stderr.write(text)
    sys.stderr.flush()
    if world is not None and world.Get_size() > 1:
        _abort(world, 1)
    sys.exit(1)
