"""``mpicube inspect``: a human-readable report and a full integrity check."""

from __future__ import annotations

import json
import os

import h5py

from .read import open_checkpoint

from .format import CheckpointError, _fmt_shape, _fmt_size, _sha256_file
from .vds import INDEX_DIR


def _pieces(ck, name: str, ds, problems: list) -> str:
    """Where a tensor's pieces are: the shard files its virtual dataset (in
    an index file, or in checkpoint.h5 itself in a one-level checkpoint)
    maps; missing files are problems."""
    def known(fn: str) -> bool:
        if fn not in ck.shard_sha256:
            problems.append(f"tensor {name!r}: source {fn} has no recorded sha256")
        elif not (ck.path / fn).is_file():
            problems.append(f"tensor {name!r}: source {ck.path / fn} is missing")
        else:
            return True
        return False

    here = os.path.relpath(os.path.dirname(os.path.abspath(ds.file.filename)), os.path.abspath(ck.path))
    pieces, shards = 0, set()
    for src in ds.virtual_sources():
        fn = os.path.normpath(os.path.join(here, src.file_name))        # relative to the checkpoint
        pieces += 1
        if fn not in shards and known(fn):
            shards.add(fn)
    return f"{pieces} pieces in {len(shards)} shard(s)"


def _shape_problems(ck, expected) -> list:
    """Tensors shaped unlike the model that the ``config`` attribute
    describes (a checkpoint no reader could load). ``expected`` maps that
    config and the checkpoint's tensor names to {parameter name: shape}
    (a ValueError for a config the tensors cannot be); the caller knows the
    model, this package knows only tensors by name and shape."""
    cfg = ck.attrs.get("config")
    if not isinstance(cfg, dict):
        return [f"{ck.file}: attribute 'config' is missing or not a JSON object"]
    try:
        shapes = expected(cfg, set(ck.names()))
    except (TypeError, ValueError) as e:
        return [f"{ck.file}: attribute 'config' does not describe a model: {e}"]
    have, problems = set(ck.names()), []
    for param, shape in shapes.items():
        for prefix in ("model", "optimizer/m", "optimizer/v"):
            name = f"{prefix}/{param}"
            if name in have and tuple(ck.shape(name)) != tuple(shape):
                problems.append(f"{ck.file}: tensor {name!r} has shape {tuple(ck.shape(name))} but the model in "
                                f"its 'config' attribute needs {tuple(shape)}")
    return problems


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
                ds = ck._f.get(name)
                if not isinstance(ds, h5py.Dataset):
                    raise CheckpointError("missing")
                nbytes = ds.size * ds.dtype.itemsize
                total += nbytes
                how = _pieces(ck, name, ds, problems) if ds.is_virtual else "stored in checkpoint.h5"
                lines.append(f"  {name:<40s} {_fmt_shape(ds.shape):<14s} {str(ds.dtype):<8s} {how}")
            except Exception as e:  # noqa: BLE001
                problems.append(f"{ck.file}: tensor {name!r}: {e}")
        lines.append(f"  total {_fmt_size(total)}")
        if expected is not None:
            problems += _shape_problems(ck, expected)
        lines.append(f"shards ({len(ck.shard_sha256)}):")
        for rel, digest in sorted(ck.shard_sha256.items()):
            p = ck.path / rel
            if not p.is_file():
                problems.append(f"{p}: shard file is missing")
                lines.append(f"  {rel}  MISSING")
                continue
            got = _sha256_file(p)
            sha = "sha256 ok" if got == digest else "sha256 MISMATCH"
            if got != digest:
                problems.append(f"{p}: sha256 mismatch (file is corrupt)")
            nd, bad = 0, []
            if rel.startswith(INDEX_DIR + "/"):         # virtual datasets: read through the shards above
                lines.append(f"  {rel}  {_fmt_size(p.stat().st_size)}  {sha}  index")
                continue
            try:
                with h5py.File(p, "r", locking=False) as sf:
                    dsets = []
                    sf.visititems(lambda n, o: dsets.append(n) if isinstance(o, h5py.Dataset) else None)
                    for n in dsets:
                        try:
                            sf[n][()]
                            nd += 1
                        except Exception as e:  # noqa: BLE001
                            bad.append(n)
                            problems.append(f"{p}: dataset {n!r} unreadable (checksum?): {e}")
            except Exception as e:  # noqa: BLE001
                problems.append(f"{p}: cannot open shard: {e}")
                bad.append("<file>")
            read = f"{nd} datasets read ok" if not bad else f"{len(bad)} dataset(s) FAILED"
            lines.append(f"  {rel}  {_fmt_size(p.stat().st_size)}  {sha}  {read}")
    for pr in problems:
        lines.append(f"PROBLEM: {pr}")
    ok = not problems
    lines.append("result: OK" if ok else f"result: FAILED ({len(problems)} problem(s))")
    return ok, "\n".join(lines)
