"""``mpicube check-resume``: save on one layout and world size, resume on
another, compare every step with the uninterrupted serial run
(``analysis.resume`` says what is run and checked).

The command takes trace's model and run options once, for all three
runs, and each side's layout, world size and layout options
(``--from-args "--dp 2 --zero 1"``) apart. It builds each run's ``trace``
command line from them and parses that line with ``trace`` itself, so
the lines it launches or prints are exactly what is checked.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import click

from ..core.errors import UserError
from .common import LAYOUT_CHOICES, _mpi, cli, echo, env_settings
from .train import trace_command

# the options that may differ between the two sides (given with --from-args / --to-args)
SIDE_OPTIONS = ("dp", "cp", "cp_kind", "ulysses", "hsdp", "depth", "pp", "pp_schedule", "virtual_stages",
                "grad_accum", "recompute", "zero", "sequence_parallel", "ep")
# trace's own options that check-resume sets itself, or that do not apply to it
NOT_COMMON = SIDE_OPTIONS + ("layout", "config", "steps", "out", "sharded", "state", "envelope", "suite", "run_dir",
                             "resume", "stop_after", "init_from", "dtype", "help")
COMMON = [p for p in trace_command.params if p.name not in NOT_COMMON and p.expose_value]


def _words(param, value) -> list:
    """``param`` given ``value`` as command-line words ([] at trace's default)."""
    if value is None or value == param.default:
        return []
    if param.is_flag and param.secondary_opts:
        return [param.opts[0] if value else param.secondary_opts[0]]
    if param.is_flag:
        return [param.opts[0]] if value else []
    values = value if param.multiple else [value]
    return [w for v in values for w in (param.opts[0], repr(v) if isinstance(v, float) else str(v))]


def _side_args(text: str, option: str) -> list:
    """The words of --from-args/--to-args, refused unless each is a layout option."""
    words = shlex.split(text or "")
    side = click.Command("side", params=[p for p in trace_command.params if p.name in SIDE_OPTIONS])
    try:
        side.make_context(option, list(words), resilient_parsing=False)
    except click.UsageError as exc:
        names = ", ".join("--" + n.replace("_", "-") for n in SIDE_OPTIONS)
        raise UserError(f"{option} {text!r}: {exc.format_message()} (it takes the options a side may change: "
                        f"{names}; give model and run options once, outside it)") from None
    return words


def _parsed(argv: list, label: str) -> dict:
    """``trace``'s options of ``argv`` as trace itself parses them."""
    try:
        ctx = trace_command.make_context("trace", list(argv), resilient_parsing=False)
    except click.UsageError as exc:
        raise UserError(f"the {label} run's options: {exc.format_message()}") from None
    return {**ctx.params, **env_settings()}


@cli.command("check-resume")
@click.option("--from-layout", required=True, type=click.Choice(LAYOUT_CHOICES[1:]), help="the layout of steps 1..A")
@click.option("--from-ranks", required=True, type=click.IntRange(min=1), help="its world size")
@click.option("--from-args", default="", metavar="'OPTIONS'", help="its layout options, e.g. '--dp 2 --zero 1'")
@click.option("--to-layout", required=True, type=click.Choice(LAYOUT_CHOICES[1:]),
              help="the layout that resumes the checkpoint for steps A+1..A+B")
@click.option("--to-ranks", required=True, type=click.IntRange(min=1), help="its world size")
@click.option("--to-args", default="", metavar="'OPTIONS'", help="its layout options")
@click.option("--steps", "a", required=True, type=click.IntRange(min=1), metavar="A",
              help="steps before the checkpoint")
@click.option("--then", "b", required=True, type=click.IntRange(min=1), metavar="B", help="steps after it")
@click.option("--dtype", type=click.Choice(["float64", "float32", "float16", "bfloat16"]), default="float64",
              show_default=True, help="every run's precision (float64 checks to 1e-10)")
@click.option("--out", required=True, metavar="DIR",
              help="a new folder for the three traces (reference.h5, first.h5, second.h5), the two put together "
                   "(resumed.h5), the run directory (run/) and compare's report (compare.txt)")
@click.option("--mpiexec", default=None, metavar="LAUNCHER",
              help="what starts a parallel run, followed by -n N  [default: the mpiexec beside this Python]")
@click.option("--print-commands", is_flag=True, help="print the three runs' command lines, run nothing")
@click.option("--compare-only", is_flag=True, help="compare the traces the printed commands wrote into --out")
@click.option("--json", "as_json", is_flag=True, help="end stdout with the verdict as JSON")
def check_resume(from_layout, from_ranks, from_args, to_layout, to_ranks, to_args, a, b, dtype, out, mpiexec,
                 print_commands, compare_only, as_json, **common):
    """Save on one layout, resume on another, compare with the serial run.

    Runs steps 1..A on --from-layout (--from-ranks ranks) and saves a
    checkpoint, resumes it on --to-layout (--to-ranks ranks) for steps
    A+1..A+B, and compares every step - loss, activations, gradients,
    parameters, AdamW moments, loss scale, RNG offset, expert loads -
    with the uninterrupted serial run of A+B steps (traces written with
    --state). One verdict line; exit status 0 equal, 1 not (or a run
    failed), 2 bad input. Run it as one process: it launches the two
    parallel runs itself (or prints them: --print-commands).
    """
    from ..analysis.resume import RunFailed, Run, run_check_resume

    if print_commands and compare_only:
        raise UserError("--print-commands and --compare-only: give one (print the runs, or compare what they wrote)")
    mode = "print" if print_commands else "compare" if compare_only else "run"
    if _mpi["world"] is not None and _mpi["world"].Get_size() > 1:
        raise UserError("check-resume launches its own ranks: run it as one process, not under mpiexec")
    if common.get("batch_size") is None:
        raise UserError("check-resume needs --batch-size (the three runs take the same batches)")
    shared = [w for p in COMMON for w in _words(p, common.get(p.name))] + ["--dtype", dtype, "--state"]
    n = a + b
    out = Path(out)
    sides = {"reference": ("serial", 1, [], []),
             "first": (from_layout, from_ranks, _side_args(from_args, "--from-args"),
                       ["--stop-after", str(a), "--run-dir", str(out / "run")]),
             "second": (to_layout, to_ranks, _side_args(to_args, "--to-args"), ["--resume", "--run-dir", str(out / "run")])}
    runs = {}
    for label, (layout, ranks, side, extra) in sides.items():
        argv = ["trace", "--layout", layout, *side, *shared, "--steps", str(n), *extra, "--out", str(out / f"{label}.h5")]
        runs[label] = Run(label, ranks, argv, _parsed(argv[1:], label))
    try:
        result = run_check_resume(runs, a, b, out, mpiexec, mode, say=echo)
    except RunFailed as exc:
        echo(f"check-resume: FAILED: {exc}")
        return exc.exit_code
    if mode == "print":
        echo(result["line"])
        return 0
    if as_json:
        echo(json.dumps(result["summary"]))
    return 0 if result["ok"] else 1


check_resume.params += COMMON          # trace's model and run options, given once for the three runs
