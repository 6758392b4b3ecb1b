"""The ``mpicube`` command line: the group, the options several commands
share, and the error handling every command runs under. The commands live
in ``cli_train`` (train, eval, prepare, trace) and ``cli_model`` (info,
bench, inspect, convert, generate, compare), imported at the end.

Run it as ``mpiexec -n P mpicube train ...`` (or ``python -m mpicube``).

Errors (DESIGN.md section 7). Bad input - ``UserError`` (``ConfigError`` is
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
2 bad input, 3 training diverged, 75 stopped by a signal or ``--time-limit``
with a checkpoint written (resume with ``--resume``), 130 interrupted.
"""

from __future__ import annotations

import os
import sys
import time
import traceback

import click

from . import __version__
from .errors import UserError

try:                                    # Python >= 3.11
    import tomllib
except ModuleNotFoundError:             # pragma: no cover - older Pythons
    import tomli as tomllib

LAYOUT_CHOICES = ("auto", "serial", "1d", "2d", "2.5d", "3d")
DTYPE_CHOICES = ("float32", "float64", "float16", "bfloat16")
RECOMPUTE_CHOICES = ("none", "gathers", "blocks")   # layouts/base.py RECOMPUTE_MODES
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
ABORT_PAUSE = 1.0       # seconds between a rank's last words and MPI_Abort

_mpi = {"world": None, "errors": None}   # COMM_WORLD and a private duplicate for error agreement


# --------------------------------------------------------------------------- small helpers


def _rank() -> int:
    world = _mpi["world"]
    return 0 if world is None else world.Get_rank()


def echo(text: str = "", err: bool = False) -> None:
    """Print on rank 0 only."""
    if _rank() == 0:
        click.echo(text, err=err)


class Duration(click.ParamType):
    """Seconds, or [[H:]M:]S like a batch system's time limit."""

    name = "seconds"

    def convert(self, value, param, ctx):
        if isinstance(value, (int, float)):
            return float(value)
        try:
            parts = [float(p) for p in str(value).split(":")]
        except ValueError:
            self.fail(f"{value!r} is not a number of seconds or [[H:]M:]S", param, ctx)
        if len(parts) > 3:
            self.fail(f"{value!r} has too many ':' fields (use [[H:]M:]S)", param, ctx)
        seconds = 0.0
        for p in parts:
            seconds = seconds * 60 + p
        return seconds


def _load_config(ctx, param, path):
    """``--config FILE.toml``: its keys (option names, dashes or underscores)
    become defaults, so options given on the command line override them."""
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except OSError as exc:
        raise click.BadParameter(f"{path}: cannot read ({exc.strerror})", ctx, param) from None
    except tomllib.TOMLDecodeError as exc:
        raise click.BadParameter(f"{path}: not valid TOML ({exc})", ctx, param) from None
    known = {p.name for p in ctx.command.params if p.expose_value}
    values = {}
    for key, value in doc.items():
        name = key.replace("-", "_")
        if name not in known or isinstance(value, dict):
            raise click.BadParameter(f"{path}: unknown key {key!r}; valid keys are option names such as "
                                     f"{', '.join(sorted(known)[:6])}, ...", ctx, param)
        values[name] = value
    ctx.default_map = {**(ctx.default_map or {}), **values}
    return path


def model_options(f):
    """The model's shape, shared by ``train`` and ``info``."""
    f = click.option("--seq-len", type=int, default=64, show_default=True,
                     help="sequence length T, also the model's context n_ctx")(f)
    f = click.option("--n-embd", type=int, default=144, show_default=True, help="hidden size h")(f)
    f = click.option("--n-head", type=int, default=12, show_default=True, help="attention heads")(f)
    f = click.option("--n-layer", type=int, default=4, show_default=True, help="transformer blocks")(f)
    return f


def layout_options(f):
    f = click.option("--depth", type=int, default=1, show_default=True, help="depth d of the 2.5d layout")(f)
    f = click.option("--dp", type=int, default=1, show_default=True,
                     help="data-parallel replicas; the world splits into dp x tensor-parallel ranks")(f)
    f = click.option("--layout", type=click.Choice(LAYOUT_CHOICES), default="auto", show_default=True,
                     help="tensor-parallel scheme; auto: 2.5d with --depth, else 3d on a cube, 2d on a "
                          "square, 1d otherwise")(f)
    return f


def recompute_option(f):
    return click.option("--recompute", type=click.Choice(RECOMPUTE_CHOICES), default="none", show_default=True,
                        help="trade memory for communication and FLOPs: gathers = gather weight and activation "
                             "panels again in backward instead of keeping them; blocks = keep only each "
                             "block's input and rerun its forward in backward")(f)


def zero_option(help_text: str):
    """``--zero {0,1}`` as an int (train, bench, info; each says what it does there)."""
    return click.option("--zero", type=click.Choice(["0", "1"]), default="0", show_default=True,
                        callback=lambda ctx, param, value: int(value), help=help_text)


def grad_accum_option(help_text: str):
    """``--grad-accum N`` (train, bench, info; each says what it does there)."""
    return click.option("--grad-accum", type=int, default=1, show_default=True, help=help_text)


def device_options(f):
    f = click.option("--device", type=click.Choice(["cpu", "gpu"]), default="cpu", show_default=True,
                     help="NumPy on CPUs or CuPy, one GPU per rank")(f)
    f = click.option("--dtype", type=click.Choice(DTYPE_CHOICES), default="float32", show_default=True,
                     help="float64 verifies, float32 trains; float16 and bfloat16 train in mixed precision "
                          "(16-bit activations and communication, float32 master weights)")(f)
    f = click.option("--tf32", is_flag=True, default=False,
                     help="GPU: float32 GEMMs on tensor cores (TF32 inputs, float32 accumulation)")(f)
    return f


# --------------------------------------------------------------------------- commands


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="mpicube")
def cli():
    """GPT-2 training with 1-D, 2-D, 2.5-D and 3-D tensor parallelism, in NumPy/CuPy over MPI.

    Run under MPI: mpiexec -n 8 mpicube train --layout 3d
    """


def main(argv=None) -> None:
    """Console entry point: run a command, turn errors into exit statuses."""
    _init_mpi()
    try:
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


def _init_mpi() -> None:
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


# The commands register themselves on ``cli`` (they import it from here).
from . import cli_model, cli_train  # noqa: E402,F401
