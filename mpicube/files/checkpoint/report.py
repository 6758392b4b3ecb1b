"""``mpicube inspect``: a human-readable report and a full integrity check."""

from __future__ import annotations

import json

import h5py

from .format import CheckpointError, _fmt_shape, _fmt_size, _sha256_file
from .header import model_config
from .read import open_checkpoint
from .storage import stored_problem
from .vds import INDEX_DIR


def _tensor_line(ck, name: str, problems: list) -> tuple[str, int]:
    """(report line, bytes) of a tensor; where its bytes come from is
    checked as a loader checks it (``Checkpoint.check_storage``): sources outside
    the listed files, missing ones, external storage are problems."""
    ds = ck._ds(name)                   # a bad link: a CheckpointError, reported by the caller
    found, sources = ck.check_storage(name)
    problems += found
    if ds.is_virtual:
        how = f"{len(sources)} pieces in {len(set(sources))} shard(s)"
    else:
        how = "stored in checkpoint.h5"
    line = f"  {name:<40s} {_fmt_shape(ds.shape):<14s} {str(ds.dtype):<8s} {how}"
    return line, ds.size * ds.dtype.itemsize


def _shape_problems(ck, expected) -> list:
    """Tensors shaped unlike the model that the ``config`` attribute
    describes (a checkpoint no reader could load). ``expected`` maps that
    config and the checkpoint's tensor names to {parameter name: shape}
    (a ValueError for a config the tensors cannot be); the caller knows the
    model, this package knows only tensors by name and shape."""
    try:
        cfg = model_config(ck.attrs.get("config"), ck.file)
    except CheckpointError as e:
        return [str(e)]
    try:
        shapes = expected(cfg, set(ck.names()))
    except (TypeError, ValueError) as e:
        return [f"{ck.file}: attribute 'config' does not describe a model: {e}"]
    have, problems = set(ck.names()), []
    for param, shape in shapes.items():
        for prefix in ("model", "optimizer/m", "optimizer/v"):
            name = f"{prefix}/{param}"
            try:
                found = tuple(ck.shape(name)) if name in have else tuple(shape)
            except CheckpointError:
                continue                        # a bad link: already a problem of the tensor list
            if found != tuple(shape):
                problems.append(f"{ck.file}: tensor {name!r} has shape {found} but the model in "
                                f"its 'config' attribute needs {tuple(shape)}")
    return problems


def _shard_line(ck, rel: str, digest: str, problems: list) -> str:
    """The report line of a listed file: its sha256 and, for a shard, a
    read of every dataset in it (which checks the fletcher32 checksums),
    chunk by chunk; a file outside the directory is neither hashed nor
    opened, a dataset stored outside its file is not read."""
    p = ck.path / rel
    why = ck.bounds.file_problem(rel, must_exist=True)
    if why is not None:
        problems.append(why)
        return f"  {rel}  {'MISSING' if not p.exists() else 'REFUSED'}"
    got = _sha256_file(p)
    sha = "sha256 ok" if got == digest else "sha256 MISMATCH"
    if got != digest:
        problems.append(f"{p}: sha256 mismatch (file is corrupt)")
    size = _fmt_size(p.stat().st_size)
    if rel.startswith(INDEX_DIR + "/"):         # virtual datasets: read through the shards above
        return f"  {rel}  {size}  {sha}  index"
    nd, bad = 0, []
    try:
        with h5py.File(p, "r", locking=False) as sf:
            dsets = []
            sf.visititems(lambda n, o: dsets.append(n) if isinstance(o, h5py.Dataset) else None)
            for n in dsets:
                why = _read_dataset(sf[n], f"{p}: dataset {n!r}")
                if why is None:
                    nd += 1
                else:
                    bad.append(n)
                    problems.append(why)
    except Exception as e:  # noqa: BLE001
        problems.append(f"{p}: cannot open shard: {e}")
        bad.append("<file>")
    read = f"{nd} datasets read ok" if not bad else f"{len(bad)} dataset(s) FAILED"
    return f"  {rel}  {size}  {sha}  {read}"


def _read_dataset(ds, what: str) -> str | None:
    """Read a shard's dataset through (a chunk at a time, so a declared
    size is never allocated at once); the problem, or None."""
    if ds.is_virtual:
        return f"{what}: is a virtual dataset (shards hold stored data)"
    why = stored_problem(ds, what)
    if why is not None:
        return why
    try:
        for sel in (ds.iter_chunks() if ds.chunks else [()]):
            ds[sel]
    except Exception as e:  # noqa: BLE001
        return f"{what} unreadable (checksum?): {e}"
    return None


def inspect(path, expected=None) -> tuple[bool, str]:
    """Human-readable report of a checkpoint and a full integrity check.

    Lists tensors (shape, dtype, pieces), attributes (config, training
    options, the layout that saved it) and, for every shard, its sha256 and
    a read of every dataset in it (which checks the fletcher32 checksums).
    ``expected``, if given, maps the ``config`` attribute and the tensor
    names to {parameter name: shape}, and tensors of other shapes are
    problems.
    Returns ``(ok, report)``; never raises for a broken checkpoint.
    """
    lines: list[str] = []
    problems: list[str] = []
    try:
        ck = open_checkpoint(path, verify=False)
    except CheckpointError as e:
        return False, f"checkpoint {path}\nPROBLEM: {e}\nresult: FAILED"
    with ck:
        lines.append(f"checkpoint {ck.path}")
        lines.append(f"  format {ck.attrs.get('format')} version {ck.attrs.get('version')}, step {ck.step}")
        lines.append("attributes:")
        for k, v in ck.attrs.items():
            if k in ("format", "version", "step"):
                continue
            s = json.dumps(v, sort_keys=True) if isinstance(v, (dict, list)) else repr(v)
            lines.append(f"  {k}: {s}")
        lines.append(f"tensors ({len(ck.names())}):")
        total = 0
        for name in ck.names():
            try:
                line, nbytes = _tensor_line(ck, name, problems)
                total += nbytes
                lines.append(line)
            except CheckpointError as e:
                problems.append(str(e))
            except Exception as e:  # noqa: BLE001
                problems.append(f"{ck.file}: tensor {name!r}: {e}")
        lines.append(f"  total {_fmt_size(total)}")
        if expected is not None:
            problems += _shape_problems(ck, expected)
        lines.append(f"shards ({len(ck.shard_sha256)}):")
        for rel, digest in sorted(ck.shard_sha256.items(), key=lambda kv: str(kv[0])):
            lines.append(_shard_line(ck, rel, digest, problems))
    for pr in problems:
        lines.append(f"PROBLEM: {pr}")
    ok = not problems
    lines.append("result: OK" if ok else f"result: FAILED ({len(problems)} problem(s))")
    return ok, "\n".join(lines)
