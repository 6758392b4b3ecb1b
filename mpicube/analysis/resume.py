"""``mpicube check-resume``: a run saved by one layout and world size and
resumed on another continues the same run, tensor by tensor.

Why a command of its own: what a resume loses - AdamW's moments, the
loss scale, a mixture's router state, the step count, the data position -
does not show in the first loss after it (which needs only the
parameters), and a resharded checkpoint is where frameworks lose it. So
three runs of the same model and options are traced with ``--state``:

1. ``first``: steps 1..A on the first layout and world size, which then
   saves a checkpoint (``trace --stop-after A --run-dir DIR/run``);
2. ``second``: that checkpoint resumed on the other layout and world size,
   steps A+1..A+B (``trace --resume --run-dir DIR/run``), in a new job, so
   nothing but the checkpoint carries the state across;
3. ``reference``: the uninterrupted serial run of A+B steps.

The first two are put together into one trace of A+B steps
(``DIR/resumed.h5``) and compared with the reference by ``compare``
(losses, activations, gradients, parameters, moments, loss scale, RNG
offset, expert loads, every step). It fails closed: a run that fails, a
trace that lacks a step it should hold or holds one it should not, a
compared step without its loss, every gradient, parameter and (AdamW)
both moments of every parameter, and parameters read back on the second
layout that are not bit for bit those the first saved, are each a
failure, besides what ``compare`` fails on. The verdict is one line;
exit status 0 equal, 1 not (or a run failed), 2 bad input.

The two parallel runs are launched here (``mpiexec -n N``, the one beside
this Python unless given), or printed (``--print-commands``) for a batch
system to run, after which ``--compare-only`` compares what they wrote.
The serial reference runs in this process.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np

from ..check.compare import compare_traces
from ..check.names import MOMENTS
from ..check.report import format_report
from ..check.writer import StagedFile
from ..core.errors import UserError
from ..parallel.planning import resolve
from ..training.options import TrainOptions
from .trace import run_trace

REFERENCE, FIRST, SECOND, RESUMED, RUN = "reference.h5", "first.h5", "second.h5", "resumed.h5", "run"
# the launcher's own variables, which a job started from inside another MPI job must not inherit
LAUNCHER_ENV = ("PMI_", "PMIX_", "HYDRA_", "HYDI_", "MPI_LOCALRANKID", "MPI_LOCALNRANKS", "OMPI_")


@dataclass
class Run:
    """One of the three runs: its label, world size, ``trace`` arguments
    (for the command line) and the options they parse to (for the checks)."""

    label: str
    ranks: int
    argv: list
    options: dict

    def describe(self) -> str:
        return f"{self.options['layout']} on {self.ranks} rank{'s' if self.ranks > 1 else ''}"


def check_plans(runs: list) -> None:
    """Every run's options and layout on its world size, as train checks
    them, before anything runs: a refusal is one line naming the run."""
    known = {f.name for f in fields(TrainOptions)}
    for run in runs:
        opts = TrainOptions(**{k: v for k, v in run.options.items() if k in known and k != "out"})
        try:
            opts.validate()
            resolve(opts.plan, opts.model_config(), opts.batch_size, run.ranks, seq_len=opts.seq_len)
        except UserError as exc:
            raise UserError(f"the {run.label} run ({run.describe()}): {exc}") from None


def mpiexec_path(given) -> str:
    """``--mpiexec``, else the mpiexec beside this Python, else the one on PATH."""
    if given:
        return given
    beside = Path(sys.executable).parent / "mpiexec"
    found = str(beside) if beside.exists() else shutil.which("mpiexec")
    if found is None:
        raise UserError("no mpiexec beside this Python or on PATH: give --mpiexec, or --print-commands and run "
                        "the lines yourself")
    return found


def command(run: Run, mpiexec) -> list:
    """The command line of a run: the reference in this process's way
    (``mpicube trace``), the parallel ones under the launcher."""
    if mpiexec is None:
        return ["mpicube", *run.argv]
    return [*shlex.split(mpiexec), "-n", str(run.ranks), sys.executable, "-m", "mpicube", *run.argv]


def launch(run: Run, mpiexec: str, say) -> None:
    """Run one parallel run to its end; a failure is the check's failure
    (bad input, exit 2, where the run refused its input)."""
    argv = command(run, mpiexec)
    say(f"{run.label}: {shlex.join(argv)}")
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER_ENV)}
    status = subprocess.run(argv, env=env).returncode
    if status != 0:
        raise RunFailed(f"the {run.label} run ({run.describe()}) exited with status {status}", status)


class RunFailed(UserError):
    """A launched run that did not finish: bad input (its status 2) stays
    bad input, anything else is the check failing (exit 1)."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.exit_code = 2 if status == 2 else 1


# --------------------------------------------------------------------------- the traces put together


def _steps_held(f) -> set:
    return {int(k[5:]) for k in f if k.startswith("step_") and k[5:].isdigit()}


def join(first_path: Path, second_path: Path, out: Path, a: int, n: int) -> list:
    """Write ``out``: ``first_path``'s batches, initial parameters and steps
    1..a, ``second_path``'s steps a+1..n, as one trace of n steps. Returns
    the problems that make the check fail whatever the comparison says: a
    trace holding other steps than its share, and parameters that the
    second run read back (its ``init/``) that are not exactly those the
    first ended with."""
    import h5py

    problems = []
    with h5py.File(first_path, "r") as fa, h5py.File(second_path, "r") as fb:
        for f, want, label in ((fa, set(range(1, a + 1)), "first"), (fb, set(range(a + 1, n + 1)), "second")):
            held = _steps_held(f)
            if held != want:
                problems.append(f"the {label} run's trace holds steps {_span(held)}, not {_span(want)}")
        saved, read_back = fa.get(f"step_{a}/param"), fb.get("init")
        if saved is None or read_back is None or set(saved) != set(read_back) or not len(saved):
            problems.append(f"the parameters saved after step {a} and those read back cannot be set side by side")
        else:
            differ = [k for k in sorted(saved) if not np.array_equal(saved[k][()], read_back[k][()])]
            if differ:
                problems.append(f"the second run read back other parameters than the first saved after step {a}: "
                                f"{', '.join(differ[:3])}{', ...' if len(differ) > 3 else ''}")
        staged = StagedFile(out)
        try:
            for key, value in fa.attrs.items():
                if key != "first_step":
                    staged.f.attrs[key] = value
            staged.f.attrs["steps"] = n
            staged.f.attrs["layout"] = json.dumps({"resumed": f"steps 1-{a} then {a + 1}-{n}",
                                                   "first": _json(fa.attrs.get("layout")),
                                                   "second": _json(fb.attrs.get("layout"))})
            staged.f.create_dataset("tokens", data=np.concatenate([fa["tokens"][()], fb["tokens"][()]]))
            fa.copy(fa["init"], staged.f, "init")
            for f, steps in ((fa, range(1, a + 1)), (fb, range(a + 1, n + 1))):
                for s in steps:
                    if f"step_{s}" in f:
                        f.copy(f[f"step_{s}"], staged.f, f"step_{s}")
            staged.commit()
        except BaseException:
            staged.discard()
            raise
    return problems


def _json(raw):
    try:
        return json.loads(raw.decode() if isinstance(raw, bytes) else str(raw))
    except (TypeError, ValueError):
        return None


def _span(steps: set) -> str:
    if not steps:
        return "none"
    lo, hi = min(steps), max(steps)
    if lo == hi:
        return str(lo)
    return f"{lo}-{hi}" if steps == set(range(lo, hi + 1)) else ", ".join(map(str, sorted(steps)))


# --------------------------------------------------------------------------- what was compared


def coverage(result, params: list, steps: int, moments: bool) -> tuple:
    """({kind: compared count}, problem or None): every step 1..steps must
    have had its loss, every gradient and parameter and, with ``moments``,
    both of AdamW's moments of every parameter compared (module
    docstring); a comparison short of that proves less than it says."""
    compared = {r.name for r in result.rows if r.compared}
    counts = {"losses": 0, "gradients": 0, "parameters": 0, "moments": 0, "other": 0}
    for name in compared:
        kind = name.split("/")[1] if name.startswith("step_") and "/" in name else ""
        key = {"loss": "losses", "grad": "gradients", "param": "parameters"}.get(kind)
        if kind == "state" and name.split("/")[2] in MOMENTS:
            key = "moments"
        counts[key or "other"] += 1
    for s in range(1, steps + 1):
        want = [f"step_{s}/loss"] + [f"step_{s}/{k}/{p}" for p in params for k in ("grad", "param")]
        want += [f"step_{s}/state/{m}/{p}" for p in params for m in MOMENTS] if moments else []
        lacking = [w for w in want if w not in compared]
        if lacking:
            return counts, f"step {s}: {lacking[0]} was not compared ({len(lacking)} of its {len(want)} not)"
    return counts, None


# --------------------------------------------------------------------------- the check


def run_check_resume(runs: dict, a: int, b: int, out: Path, mpiexec, mode: str, say=print) -> dict:
    """``runs``: {"reference", "first", "second": Run}; ``mode``: "run"
    (launch everything), "print" (say the command lines, run nothing) or
    "compare" (the traces are in ``out`` already). Returns {"ok", "line",
    "summary"}; bad input raises UserError before anything is written."""
    check_plans(list(runs.values()))
    if mode == "print":
        say(shlex.join(command(runs["reference"], None)))
        for key in ("first", "second"):
            say(shlex.join(command(runs[key], mpiexec or "mpiexec")))
        return {"ok": True, "line": "then: the same check-resume command with --compare-only", "summary": None}
    made = False
    if mode == "run":
        mpiexec = mpiexec_path(mpiexec)
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise UserError(f"--out {out}: exists and is not an empty directory (check-resume writes three traces "
                            "and a run directory there)")
        if not out.parent.is_dir():
            raise UserError(f"--out {out}: directory {out.parent} does not exist")
        made = not out.exists()
        out.mkdir(exist_ok=True)
    else:
        lacking = [name for name in (REFERENCE, FIRST, SECOND) if not (out / name).is_file()]
        if lacking:
            raise UserError(f"--compare-only: {out} lacks {', '.join(lacking)} (run the lines of --print-commands)")
    try:
        if mode == "run":
            run_trace(runs["reference"].options, _self(), say=say)
            for key in ("first", "second"):
                launch(runs[key], mpiexec, say)
        problems = join(out / FIRST, out / SECOND, out / RESUMED, a, a + b)
    except UserError as exc:
        if made and not isinstance(exc, RunFailed):
            shutil.rmtree(out, ignore_errors=True)      # bad input leaves nothing behind
        raise
    return verdict(runs, a, b, out, problems, say)


def _self():
    from mpi4py import MPI

    return MPI.COMM_SELF


def verdict(runs: dict, a: int, b: int, out: Path, problems: list, say) -> dict:
    """Compare the joined trace with the reference; the report goes to
    ``out/compare.txt``, the failing rows (ten at most) and the verdict
    line to ``say``."""
    import h5py

    result = compare_traces(str(out / REFERENCE), str(out / RESUMED))
    (out / "compare.txt").write_text(format_report(result) + "\n")
    with h5py.File(out / REFERENCE, "r") as f:
        params = sorted(f["init"])
    moments = runs["reference"].options.get("optimizer", "adamw") == "adamw"
    counts, lacking = coverage(result, params, a + b, moments)
    if lacking:
        problems = problems + [lacking]
    bad = [r for r in result.rows if not r.ok]
    for r in bad[:10]:
        say(f"  {r.name}: {r.note or f'max rel {r.max_rel:.2e}'}")
    first, second = runs["first"], runs["second"]
    story = (f"{first.describe()} for steps 1-{a}, saved, resumed as {second.describe()} for steps "
             f"{a + 1}-{a + b}")
    what = ", ".join(f"{v} {k}" for k, v in counts.items() if v)
    worst = result.max_rel
    if not bad and not problems:
        line = (f"check-resume: OK: {story}: equal to the uninterrupted serial run in all {sum(counts.values())} "
                f"tensors ({what}), largest relative difference {worst:.1e}")
    else:
        why = [f"first divergence {bad[0].name}" + (f" ({bad[0].note})" if bad[0].note else "")] if bad else []
        line = f"check-resume: FAILED: {story}: " + "; ".join(why + problems)
    say(line)
    summary = {**result.summary(), "ok": not bad and not problems, "problems": problems,
               "max_rel": worst if math.isfinite(worst) else None, "compared": counts}
    return {"ok": not bad and not problems, "line": line, "summary": summary}
