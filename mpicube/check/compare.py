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
  data's dtype, so a missing attribute never loosens it.

Each compared tensor gets the per-dtype budget and the depth-aware bound
(tolerance.py); the budget decides unless ``tolerance="depth"``.
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass, field

import numpy as np

from ..core.errors import UserError
from . import envelope
from . import tolerance as tol
from .names import depth, missing_by_version, ordered, step_of
from .diagnose import notes as diagnosis
from .precision import precision_rows
from .tracefile import (DTYPES, REQUIRED_ATTRS, datasets, describe, expected_dtype, open_trace, read_config,
                        read_tensor, steps_present, trace_dtype, version)


@dataclass
class Row:
    """One tensor, step or attribute of either trace."""

    name: str
    shape: tuple
    max_abs: float
    max_rel: float
    ok: bool
    note: str = ""
    rel_fro: float = math.nan         # relative Frobenius error
    bound: float = math.nan           # its depth-aware bound
    compared: bool = True             # False: missing on one side, nothing to measure

    @property
    def margin(self) -> float:
        """bound / error: above 1 is within what rounding explains."""
        if not self.compared or math.isnan(self.rel_fro):
            return math.nan
        return math.inf if self.rel_fro == 0 else self.bound / self.rel_fro


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


# --------------------------------------------------------------------------- one tensor


def _where(mask: np.ndarray) -> tuple:
    return tuple(int(i) for i in np.unravel_index(int(np.flatnonzero(mask)[0]), mask.shape))


def nonfinite(a: np.ndarray, b: np.ndarray):
    """(problem, note, finite mask) for two same-shaped float arrays: a
    problem when a NaN or infinity stands on one side only or against
    another non-finite value; otherwise a note on the shared ones (or "")
    and the mask of the elements left to compare."""
    fa, fb = np.isfinite(a), np.isfinite(b)
    if fa.all() and fb.all():
        return False, "", None
    same = ~fa & ~fb & ((a == b) | (np.isnan(a) & np.isnan(b)))
    odd = (~fa | ~fb) & ~same
    if odd.any():
        at = _where(odd)
        return True, f"{a[at]} in A vs {b[at]} in B at {at}", None
    kinds = sorted({str(v) for v in a[same].tolist()})
    return False, f"both hold {'/'.join(kinds)} at {int(same.sum())} place(s), first {_where(same)}", fa


def measure(name: str, a: np.ndarray, b: np.ndarray, dtype: str, depth_: int, rtol: float, atol: float,
            verdict: str) -> Row:
    """The row of a tensor present in both traces with the same shape."""
    exact = a.dtype.kind not in "fc" and b.dtype.kind not in "fc"       # tokens, masks: integers agree exactly
    a64, b64 = np.atleast_1d(a).astype(np.float64), np.atleast_1d(b).astype(np.float64)
    problem, note, keep = nonfinite(a64, b64)
    bound = tol.depth_bound(dtype, depth_, exact)
    if problem:
        return Row(name, a.shape, math.inf, math.inf, False, "non-finite: " + note, math.inf, bound)
    if keep is not None:
        a64, b64 = a64[keep], b64[keep]
    if a64.size == 0:
        return Row(name, a.shape, 0.0, 0.0, True, note, 0.0, bound)
    max_abs = float(np.abs(a64 - b64).max())
    scale = max(float(np.abs(a64).max()), float(np.abs(b64).max()))
    max_rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else math.inf)
    rel_fro = tol.frobenius_error(a64, b64)
    if exact:
        ok = max_abs == 0
        if not ok and keep is None:
            note = first_difference(name, a, b)
    elif verdict == "depth":
        ok = rel_fro <= bound
    else:
        ok = max_abs <= atol + rtol * scale
    return Row(name, a.shape, max_abs, max_rel, ok, note, rel_fro, bound)


def first_difference(name: str, a: np.ndarray, b: np.ndarray) -> str:
    """Where two integer tensors first differ: for a mixture's chosen
    experts (B, T, K) the token and both choices, so that a routing that
    parts is named at the token where it does; else the element."""
    at = _where(np.asarray(a) != np.asarray(b))
    if name.endswith(".experts") and "/moe/" in name and a.ndim == 3:
        b_, t = at[:2]
        return (f"first differs at token (sequence {b_}, position {t}): experts {a[b_, t].tolist()} in A "
                f"vs {b[b_, t].tolist()} in B")
    return f"first differs at {at}: {a[at]} in A vs {b[at]} in B"


# --------------------------------------------------------------------------- two traces


def allowed_by(name: str, patterns) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def missing_rows(side: str, other: str, names: set, other_names: set, patterns) -> list:
    """Rows for ``names`` of trace ``side`` that the ``other`` lacks; a
    step the other lacks altogether is one row ``step_%d``."""
    rows = []
    whole = steps_present(names) - steps_present(other_names)
    for s in sorted(whole):
        of_step = [n for n in names if step_of(n) == s]
        ok = allowed_by(f"step_{s}", patterns) or all(allowed_by(n, patterns) for n in of_step)
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
        labels = tuple(describe(files[s]) + ("" if found[s][1] == "attribute" else
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
        for side in "AB":                               # declared by `steps`, held by neither file
            held = steps_present(names_a | names_b)
            for s in range(1, _declared_steps(files[side]) + 1):
                if s not in held and f"step_{s}" not in rows:
                    rows[f"step_{s}"] = Row(f"step_{s}", (), math.inf, math.inf,
                                            allowed_by(f"step_{s}", allow_missing)
                                            or allowed_by(f"step_{s}/loss", allow_missing),
                                            f"step {s} declared by {side}'s steps attribute, in neither file",
                                            compared=False)
        for side, other, mine, theirs in (("A", "B", names_a - names_b, names_b),
                                          ("B", "A", names_b - names_a, names_a)):
            older = missing_by_version(version(files[other]))    # what the other's format version lacks
            for row in missing_rows(side, other, mine, theirs, tuple(allow_missing) + older):
                if older and row.ok and not allowed_by(row.name, allow_missing):
                    row.note += f" (a version {version(files[other])} trace does not hold it)"
                rows[row.name] = row
        env = envelope.read(files, paths) if verdict == "envelope" else None     # (side, envelope)
        for name in names_a & names_b:
            rows[name] = _compare_one(name, sets, paths, dtypes, coarse, cfg_a, rtol, atol, verdict, env)
        order = ordered(rows, cfg_a)
        precision_rows(rows, order, sets, paths, dtypes)          # mixed precision off, or on unasked
        result.rows = attr_rows + [rows[n] for n in order]
        result.allowed = [r.name for r in result.rows if not r.compared and r.ok]
    return result


def _declared_steps(f) -> int:
    """The ``steps`` attribute as a count (0 when absent or unreadable: its
    absence is reported as a missing attribute)."""
    try:
        return max(0, int(f.attrs.get("steps", 0)))
    except (TypeError, ValueError):
        return 0


def _compare_one(name, sets, paths, dtypes, coarse, cfg, rtol, atol, verdict, env=None) -> Row:
    (a, shards_a), (b, shards_b) = (read_tensor(sets[s][name], paths[s], rtol, atol) for s in "AB")
    if shards_a or shards_b:                            # a sharded trace's replicas part, or elements are missing
        note = "; ".join(f"{s}: {p}" for s, p in (("A", shards_a), ("B", shards_b)) if p)
        note = "; ".join(filter(None, (note, diagnosis(name, sets, paths, a, b, rtol, atol))))
        parted = [p for p in (shards_a, shards_b) if p]            # replicas part by a number; inf: no number
        return Row(name, np.shape(a), max(getattr(p, "max_abs", math.inf) for p in parted),
                   max(getattr(p, "max_rel", math.inf) for p in parted), False, note, math.nan, math.nan)
    wrong = [f"{side} stores {arr.dtype}, the format {want}" for side, arr, dt in (("A", a, dtypes[0]),
                                                                                   ("B", b, dtypes[1]))
             if (want := expected_dtype(name, dt)) is not None and arr.dtype != want]
    note = ""
    if name == "tokens" and a.ndim == b.ndim == 3 and a.shape[1:] == b.shape[1:] and len(a) != len(b):
        n = min(len(a), len(b))                         # traces of different lengths: the common steps
        a, b, note = a[:n], b[:n], f"first {n} steps"
    if np.shape(a) != np.shape(b):
        return Row(name, np.shape(a), math.inf, math.inf, False, f"shapes {np.shape(a)} vs {np.shape(b)}",
                   math.inf, math.nan)
    row = measure(name, a, b, coarse, depth(name, cfg), rtol, atol, verdict)
    if env is not None:                                 # --tolerance envelope: the measured spread decides
        envelope.judge(row, name, a, b, env[1], env[0])
    if not row.ok and a.dtype.kind == "f":              # a wrong value that is the sum of a rank's copies
        row.note = "; ".join(filter(None, (row.note, diagnosis(name, sets, paths, a, b, rtol, atol))))
    if wrong:
        row.ok, row.note = False, "dtype: " + "; ".join(wrong)
    elif note:
        row.note = f"{note}; {row.note}" if row.note else note
    return row
