"""``mpicube compare``: two traces, tensor by tensor, and the first place
where they part.

Every tensor present in both files gets its largest absolute difference
and its difference relative to the tensor's own scale,
``max|a - b| / max(max|a|, max|b|)``: an elementwise relative error would
be dominated by entries that happen to be near zero, while a layout bug or
a framework's swapped axes moves a whole tensor. A tensor agrees when
``max|a - b| <= atol + rtol * scale``.

The first divergence is the first disagreeing tensor *in the order the
computation produces them*, not in file order: a wrong activation in block
1 of step 2 spoils every later activation, the loss, every gradient and
every parameter, so only the earliest one points at the bug.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..core.errors import UserError
from .trace import FORMAT, VERSION

# (rtol, atol) by the coarser dtype of the two traces; float64 is what
# layouts are verified in (DESIGN.md section 2), the others leave room for
# their rounding through a few steps of AdamW.
DEFAULT_TOLERANCES = {
    "float64": (1e-10, 1e-13),
    "float32": (1e-3, 1e-6),
    "float16": (5e-2, 1e-3),
    "bfloat16": (5e-2, 1e-3),
}
PRECISION_ORDER = ("float64", "float32", "float16", "bfloat16")     # finest first


@dataclass
class Row:
    """One tensor present in both traces."""

    name: str
    shape: tuple
    max_abs: float
    max_rel: float
    ok: bool
    note: str = ""


@dataclass
class Result:
    path_a: str
    path_b: str
    rtol: float
    atol: float
    dtypes: tuple
    labels: tuple = ("", "")                             # what produced each trace, for the header
    rows: list = field(default_factory=list)             # in computation order
    only_a: list = field(default_factory=list)
    only_b: list = field(default_factory=list)

    @property
    def first_divergence(self):
        return next((r.name for r in self.rows if not r.ok), None)

    @property
    def max_rel(self):
        finite = [r.max_rel for r in self.rows]
        return max(finite) if finite else 0.0

    def summary(self) -> dict:
        """The --json line; a non-finite max_rel (shapes differ, NaN) is null."""
        worst = self.max_rel
        return {"first_divergence": self.first_divergence, "max_rel": worst if math.isfinite(worst) else None,
                "tensors": len(self.rows)}


# --------------------------------------------------------------------------- reading


def open_trace(path):
    """The h5py File of a trace, or a UserError saying why it is not one."""
    import h5py

    p = Path(path)
    if not p.is_file():
        raise UserError(f"{p}: no such file" if not p.exists() else f"{p}: not a file")
    try:
        f = h5py.File(p, "r")
    except OSError:
        raise UserError(f"{p}: not an HDF5 file, so not a trace (format {FORMAT})") from None
    fmt = _text(f.attrs.get("format"))
    if fmt != FORMAT:
        f.close()
        what = f"format {fmt!r}" if fmt else "no 'format' attribute"
        raise UserError(f"{p}: not a trace ({what}; expected {FORMAT!r})")
    version = f.attrs.get("version")
    if version is None or int(version) != VERSION:
        f.close()
        raise UserError(f"{p}: trace version {version}, this mpicube reads version {VERSION}")
    return f


def _text(value):
    return value.decode() if isinstance(value, bytes) else (None if value is None else str(value))


def read_config(f, path) -> dict:
    try:
        cfg = json.loads(_text(f.attrs.get("config")) or "")
    except ValueError:
        raise UserError(f"{path}: the 'config' attribute is not JSON") from None
    keys = ("vocab_size", "n_ctx", "n_layer", "n_head", "n_embd")
    if not isinstance(cfg, dict) or any(k not in cfg for k in keys):
        raise UserError(f"{path}: the 'config' attribute lacks one of {', '.join(keys)}")
    return {k: int(cfg[k]) for k in keys}


def describe(f) -> str:
    """``float64, 3d tp 8 dp 1 q 2, dropout 0.1``: what produced a trace."""
    try:
        layout = json.loads(_text(f.attrs.get("layout")) or "{}")
    except ValueError:
        layout = {}
    if isinstance(layout, dict):
        layout = " ".join(f"{k} {v}" if k != "layout" else str(v) for k, v in layout.items())
    parts = [_text(f.attrs.get("dtype")) or "dtype unknown", str(layout or "layout unknown")]
    if "dropout" in f.attrs:
        parts.append(f"dropout {float(f.attrs['dropout']):g}")
    return ", ".join(parts)


def datasets(f) -> dict:
    """{path: dataset} of every dataset in the file, opened once (h5py's
    lookup by path costs more than reading a small tensor)."""
    found = {}
    f.visititems(lambda name, obj: found.__setitem__(name, obj) if hasattr(obj, "shape") else None)
    return found


# --------------------------------------------------------------------------- order


def backward_param_order(cfg: dict) -> list:
    """Parameter names in the order backward completes their gradients:
    ln_f, the blocks from last to first (each from mlp.c_proj back to
    ln_1), then wpe, and wte last (the LM head and the lookup both add to it)."""
    names = ["ln_f.weight", "ln_f.bias"]
    for i in reversed(range(cfg["n_layer"])):
        p = f"h.{i}."
        names += [p + s for s in ("mlp.c_proj.weight", "mlp.c_proj.bias", "mlp.c_fc.weight", "mlp.c_fc.bias",
                                  "ln_2.weight", "ln_2.bias", "attn.c_proj.weight", "attn.c_proj.bias",
                                  "attn.c_attn.weight", "attn.c_attn.bias", "ln_1.weight", "ln_1.bias")]
    return names + ["wpe", "wte"]


def forward_param_order(cfg: dict) -> list:
    """Parameter names in the model's declaration order (as checkpoints list them)."""
    names = ["wte", "wpe"]
    for i in range(cfg["n_layer"]):
        p = f"h.{i}."
        names += [p + s for s in ("ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias",
                                  "attn.c_proj.weight", "attn.c_proj.bias", "ln_2.weight", "ln_2.bias",
                                  "mlp.c_fc.weight", "mlp.c_fc.bias", "mlp.c_proj.weight", "mlp.c_proj.bias")]
    return names + ["ln_f.weight", "ln_f.bias"]


def computation_order(cfg: dict, steps: int) -> list:
    """Every name a trace may hold, in the order the computation makes it.
    A dropout mask comes just before the activation it is applied in."""
    order = ["tokens"] + [f"init/{n}" for n in forward_param_order(cfg)]
    for s in range(1, steps + 1):
        g = f"step_{s}/"
        order += [g + "dropout/emb", g + "act/emb"]
        for i in range(cfg["n_layer"]):
            order += [g + f"dropout/h.{i}.{site}" for site in ("attn", "resid_attn", "resid_mlp")]
            order.append(g + f"act/h.{i}")
        order += [g + "act/ln_f", g + "logits", g + "loss"]
        order += [g + f"grad/{n}" for n in backward_param_order(cfg)]
        order += [g + "grad_norm", g + "lr"]
        order += [g + f"param/{n}" for n in forward_param_order(cfg)]
    return order


def _step_of(name: str) -> int:
    head = name.split("/", 1)[0]
    return int(head[5:]) if head.startswith("step_") and head[5:].isdigit() else 0


def ordered(names: set, cfg: dict) -> list:
    """``names`` in computation order; names the format does not define go
    after everything else of their step (or at the end), alphabetically."""
    steps = max([_step_of(n) for n in names] + [0])
    known = computation_order(cfg, steps)
    rank = {n: i for i, n in enumerate(known)}
    last_of_step = {}
    for n, i in rank.items():
        last_of_step[_step_of(n)] = i
    def key(n):
        if n in rank:
            return (rank[n], "")
        s = _step_of(n)
        return (last_of_step.get(s, len(known)) + 0.5 if s else len(known), n)
    return sorted(names, key=key)


# --------------------------------------------------------------------------- comparing


def differences(a: np.ndarray, b: np.ndarray):
    """(max |a - b|, max(max|a|, max|b|)); NaN where only one side has it
    counts as an infinite difference. Computed in the traces' own dtype
    when both have the same one (float64 otherwise): the rounding of one
    subtraction is far below any tolerance worth asking for."""
    a, b = np.atleast_1d(a), np.atleast_1d(b)
    if a.size == 0:
        return 0.0, 0.0
    if a.dtype != b.dtype or a.dtype.kind != "f":
        a, b = a.astype(np.float64), b.astype(np.float64)
    diff = np.subtract(a, b)
    np.abs(diff, out=diff)
    max_abs = float(diff.max())
    scale = max(float(a.max()), -float(a.min()), float(b.max()), -float(b.min()))
    if math.isnan(max_abs) or math.isnan(scale):       # NaN, or inf - inf: the careful way
        na, nb = np.isnan(a), np.isnan(b)
        if (na != nb).any():
            return math.inf, math.inf
        a, b = a[~na], b[~nb]
        same = a == b                                   # equal infinities differ by nothing
        diff = np.where(same, 0.0, np.abs(a - b))
        max_abs = float(diff.max()) if diff.size else 0.0
        scale = float(np.abs(a).max()) if a.size else 0.0
        scale = max(scale, float(np.abs(b).max()) if b.size else 0.0)
    return max_abs, scale


def default_tolerances(dtypes) -> tuple:
    """(rtol, atol) for the coarser of the traces' dtypes."""
    coarsest = max((d if d in PRECISION_ORDER else "float32" for d in dtypes), key=PRECISION_ORDER.index)
    return DEFAULT_TOLERANCES[coarsest]


def compare_traces(path_a, path_b, rtol=None, atol=None) -> Result:
    fa = open_trace(path_a)
    try:
        fb = open_trace(path_b)
    except UserError:
        fa.close()
        raise
    with fa, fb:
        cfg_a, cfg_b = read_config(fa, path_a), read_config(fb, path_b)
        if cfg_a != cfg_b:
            differ = ", ".join(f"{k} {cfg_a[k]} vs {cfg_b[k]}" for k in cfg_a if cfg_a[k] != cfg_b[k])
            raise UserError(f"the traces are of different models: {differ}")
        dtypes = (_text(fa.attrs.get("dtype")) or "float32", _text(fb.attrs.get("dtype")) or "float32")
        d_rtol, d_atol = default_tolerances(dtypes)
        rtol = d_rtol if rtol is None else rtol
        atol = d_atol if atol is None else atol
        if not (rtol >= 0 and atol >= 0):
            raise UserError(f"--rtol and --atol must be 0 or more, got {rtol} and {atol}")
        sets_a, sets_b = datasets(fa), datasets(fb)
        names_a, names_b = set(sets_a), set(sets_b)
        result = Result(str(path_a), str(path_b), rtol, atol, dtypes, (describe(fa), describe(fb)))
        result.only_a = ordered(names_a - names_b, cfg_a)
        result.only_b = ordered(names_b - names_a, cfg_a)
        for name in ordered(names_a & names_b, cfg_a):
            a, b = sets_a[name][()], sets_b[name][()]
            note = ""
            if name == "tokens" and a.ndim == b.ndim == 3 and a.shape[1:] == b.shape[1:] and len(a) != len(b):
                n = min(len(a), len(b))                 # traces of different lengths: the common steps
                a, b, note = a[:n], b[:n], f"first {n} steps"
            if np.shape(a) != np.shape(b):
                result.rows.append(Row(name, np.shape(a), math.inf, math.inf, False,
                                       f"shapes {np.shape(a)} vs {np.shape(b)}"))
                continue
            max_abs, scale = differences(a, b)
            max_rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else math.inf)
            ok = max_abs <= atol + rtol * scale
            result.rows.append(Row(name, np.shape(a), max_abs, max_rel, ok, note))
    return result


# --------------------------------------------------------------------------- the report


def _num(x: float) -> str:
    return "0" if x == 0 else ("inf" if math.isinf(x) else f"{x:.2e}")


def format_report(result: Result) -> str:
    width = max([len(r.name) for r in result.rows] + [6])
    lines = [f"A: {result.path_a} ({result.labels[0]})", f"B: {result.path_b} ({result.labels[1]})",
             f"tolerance: |a - b| <= {result.atol:g} + {result.rtol:g} * max(|a|, |b|)", "",
             f"{'tensor':<{width}}  {'shape':<18} {'max abs':>9} {'max rel':>9}  ok"]
    for r in result.rows:
        shape = "x".join(map(str, r.shape)) or "scalar"
        ok = ("yes" if r.ok else "NO") + (f" ({r.note})" if r.note else "")
        lines.append(f"{r.name:<{width}}  {shape:<18} {_num(r.max_abs):>9} {_num(r.max_rel):>9}  {ok}")
    for label, names in (("A", result.only_a), ("B", result.only_b)):
        if names:
            lines.append("")
            lines.append(f"only in {label} ({len(names)}): " + ", ".join(names))
    lines.append("")
    bad = [r for r in result.rows if not r.ok]
    lines.append(f"{len(result.rows)} tensors compared, {len(bad)} outside tolerance, "
                 f"largest relative difference {_num(result.max_rel)}")
    first = result.first_divergence
    if first is None:
        lines.append("all tensors agree")
    else:
        row = bad[0]
        lines.append(f"first divergence: {first} (max abs {_num(row.max_abs)}, max rel {_num(row.max_rel)})")
    return "\n".join(lines)
