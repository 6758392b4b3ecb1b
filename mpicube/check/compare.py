"""Two traces, tensor by tensor, and the first place where they part;
failing closed (``mpicube compare``, or ``python -m mpicube.check`` where
there is no MPI).

A checker that passes what it did not check is worse than none, so
everything that is not a positive agreement is a divergence (exit 1),
named in the order the computation happens (names.py):

- a NaN or infinity on either side, unless both hold the same non-finite
  value at the same place (then the row says so and the rest is compared);
- a tensor or a whole step present in one trace only, or a step that the
  ``steps`` attribute declares but neither file holds, unless an
  ``--allow-missing`` pattern covers it (a framework that cannot produce a
  tensor) or the trace lacking it is of a format version older than the
  tensor (names.NEW_IN: a version 1 trace has no activations inside the
  blocks, and is still compared on everything else);
- a sharded tensor (shards.py) whose replicas part, or with elements no
  rank holds;
- a shape mismatch, a tensor stored in another dtype than the format's;
- a missing required root attribute (``@dtype``, ``@steps``, ``@optimizer``;
  patterns allow them too). Without ``dtype`` the tolerance follows the
  data's dtype, so a missing attribute never loosens it;
- a comparison that compared nothing, or a step both traces hold of which
  no activation, gradient or parameter was compared (a trace holding only
  a loss), whatever ``--allow-missing`` allows: an empty comparison
  proves nothing.

Each compared tensor gets the per-dtype budget and the depth-aware bound
(tolerance.py); the budget decides unless ``tolerance="depth"``. Memory is
bounded by what the files store, never by what they declare: shapes are
compared before anything is read, tensors are read in blocks (measure.py),
and steps declared but held by neither file are reported as ranges.
"""

from __future__ import annotations

import fnmatch
import math
import re
from dataclasses import dataclass, field

import numpy as np

from ..core.errors import UserError
from . import envelope
from . import fp8_tolerance
from . import tolerance as tol
from .diagnose import notes as diagnosis
from .measure import Row, measure
from .names import STEP_KINDS, depth, missing_by_version, ordered, step_of
from .precision import precision_rows
from .shards import stored_shape
from .tracefile import (DTYPES, REQUIRED_ATTRS, datasets, describe, expected_dtype, open_trace, read_config,
                        reader, steps_present, trace_dtype, version)

RANGE_CHECKED = 1000        # a range of missing steps longer than this is never allowed (each step is not matched)


@dataclass
class Result:
    path_a: str
    path_b: str
    rtol: float
    atol: float
    dtypes: tuple
    labels: tuple = ("", "")                             # what produced each trace, for the header
    verdict: str = "budget"                              # or "depth"
    rows: list = field(default_factory=list)             # in computation order
    allowed: list = field(default_factory=list)          # missing, but covered by --allow-missing

    @property
    def first_divergence(self):
        return next((r.name for r in self.rows if not r.ok), None)

    @property
    def max_rel(self):
        compared = [r.max_rel for r in self.rows if r.compared]
        return max(compared) if compared else 0.0

    def summary(self) -> dict:
        """The --json line; a non-finite max_rel (shapes differ, NaN) is null."""
        worst = self.max_rel
        return {"first_divergence": self.first_divergence, "max_rel": worst if math.isfinite(worst) else None,
                "tensors": sum(r.compared for r in self.rows)}


# --------------------------------------------------------------------------- two traces


def allowed_by(name: str, patterns) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def missing_rows(side: str, other: str, names: set, other_names: set, patterns) -> list:
    """Rows for ``names`` of trace ``side`` that the ``other`` lacks; a
    step the other lacks altogether is one row ``step_%d``."""
    rows = []
    whole = steps_present(names) - steps_present(other_names)
    by_step = {}
    for n in names:
        if step_of(n) in whole:
            by_step.setdefault(step_of(n), []).append(n)
    for s in sorted(whole):
        ok = allowed_by(f"step_{s}", patterns) or all(allowed_by(n, patterns) for n in by_step[s])
        rows.append(Row(f"step_{s}", (), math.inf, math.inf, ok, f"step {s} only in {side} (missing in {other})",
                        compared=False))
    for n in names:
        if step_of(n) in whole:
            continue
        rows.append(Row(n, (), math.inf, math.inf, allowed_by(n, patterns), f"only in {side}", compared=False))
    return rows


def compare_traces(path_a, path_b, rtol=None, atol=None, allow_missing=(), verdict="budget") -> Result:
    """Compare two trace files (see the module docstring); bad input raises UserError."""
    if verdict not in ("budget", "depth", "envelope"):
        raise UserError(f"--tolerance {verdict!r}: use budget, depth or envelope")
    fa = open_trace(path_a)
    try:
        fb = open_trace(path_b)
    except UserError:
        fa.close()
        raise
    with fa, fb:
        cfg_a, cfg_b = read_config(fa, path_a), read_config(fb, path_b)
        if cfg_a != cfg_b:
            keys = list(cfg_a) + [k for k in cfg_b if k not in cfg_a]     # a mixture's keys in one only
            differ = ", ".join(f"{k} {cfg_a.get(k, 'absent')} vs {cfg_b.get(k, 'absent')}" for k in keys
                               if cfg_a.get(k) != cfg_b.get(k))
            raise UserError(f"the traces are of different models: {differ}")
        sets = {"A": datasets(fa), "B": datasets(fb)}
        files, paths = {"A": fa, "B": fb}, {"A": path_a, "B": path_b}
        found = {side: trace_dtype(files[side], sets[side]) for side in "AB"}
        for side, (dtype, _) in found.items():
            if dtype not in DTYPES:
                raise UserError(f"{paths[side]}: dtype {dtype!r} is not one of {', '.join(DTYPES)}")
        dtypes = (found["A"][0], found["B"][0])
        coarse = tol.coarsest(dtypes)
        d_rtol, d_atol = tol.DEFAULT_TOLERANCES[coarse]
        rtol = d_rtol if rtol is None else rtol
        atol = d_atol if atol is None else atol
        if not (rtol >= 0 and atol >= 0):
            raise UserError(f"--rtol and --atol must be 0 or more, got {rtol} and {atol}")
        labels = tuple(describe(files[s], paths[s]) + ("" if found[s][1] == "attribute" else
                                             f" (no dtype attribute: {found[s][0]} from the data)") for s in "AB")
        result = Result(str(path_a), str(path_b), rtol, atol, dtypes, labels, verdict)

        attr_rows = []
        for side in "AB":
            for key in REQUIRED_ATTRS:
                if key not in files[side].attrs:
                    name = f"@{key}"
                    attr_rows.append(Row(name, (), math.inf, math.inf, allowed_by(name, allow_missing),
                                         f"attribute {key} missing in {side}", compared=False))
        names_a, names_b = set(sets["A"]), set(sets["B"])
        rows = {}
        held = steps_present(names_a | names_b)
        for side in "AB":                               # declared by `steps`, held by neither file
            for lo, hi in unheld_ranges(held, _declared_steps(files[side])):
                if f"step_{lo}" not in rows:
                    rows[f"step_{lo}"] = declared_row(side, lo, hi, allow_missing)
        for side, other, mine, theirs in (("A", "B", names_a - names_b, names_b),
                                          ("B", "A", names_b - names_a, names_a)):
            older = missing_by_version(version(files[other]))    # what the other's format version lacks
            for row in missing_rows(side, other, mine, theirs, tuple(allow_missing) + older):
                if older and row.ok and not allowed_by(row.name, allow_missing):
                    row.note += f" (a version {version(files[other])} trace does not hold it)"
                rows[row.name] = row
        env = envelope.read(files, paths) if verdict == "envelope" else None     # (side, envelope)
        fp8 = fp8_tolerance.unit_of(files, paths) if verdict == "budget" else None   # float32 FP8's unit
        for name in names_a & names_b:
            rows[name] = _compare_one(name, sets, paths, dtypes, coarse, cfg_a, rtol, atol, verdict, env, fp8)
        coverage_rows(rows, steps_present(names_a) & steps_present(names_b))
        order = ordered(rows, cfg_a)
        if fp8 is not None:
            fp8_tolerance.judge([rows[n] for n in order], fp8)
        precision_rows(rows, order, sets, paths, dtypes)          # mixed precision off, or on unasked
        result.rows = attr_rows + [rows[n] for n in order]
        result.allowed = [r.name for r in result.rows if not r.compared and r.ok]
    return result


def _declared_steps(f) -> int:
    """The ``steps`` attribute as a count (0 when absent or unreadable: its
    absence is reported as a missing attribute)."""
    try:
        return max(0, int(f.attrs.get("steps", 0)))
    except (TypeError, ValueError, OverflowError):
        return 0


def unheld_ranges(held: set, declared: int) -> list:
    """[(first, last)] of the steps 1..``declared`` that no file holds, as
    ranges: as many as the steps held, plus one, however large
    ``declared`` is (a ``steps`` of 2**40 is one row, not 2**40)."""
    ranges, after = [], 0
    for s in sorted(x for x in held if x <= declared) + [declared + 1]:
        if s > after + 1:
            ranges.append((after + 1, s - 1))
        after = s
    return ranges


def declared_row(side: str, lo: int, hi: int, patterns) -> Row:
    """The row of steps lo..hi that ``side``'s steps attribute declares and
    neither file holds; allowed only if every one of them is (a range too
    long to match step by step never is)."""
    def allowed(s):
        return allowed_by(f"step_{s}", patterns) or allowed_by(f"step_{s}/loss", patterns)
    if lo == hi:
        return Row(f"step_{lo}", (), math.inf, math.inf, allowed(lo),
                   f"step {lo} declared by {side}'s steps attribute, in neither file", compared=False)
    ok = hi - lo < RANGE_CHECKED and all(allowed(s) for s in range(lo, hi + 1))
    return Row(f"step_{lo}", (), math.inf, math.inf, ok,
               f"steps {lo} to {hi} declared by {side}'s steps attribute, in neither file", compared=False)


def coverage_rows(rows: dict, held: set) -> None:
    """Fail what compared nothing (module docstring): no tensor compared at
    all, or a step both traces hold (``held``) of which no activation,
    gradient or parameter was (a step one trace lacks altogether has its
    own row, allowed only by name);
    each said in its row (an existing ``step_%d`` row is failed, its note
    extended)."""
    compared = {n for n, r in rows.items() if r.compared}
    if not compared:
        missing = sum(1 for r in rows.values() if not r.compared)
        rows["(comparison)"] = Row("(comparison)", (), math.inf, math.inf, False,
                                   f"nothing was compared: the traces hold no tensor in common ({missing} "
                                   f"missing from one or the other)", compared=False)
        return
    covered = {step_of(n) for n in compared if n.split("/")[1:2] and n.split("/")[1] in STEP_KINDS}
    for s in sorted(held - covered):
        what = sorted(n.split("/", 1)[1] for n in compared if step_of(n) == s)
        note = (f"nothing of step {s}'s activations, gradients and parameters was compared "
                f"(compared: {', '.join(what[:4]) + (', ...' if len(what) > 4 else '') if what else 'nothing'})")
        row = rows.get(f"step_{s}")
        if row is None:
            rows[f"step_{s}"] = Row(f"step_{s}", (), math.inf, math.inf, False, note, compared=False)
        else:
            row.ok, row.note = False, f"{row.note}; {note}"


FP8_CODES = re.compile(r"(step_\d+/)?fp8/.+/(x|w|dy)\.\w+/bytes")    # trace --fp8's quantized operands


def zeros_folded(read):
    """A reader of FP8 codes (sign and magnitude, e4m3 or e5m2) whose
    negative zero 0x80 reads as 0x00. They are one number, and which one a
    value that rounds to zero lands on is the sign of its rounding noise:
    the GELU of a large negative input, or a gradient that is an exact zero
    computed as a difference, is -1e-30 on one layout and +1e-30 on another
    whose sums run in another order (docs/fp8.md, "Across layouts")."""
    def read_folded(block):
        codes = np.asarray(read(block))
        return np.where(codes == 0x80, np.uint8(0), codes)
    return read_folded


def _compare_one(name, sets, paths, dtypes, coarse, cfg, rtol, atol, verdict, env=None, fp8=None) -> Row:
    """The row of a tensor both traces hold: shapes compared first (from
    the files' metadata), then the values read block by block."""
    objs = [sets[s][name] for s in "AB"]
    shapes = [stored_shape(obj, paths[s]) for obj, s in zip(objs, "AB")]
    note = ""
    if name == "tokens" and len(shapes[0]) == len(shapes[1]) == 3 and shapes[0][1:] == shapes[1][1:] \
            and shapes[0][0] != shapes[1][0]:
        n = min(shapes[0][0], shapes[1][0])            # traces of different lengths: the common steps
        shapes, note = [(n,) + shapes[0][1:]] * 2, f"first {n} steps"
    if shapes[0] != shapes[1]:
        return Row(name, shapes[0], math.inf, math.inf, False, f"shapes {shapes[0]} vs {shapes[1]}", math.inf,
                   math.nan)
    readers, kinds, stored, problems = [], [], [], []
    for obj, s in zip(objs, "AB"):                      # a sharded trace's replicas part, or elements are missing
        read, dtype, problem = reader(obj, paths[s], rtol, atol)
        if problem:
            problems.append((s, problem))
        readers.append(read)
        stored.append(dtype)
        kinds.append(dtype.kind)
    if problems:                                       # replicas that part say by how much; inf: no number
        note = "; ".join(f"{side}: {problem}" for side, problem in problems)
        note = "; ".join(filter(None, (note, diagnosis(name, sets, paths, readers, shapes[0], rtol, atol, cfg))))
        return Row(name, shapes[0], max(getattr(p, "max_abs", math.inf) for _, p in problems),
                   max(getattr(p, "max_rel", math.inf) for _, p in problems), False, note, math.nan, math.nan)
    if FP8_CODES.fullmatch(name):
        readers = [zeros_folded(read) for read in readers]
    wrong = [f"{side} stores {dt}, the format {want}" for side, dt, tdt in (("A", stored[0], dtypes[0]),
                                                                            ("B", stored[1], dtypes[1]))
             if (want := expected_dtype(name, tdt)) is not None and dt != want]
    row = measure(name, readers[0], readers[1], shapes[0], tuple(kinds), coarse, depth(name, cfg), rtol, atol,
                  verdict)
    if env is not None:                                 # --tolerance envelope: the measured spread decides
        envelope.judge(row, name, readers, shapes[0], tuple(kinds), env[1], env[0])
    if fp8 is not None and not wrong and math.isfinite(row.max_abs):   # float32 FP8: fp8_tolerance.judge decides
        mx_scale = name.endswith("/scale") and "/fp8/" in name and kinds == ["u", "u"]
        if FP8_CODES.fullmatch(name) or mx_scale:
            row.fp8 = fp8_tolerance.code_stats(name, readers, shapes[0],
                                               fp8_tolerance.format_of(name, fp8, mx_scale),
                                               tol.depth_bound("float32", depth(name, cfg)))
        elif not row.ok and kinds == ["f", "f"]:
            row.fp8 = fp8_tolerance.float_stats(readers, shapes[0])
    if not row.ok and kinds[0] == "f":                  # a wrong value that is the sum of a rank's copies
        row.note = "; ".join(filter(None, (row.note, diagnosis(name, sets, paths, readers, shapes[0], rtol, atol, cfg))))
    if wrong:
        row.ok, row.note = False, "dtype: " + "; ".join(wrong)
    elif note:
        row.note = f"{note}; {row.note}" if row.note else note
    return row
