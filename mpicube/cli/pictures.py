"""``mpicube timeline`` and ``plot``: pictures of a run, drawn with
matplotlib from the files it wrote (a profile, metrics.jsonl). Registered
on the group of ``mpicube.cli``, whose error handling they share."""

from __future__ import annotations

import click

from .common import _mpi, cli, echo


@cli.command()
@click.argument("run_dir")
@click.option("--out", metavar="FILE.png",
              help="the picture to write  [default: RUN_DIR/timeline.png, or TRACE.png beside a trace file]")
@click.option("--width", type=float, default=12.0, show_default=True, help="inches across")
def timeline(run_dir, out, width):
    """Draw RUN_DIR/profile.json (train or bench --profile) as a picture.

    Ranks down, time across; for each rank a lane of compute and one per
    communication axis, each in its own colour: calls and waits solid,
    nonblocking calls in flight pale. RUN_DIR may also be the trace file.
    """
    from ..analysis.timeline import default_out, draw

    echo(draw(run_dir, out if out is not None else default_out(run_dir), width))


@cli.command()
@click.argument("run_dirs", nargs=-1, required=True, metavar="RUN_DIR [RUN_DIR...]")
@click.option("--out", required=True, metavar="FILE.png", help="the picture to write")
@click.option("--width", type=float, default=9.0, show_default=True, help="inches across")
def plot(run_dirs, out, width):
    """Draw the loss curves of one or more runs, overlaid, into a PNG.

    From each RUN_DIR/metrics.jsonl: the training loss (each step faint, a
    moving average solid), the validation loss (dashed) and, for a mixture
    of experts, the expert load (the busiest expert's tokens over the
    mean's, per step).
    """
    from ..analysis.curves import draw
    from ..parallel.comm import on_root

    echo(on_root(_mpi["world"], lambda: draw(list(run_dirs), out, width)))
