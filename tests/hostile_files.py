"""Hostile checkpoints and token shards, made from good ones.

A checkpoint is untrusted input (docs/design.md section 6): someone may hand us a
``checkpoint.h5`` whose tensors take their bytes from anywhere HDF5 can
reach. Each case here rewrites a copy of a good step directory the way such
a file would be made, and then records the sha256 of every listed file
again (``relist``), so that it is the storage check that must catch it, not
the checksum. Token shard cases are whole files (or a FIFO) with a header
that lies.

Every case is ``make(step, outside)``: ``step`` is the step directory of a
copy of the good run, ``outside`` a directory outside the run (the test
runs its commands there, so it is also the current directory that HDF5
falls back to for a relative virtual source it cannot find).
``CHECKPOINT_CASES`` and ``SHARD_CASES`` map a case's name to (make, what the
one error line must match).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import h5py
import numpy as np

MAIN = "checkpoint.h5"
INDEX = "index/rank_00000.h5"
SHARD = "shards/rank_00000.h5"
TENSOR = "model/wpe"                      # (n_ctx, n_embd) float32, stored in SHARD by a one-rank run
SECRET = b"root:x:0:0:this-is-not-yours:/root:/bin/sh\n" * 64     # what an outside file holds


# --------------------------------------------------------------------------- helpers


def relist(step: Path, add: dict | None = None) -> None:
    """Record in checkpoint.h5 the sha256 of every listed file as it is now
    (a hostile writer would), plus ``add`` {name: digest}."""
    with h5py.File(step / MAIN, "r+") as f:
        listed = json.loads(f.attrs["shard_sha256"])
        for rel in listed:
            p = step / rel
            if p.is_file() and not p.is_symlink():
                listed[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
        listed.update(add or {})
        f.attrs["shard_sha256"] = json.dumps(listed)


def secret_file(outside: Path) -> Path:
    p = outside / "secret.bin"
    p.write_bytes(SECRET)
    return p


def tensor_shape(step: Path) -> tuple:
    with h5py.File(step / SHARD, "r") as f:
        return f[TENSOR].shape, f[TENSOR].dtype


def evil_h5(path: Path, step: Path) -> Path:
    """An HDF5 file with every tensor of the shard, shaped right, all 0.5:
    what a link or a source pointing outside would read instead."""
    with h5py.File(step / SHARD, "r") as src, h5py.File(path, "w") as dst:
        found = []
        src.visititems(lambda n, o: found.append((n, o.shape, o.dtype)) if isinstance(o, h5py.Dataset) else None)
        for name, shape, dtype in found:
            dst.create_dataset(name, data=np.full(shape, 0.5, dtype))
    return path


def set_link(step: Path, link) -> None:
    """checkpoint.h5's link of TENSOR replaced by ``link``."""
    with h5py.File(step / MAIN, "r+") as f:
        del f[TENSOR]
        f[TENSOR] = link


def set_vds(step: Path, holder: str, source: str, dset: str = TENSOR, rows=None, src_shape=None) -> None:
    """TENSOR in the file ``holder`` of the step (checkpoint.h5 or the
    index file) replaced by a virtual dataset over ``source``:``dset``
    (``rows``: only those rows mapped)."""
    shape, dtype = tensor_shape(step)
    src_shape = src_shape or shape
    layout = h5py.VirtualLayout(shape, dtype)
    vsrc = h5py.VirtualSource(source, dset, shape=src_shape)
    if rows is None:
        layout[...] = vsrc
    else:
        layout[:rows] = vsrc[:rows]
    with h5py.File(step / holder, "r+") as f:
        del f[TENSOR]
        f.create_virtual_dataset(TENSOR, layout, fillvalue=0)
    relist(step)


def set_shard_dataset(step: Path, **create) -> None:
    """The shard's TENSOR dataset replaced by ``create_dataset(**create)``."""
    with h5py.File(step / SHARD, "r+") as f:
        del f[TENSOR]
        f.create_dataset(TENSOR, **create)
    relist(step)


# --------------------------------------------------------------------------- checkpoint cases


def external_storage(step, outside):
    """TENSOR a dataset of checkpoint.h5 whose bytes are an outside file
    (h5py ``external=``; the reported case used /etc/passwd)."""
    shape, dtype = tensor_shape(step)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    with h5py.File(step / MAIN, "r+") as f:
        del f[TENSOR]
        f.create_dataset(TENSOR, shape=shape, dtype=dtype, external=[(str(secret_file(outside)), 0, nbytes)])


def shard_external_storage(step, outside):
    """The shard's own dataset (a listed file, re-hashed) stored outside."""
    shape, dtype = tensor_shape(step)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    set_shard_dataset(step, shape=shape, dtype=dtype, external=[(str(secret_file(outside)), 0, nbytes)])


def elink_absolute(step, outside):
    set_link(step, h5py.ExternalLink(str(evil_h5(outside / "evil.h5", step).resolve()), TENSOR))


def elink_escape(step, outside):
    evil = evil_h5(outside / "evil.h5", step)
    set_link(step, h5py.ExternalLink(os.path.relpath(evil, step), TENSOR))


def elink_unlisted(step, outside):
    """A link into a copy of the index file, inside the directory but not listed."""
    shutil.copy(step / INDEX, step / "index/rank_00009.h5")
    set_link(step, h5py.ExternalLink("index/rank_00009.h5", TENSOR))


def group_elink(step, outside):
    """The group ``model`` itself an external link to an outside file: every
    ``model/...`` lookup would pass through it."""
    evil = evil_h5(outside / "evil.h5", step)
    with h5py.File(step / MAIN, "r+") as f:
        del f["model"]
        f["model"] = h5py.ExternalLink(str(evil.resolve()), "model")


def vds_escape(step, outside):
    """A virtual dataset in checkpoint.h5 over ``../outside.h5``: beside the
    step directory, not in it."""
    evil_h5(step.parent / "outside.h5", step)
    set_vds(step, MAIN, "../outside.h5")


def vds_index_escape(step, outside):
    """The index file's mapping over ``../../outside.h5`` (from index/)."""
    evil_h5(step.parent / "outside.h5", step)
    set_vds(step, INDEX, "../../outside.h5")


def vds_missing(step, outside):
    """A mapping over a shard that does not exist: it would read as zeros."""
    set_vds(step, INDEX, "../shards/rank_00042.h5")


def vds_cwd_fallback(step, outside):
    """A mapping over ``stash/evil.h5``, missing from the step directory but
    present in the current directory, where HDF5 looks next."""
    (outside / "stash").mkdir(exist_ok=True)
    evil_h5(outside / "stash" / "evil.h5", step)
    set_vds(step, MAIN, "stash/evil.h5")


def vds_unlisted(step, outside):
    """A mapping over a copy of the shard inside the directory, not listed."""
    shutil.copy(step / SHARD, step / "shards/rank_00001.h5")
    set_vds(step, INDEX, "../shards/rank_00001.h5")


def vds_nested(step, outside):
    """The shard's dataset itself a virtual dataset over an outside file."""
    shape, dtype = tensor_shape(step)
    evil = evil_h5(outside / "evil.h5", step)
    layout = h5py.VirtualLayout(shape, dtype)
    layout[...] = h5py.VirtualSource(str(evil.resolve()), TENSOR, shape=shape)
    with h5py.File(step / SHARD, "r+") as f:
        del f[TENSOR]
        f.create_virtual_dataset(TENSOR, layout, fillvalue=0)
    relist(step)


def vds_partial(step, outside):
    """The mapping covers half the rows; the rest would read as zeros."""
    shape, _ = tensor_shape(step)
    set_vds(step, INDEX, "../" + SHARD, rows=shape[0] // 2)


def vds_past_end(step, outside):
    """The shard's dataset cut to half its rows; the whole-dataset mapping
    would read the missing half as zeros."""
    shape, dtype = tensor_shape(step)
    set_shard_dataset(step, data=np.ones((shape[0] // 2,) + shape[1:], dtype))


def vds_no_dataset(step, outside):
    """A mapping over a dataset name the shard does not have."""
    set_vds(step, INDEX, "../" + SHARD, dset="model/nothing")


def unwritten(step, outside):
    """TENSOR a dataset of checkpoint.h5 that was never written: all zeros."""
    shape, dtype = tensor_shape(step)
    with h5py.File(step / MAIN, "r+") as f:
        del f[TENSOR]
        f.create_dataset(TENSOR, shape=shape, dtype=dtype)


def symlinked_shard(step, outside):
    """The shard moved outside and a symbolic link left in its place (its
    bytes, so its sha256, unchanged)."""
    moved = outside / "rank_00000.h5"
    shutil.move(step / SHARD, moved)
    (step / SHARD).symlink_to(moved.resolve())


def listed_fifo(step, outside):
    """A listed file that is a FIFO: hashing it would wait forever."""
    os.mkfifo(step / "shards" / "pipe")
    relist(step, {"shards/pipe": "0" * 64})


def listed_escape(step, outside):
    """A listed file outside the directory (with its true digest)."""
    secret = secret_file(outside)
    relist(step, {os.path.relpath(secret, step): hashlib.sha256(SECRET).hexdigest()})


def listed_absolute(step, outside):
    relist(step, {"/etc/passwd": hashlib.sha256(Path("/etc/passwd").read_bytes()).hexdigest()})


T = rf"tensor '{TENSOR}'"
OUT = r"outside the checkpoint directory"
CHECKPOINT_CASES = {
    "external-storage": (external_storage, rf"{T}: its bytes are stored in the external file \S*secret\.bin"),
    "shard-external-storage": (shard_external_storage,
                               rf"{T}: virtual source {SHARD}:{TENSOR}: dataset: its bytes are stored in the "
                               r"external file \S*secret\.bin"),
    "elink-absolute": (elink_absolute, rf"{T}: external link points to '/\S*evil\.h5', {OUT}"),
    "elink-escape": (elink_escape, rf"{T}: external link points to '(\.\./)+\S*evil\.h5', {OUT}"),
    "elink-unlisted": (elink_unlisted, rf"{T}: external link points to index/rank_00009\.h5, which is not one "
                                       r"of the files checkpoint\.h5 lists"),
    "group-elink": (group_elink, r"'model' is an external link \(a checkpoint holds hard links only\)"),
    "vds-escape": (vds_escape, rf"{T}: virtual source 0 points to '\.\./outside\.h5', {OUT}"),
    "vds-index-escape": (vds_index_escape, rf"{T}: virtual source 0 points to '\.\./\.\./outside\.h5', {OUT}"),
    "vds-missing": (vds_missing, rf"{T}: virtual source 0 points to shards/rank_00042\.h5, which is not one of"),
    "vds-cwd-fallback": (vds_cwd_fallback, rf"{T}: virtual source 0 points to stash/evil\.h5, which is not one of"),
    "vds-unlisted": (vds_unlisted, rf"{T}: virtual source 0 points to shards/rank_00001\.h5, which is not one of"),
    "vds-nested": (vds_nested, rf"{T}: virtual source {SHARD}:{TENSOR}: is itself a virtual dataset"),
    "vds-partial": (vds_partial, rf"{T}: its virtual mappings do not cover every element exactly once"),
    "vds-past-end": (vds_past_end, rf"{T}: virtual mapping 0 reads past the end of {SHARD}:{TENSOR}"),
    "vds-no-dataset": (vds_no_dataset, rf"{T}: virtual source {SHARD}:model/nothing: is missing"),
    "unwritten": (unwritten, rf"{T}: its storage was never \(fully\) written and would read as zeros"),
    "symlinked-shard": (symlinked_shard, rf"{SHARD}: resolves to \S*rank_00000\.h5, {OUT}"),
    "listed-fifo": (listed_fifo, r"shards/pipe: not a regular file"),
    "listed-escape": (listed_escape, r"lists a file name '(\.\./)+\S*secret\.bin' is not a plain path inside"),
    "listed-absolute": (listed_absolute, r"lists a file name '/etc/passwd' is not a plain path inside"),
}


# --------------------------------------------------------------------------- token shard cases

MAGIC, VERSION, HEADER_BYTES = 20240520, 1, 1024


def raw_shard(path: Path, magic=MAGIC, version=VERSION, count=None, tokens=200, cut=0) -> Path:
    """A shard of ``tokens`` byte-valued tokens whose header says (magic,
    version, count), less its last ``cut`` bytes."""
    header = np.zeros(256, "<i4")
    header[:3] = magic, version, tokens if count is None else count
    raw = header.tobytes() + (np.arange(tokens) % 256).astype("<u2").tobytes()
    path.write_bytes(raw[: len(raw) - cut])
    return path


SHARD_CASES = {
    "wrong-magic": (lambda p: raw_shard(p, magic=MAGIC + 1), r"wrong magic number 20240521"),
    "wrong-version": (lambda p: raw_shard(p, version=7), r"unsupported shard version 7"),
    "count-past-end": (lambda p: raw_shard(p, count=2**31 - 1), r"size mismatch: header says 2147483647 tokens"),
    "count-negative": (lambda p: raw_shard(p, count=-5), r"size mismatch: header says -5 tokens"),
    "cut-body": (lambda p: raw_shard(p, cut=3), r"size mismatch: header says 200 tokens"),
    "cut-header": (lambda p: p.write_bytes(np.array([MAGIC], "<i4").tobytes() + b"\0" * 100),
                   r"file is shorter than the 1024-byte shard header"),
    "fifo": (lambda p: os.mkfifo(p), r"not a regular file"),
}
