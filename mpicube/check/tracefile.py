"""Opening a trace, and saying in one line what is wrong with a file that
is not one.

Bad input is exit status 2 with the file and the item named
(``UserError``): a file that is not HDF5, not a trace, of an unknown
version, with a config that is not the model's, or a dataset that cannot
be read (a truncated or damaged file). What a well-formed trace may lack
or get wrong - a tensor, a step, a dtype, an attribute - is a divergence
for ``compare`` to report (exit 1), not bad input.

A trace is one self-contained file, and untrusted: before any tensor is
read, every link in it must be a hard link and every dataset must hold its
own bytes, fully written, in the file itself (``core.h5trust``, the rule
checkpoints follow): an external link, a soft link, a virtual dataset or
external raw storage (which may name ``/etc/passwd`` or a FIFO) is refused
by name, so HDF5 never opens another file. A dataset that does not hold
numbers (strings, compound records) is refused too.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from ..core.errors import UserError
from ..core.h5trust import link_kind, self_contained_problem
from .names import FORMAT, MOE_SCALARS, MOMENTS, READS, SCALARS, VERSION, config_of, step_of
from .shards import assemble, is_sharded

DTYPES = ("float64", "float32", "float16", "bfloat16")
REQUIRED_ATTRS = ("dtype", "steps", "optimizer")        # besides format, version and config (bad input)


def text(value):
    """An HDF5 string attribute as str (h5py gives bytes for some writers)."""
    return value.decode() if isinstance(value, bytes) else (None if value is None else str(value))


def open_trace(path):
    """The h5py File of a trace, or a UserError saying why it is not one
    (a file that is not self-contained among the reasons: every reader of
    a trace, ``compare`` and ``reference``, gets only such files)."""
    import h5py

    p = Path(path)
    if not p.is_file():
        raise UserError(f"{p}: no such file" if not p.exists() else f"{p}: not a file")
    try:
        f = h5py.File(p, "r")
    except OSError as exc:
        why = "truncated or damaged HDF5 file" if "truncated" in str(exc) else "not an HDF5 file, so not a trace"
        raise UserError(f"{p}: {why} (format {FORMAT})") from None
    try:
        fmt = text(f.attrs.get("format"))
        if fmt != FORMAT:
            what = f"format {fmt!r}" if fmt else "no 'format' attribute"
            raise UserError(f"{p}: not a trace ({what}; expected {FORMAT!r})")
        version = f.attrs.get("version")
        try:
            known = version is not None and int(version) in READS
        except (TypeError, ValueError, OverflowError):
            known = False
        if not known:
            raise UserError(f"{p}: trace version {text(version) if version is not None else 'missing'}, "
                            f"this mpicube reads versions {', '.join(map(str, READS))} (writes {VERSION})")
        check_self_contained(f, p)
    except UserError:
        f.close()
        raise
    return f


def version(f) -> int:
    """The format version of a trace ``open_trace`` accepted."""
    return int(f.attrs["version"])


def strict_json(raw: str, path, key: str):
    """``raw`` as JSON, numbers finite (no ``Infinity`` or ``NaN``, which
    Python's json takes by default); a UserError naming the attribute when
    it is not, or is nested too deeply for the parser."""
    def refuse(constant):
        raise ValueError(f"{constant} is not a JSON number")
    try:
        return json.loads(raw, parse_constant=refuse)
    except RecursionError:
        raise UserError(f"{path}: the '{key}' attribute is nested too deeply to be read as JSON") from None
    except (TypeError, ValueError) as exc:
        raise UserError(f"{path}: the '{key}' attribute is not JSON ({str(exc)[:80]})") from None


def read_config(f, path) -> dict:
    """The model config of a trace: its five sizes as integers, and a
    Llama's settings (names.config_of)."""
    cfg = strict_json(text(f.attrs.get("config")) or "", path, "config")
    try:
        return config_of(cfg)
    except ValueError as exc:
        raise UserError(f"{path}: the 'config' attribute {exc}") from None


def read_json_attr(f, path, key):
    """A JSON attribute, None when absent; bad JSON is bad input."""
    raw = f.attrs.get(key)
    if raw is None:
        return None
    return strict_json(text(raw), path, key)


def describe(f, path=None) -> str:
    """``float64, 3d tp 8 dp 1 q 2, dropout 0.1``: what produced a trace
    (the layout is a free-form label: unreadable, it is left out)."""
    try:
        layout = json.loads(text(f.attrs.get("layout")) or "{}")
    except (ValueError, RecursionError):
        layout = {}
    if isinstance(layout, dict):
        layout = " ".join(f"{k} {v}" if k != "layout" else str(v) for k, v in layout.items())[:200]
    parts = [text(f.attrs.get("dtype")) or "dtype unknown", str(layout or "layout unknown")[:200]]
    if "dropout" in f.attrs:
        raw = f.attrs["dropout"]
        try:
            p = float(raw)
        except (TypeError, ValueError):
            p = math.nan
        if not 0 <= p < 1:
            raise UserError(f"{path or f.filename}: the 'dropout' attribute {str(raw)[:40]!r} is not a probability "
                            "in [0, 1)")
        parts.append(f"dropout {p:g}")
    return ", ".join(parts)


def check_self_contained(f, path) -> None:
    """A UserError naming the first link that is not a hard link, or the
    first dataset that does not hold its own bytes in this file, or holds
    no numbers (module docstring). Looks at links and property lists only."""
    import h5py

    def link(name, info):
        if not isinstance(info, h5py.HardLink):
            target = f" to {info.filename}:{info.path}" if isinstance(info, h5py.ExternalLink) else (
                f" to {info.path}" if isinstance(info, h5py.SoftLink) else "")
            return f"{path}: {name} is {link_kind(info)} link{target} (a trace is one self-contained file "\
                   "of hard links; refused)"
        return None

    problem = f.visititems_links(link) if hasattr(f, "visititems_links") else _walk_links(f, link)
    if problem is not None:
        raise UserError(problem)

    def dataset(name, obj):
        if not isinstance(obj, h5py.Dataset):
            return None
        why = self_contained_problem(obj, f"{path}: dataset {name}")
        if why is None and obj.dtype.kind not in NUMBERS:
            why = f"{path}: dataset {name} holds {obj.dtype} values, not numbers"
        return why

    problem = f.visititems(dataset)
    if problem is not None:
        raise UserError(problem)


NUMBERS = "biuf"        # numpy kinds a trace's datasets may hold: bool, signed, unsigned, float


def _walk_links(f, visit):
    """``f.visititems_links(visit)`` for h5py before 3.11: every link once,
    a group reached by several hard links (or a cycle) entered once."""
    import h5py

    seen, todo = set(), [("", f)]
    while todo:
        prefix, group = todo.pop()
        if group.id in seen:
            continue
        seen.add(group.id)
        for key in group:
            name = prefix + key
            link = group.get(key, getlink=True)
            problem = visit(name, link)
            if problem is not None:
                return problem
            if isinstance(link, h5py.HardLink) and isinstance(group.get(key), h5py.Group):
                todo.append((name + "/", group[key]))
    return None


def datasets(f) -> dict:
    """{path: dataset or sharded group} of every tensor in the file, opened
    once (h5py's lookup by path costs more than reading a small tensor); a
    sharded tensor (shards.py) is its group, not the datasets inside it.
    ``open_trace`` checked the file (``check_self_contained``)."""
    found, sharded = {}, []

    def visit(name, obj):
        if hasattr(obj, "shape"):
            found[name] = obj
        elif is_sharded(obj):
            sharded.append(name)
    f.visititems(visit)
    inside = tuple(name + "/" for name in sharded)
    found = {n: d for n, d in found.items() if not n.startswith(inside)} if inside else found
    found.update((name, f[name]) for name in sharded)
    return found


def read(dataset, path) -> np.ndarray:
    """A dataset's values; one that cannot be read is bad input naming it."""
    return read_tensor(dataset, path, 0.0, 0.0)[0]


def read_tensor(dataset, path, rtol: float, atol: float) -> tuple:
    """(values, problem): a dataset's values, or a sharded tensor put
    together with what is wrong with its shards ("" when nothing is;
    replicas must agree to ``atol + rtol * scale``; values None when its
    shards store fewer elements than it declares). A dataset that cannot
    be read is bad input naming it."""
    if is_sharded(dataset):
        return guarded(dataset, path, lambda: assemble(dataset, path, rtol, atol))
    return read_block(dataset, path, ()), ""


def reader(obj, path, rtol: float, atol: float) -> tuple:
    """(read, dtype, problem) of a tensor: ``read(block)`` gives its values
    at ``block`` (a tuple of slices or of indices, measure.py) - a dataset
    read from the file one block at a time, a sharded tensor put together
    once (``read_tensor``: its memory is what its shards store); ``problem``
    as ``read_tensor``'s, and ``read`` None when its shards store fewer
    elements than it declares (nothing was put together)."""
    if is_sharded(obj):
        values, problem = read_tensor(obj, path, rtol, atol)
        if values is None:
            return None, np.dtype(np.float64), problem
        return (lambda block: values[block]), values.dtype, problem
    return (lambda block: read_block(obj, path, block)), obj.dtype, ""


def read_block(dataset, path, block: tuple) -> np.ndarray:
    """``dataset[block]``; one that cannot be read is bad input naming it."""
    return guarded(dataset, path, lambda: dataset[block])


def guarded(dataset, path, read):
    try:
        return read()
    except (OSError, ValueError, KeyError, TypeError) as exc:
        reason = str(exc).split("(")[0].strip() or type(exc).__name__
        raise UserError(f"{path}: dataset {dataset.name.lstrip('/')} cannot be read "
                        f"(truncated or damaged file: {reason})") from None


def steps_present(names) -> set:
    """The step numbers that have a ``step_%d`` group with data."""
    return {step_of(n) for n in names} - {0}


def trace_dtype(f, sets: dict) -> tuple:
    """(dtype, where it came from). The ``dtype`` attribute when present;
    otherwise the finest floating dtype of the tensors themselves, so a
    float64 trace that lost its attribute is still held to float64's
    tolerance: the data can only tighten it, never loosen it."""
    declared = text(f.attrs.get("dtype"))
    if declared is not None:
        return declared, "attribute"
    found = {str(d.dtype) for n, d in sets.items()
             if hasattr(d, "dtype") and d.dtype.kind == "f" and n.rsplit("/", 1)[-1] not in SCALARS}
    finest = next((d for d in DTYPES if d in found), "float32")
    return finest, "data"


def expected_dtype(name: str, trace_dtype: str):
    """The numpy dtype the format stores ``name`` in, None when the format
    does not say (a writer's own datasets): tokens int32, masks uint8, the
    scalars float64, every other tensor float64 in a float64 trace and
    float32 otherwise (float16 and bfloat16 runs are stored as float32);
    a mixture's chosen experts (``moe/h.{i}.experts``) int32 and its
    router losses (``moe/aux_loss``, ``moe/z_loss``) float64; the state
    (``_state_dtype``) as names.py lists it."""
    if name == "tokens":
        return np.dtype(np.int32)
    kind = name.split("/")[1] if step_of(name) else name.split("/")[0]
    if kind == "dropout":
        return np.dtype(np.uint8)
    if step_of(name) and name.split("/", 1)[1] in SCALARS + MOE_SCALARS:
        return np.dtype(np.float64)
    if kind == "moe" and name.endswith(".experts"):
        return np.dtype(np.int32)
    if kind == "state":
        return _state_dtype(name.split("/", 2)[2], trace_dtype)
    if kind in ("init", "act", "logits", "grad", "param", "moe"):
        return np.dtype(np.float64 if trace_dtype == "float64" else np.float32)
    return None


def _state_dtype(what: str, trace_dtype: str):
    """The dtype of ``step_%d/state/<what>``: AdamW's moments as the
    parameters (float64, or float32: a 16-bit run's moments are float32,
    as its master weights), the loss scale float64, the RNG offset and the
    expert loads int64 (counts: an offset or a load stored as float32
    loses its exactness past 2**24, and a float64 moment where the format
    says float32 may hide a run that never used its precision); None for
    a name the format does not give (compared as it is)."""
    head = what.split("/", 1)[0]
    if head in MOMENTS and "/" in what:
        return np.dtype(np.float64 if trace_dtype == "float64" else np.float32)
    if what == "loss_scale":
        return np.dtype(np.float64)
    if what == "rng_offset" or (head == "expert_load" and "/" in what):
        return np.dtype(np.int64)
    return None
