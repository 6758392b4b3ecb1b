"""Where an HDF5 dataset's bytes come from: the checks that both
checkpoints (files/checkpoint/storage.py) and traces (check/tracefile.py)
make before HDF5 is let read anything.

An HDF5 file is untrusted input, and HDF5 reads far more than the file it
was opened on: an external link names any file, a dataset's raw *external
storage* is any file at all (``/etc/passwd``, or a FIFO that blocks the
reader forever), a virtual dataset maps any file's datasets, and storage
that was never written reads as fill values (zeros) of whatever size the
file declares. Each check here looks at a link or a property list only,
never at the bytes, so a refused dataset is never opened for reading.

Here, in ``core``, because both ``files`` and ``check`` need the same rule
(``check`` may import ``core`` only, and must stay importable with numpy
and h5py alone). The checks return a problem as a line of text, or None,
so that ``mpicube inspect`` can list them all and a reader raise the first.
"""

from __future__ import annotations

import math


def _layouts() -> dict:
    from h5py import h5d

    return {h5d.COMPACT: "compact", h5d.CONTIGUOUS: "contiguous", h5d.CHUNKED: "chunked"}


def link_problem(f, name: str, what: str, final_external: bool = False, whose: str = "a checkpoint") -> str | None:
    """Why the path ``name`` in ``f`` is not all hard links (but for an
    external link at its end, if ``final_external``), or None; a path that
    stops short (a missing tensor) is for the caller to report. Each prefix
    is looked at before HDF5 is let through it: a lookup of ``a/b`` follows
    whatever link ``a`` is."""
    import h5py

    parts = name.split("/")
    for i in range(1, len(parts) + 1):
        path = "/".join(parts[:i])
        try:
            link = f.get(path, getlink=True)
        except Exception as e:  # noqa: BLE001 - h5py raises KeyError, OSError, RuntimeError...
            return f"{what}: cannot look up {path!r}: {e}"
        if link is None:
            return None
        if isinstance(link, h5py.HardLink):
            continue
        if i == len(parts) and final_external and isinstance(link, h5py.ExternalLink):
            continue
        return f"{what}: {path!r} is {link_kind(link)} link ({whose} holds hard links only)"
    return None


def link_kind(link) -> str:
    """"an external", "a soft" or "an unknown": a non-hard link, for a message."""
    import h5py

    return {h5py.ExternalLink: "an external", h5py.SoftLink: "a soft"}.get(type(link), "an unknown")


def stored_problem(ds, what: str) -> str | None:
    """Why a non-virtual dataset's bytes are not all in its own file, fully
    written, or None. Reads the property list and the storage's offset and
    size only."""
    from h5py import h5d

    dcpl = ds.id.get_create_plist()
    if dcpl.get_external_count():
        target = dcpl.get_external(0)[0].decode("utf-8", "replace")
        return f"{what}: its bytes are stored in the external file {target} (refused)"
    layout = dcpl.get_layout()
    if layout not in _layouts():
        return f"{what}: storage layout {layout} is not contiguous, chunked or compact"
    nbytes = ds.size * ds.dtype.itemsize
    if nbytes == 0 or layout == h5d.COMPACT:
        return None
    if layout == h5d.CONTIGUOUS:
        offset, size = ds.id.get_offset(), ds.id.get_storage_size()
        if offset is not None and offset + size > ds.file.id.get_filesize():
            return f"{what}: its storage lies past the end of its file"
        written = offset is not None and size >= nbytes
    else:
        written = ds.id.get_num_chunks() == math.prod(-(-n // c) for n, c in zip(ds.shape, ds.chunks))
    return None if written else f"{what}: its storage was never (fully) written and would read as zeros"


def self_contained_problem(ds, what: str) -> str | None:
    """Why a dataset does not hold its own bytes in its own file: virtual
    (its bytes are other datasets', in this file or any other), external
    raw storage, or storage not fully written; None when it does."""
    try:
        if ds.is_virtual:
            return f"{what}: is a virtual dataset (its bytes would come from other files; refused)"
        return stored_problem(ds, what)
    except Exception as e:  # noqa: BLE001 - a damaged property list
        return f"{what}: cannot read its storage description: {e}"
