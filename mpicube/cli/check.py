"""``mpicube compare``: the checker's command, two traces tensor by tensor
(``mpicube.check``, which also runs without MPI as ``python -m
mpicube.check``). Registered on the group of ``mpicube.cli``, whose error
handling it shares."""

from __future__ import annotations

import json

import click

from .common import _mpi, cli, echo


@cli.command()
@click.argument("trace_a", metavar="A.h5")
@click.argument("trace_b", metavar="B.h5")
@click.option("--rtol", type=float, default=None,
              help="relative tolerance, against the larger max |x| of the two tensors  "
                   "[default: 1e-10 float64, 1e-3 float32, 5e-2 float16/bfloat16]")
@click.option("--atol", type=float, default=None,
              help="absolute tolerance  [default: 1e-13 float64, 1e-6 float32, 1e-3 float16/bfloat16]")
@click.option("--allow-missing", "allow_missing", multiple=True, metavar="GLOB",
              help="dataset paths that may be absent from one trace (shell pattern, e.g. 'step_*/act/h.*.attn'; "
                   "'@dtype' for a root attribute); repeatable")
@click.option("--tolerance", "verdict", type=click.Choice(["budget", "depth", "envelope"]), default="budget",
              show_default=True, help="what decides: the per-dtype budget (--rtol/--atol), the depth-aware bound "
              "(relative Frobenius error <= 16 u depth), or the envelope measured by trace --envelope (k = 4 "
              "times each tensor's spread over reruns); budget and depth bound are printed")
@click.option("--json", "as_json", is_flag=True,
              help='end stdout with {"first_divergence": NAME or null, "max_rel": ..., "tensors": N}')
def compare(trace_a, trace_b, rtol, atol, allow_missing, verdict, as_json):
    """Compare two traces tensor by tensor; name the first divergence.

    A tensor agrees when max |a - b| <= atol + rtol * max(max |a|, max |b|);
    defaults follow the coarser dtype of the two traces. The first
    divergence is named in the order the computation happens: the batches,
    the initial parameters, then per step the forward (emb, h.0, ...,
    ln_f, logits, loss), the gradients as backward produces them, the
    gradient norm and learning rate, the updated parameters. It fails
    closed: NaN or inf against anything but the same value, a tensor or
    step in one trace only, a shape or dtype the format does not give, a
    missing dtype/steps/optimizer attribute are divergences. Exit status 0
    when all agree, 1 when something diverges, 2 when a file is not a
    trace, cannot be read, or the two model configs differ. Without MPI:
    python -m mpicube.check A.h5 B.h5.
    """
    from ..check.compare import compare_traces
    from ..check.report import format_report
    from ..parallel.comm import on_root

    result = on_root(_mpi["world"], lambda: compare_traces(trace_a, trace_b, rtol, atol, allow_missing, verdict))
    echo(format_report(result))
    if as_json:
        echo(json.dumps(result.summary()))
    return 0 if result.first_divergence is None else 1
