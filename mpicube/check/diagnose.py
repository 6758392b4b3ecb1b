"""What a disagreeing tensor's values say about the bug, beyond that it
disagrees: a pending sum consumed as replicated (placements.py), and an
update that was never applied (the parameter after step s is the one
before it). Called by compare.py for rows that already fail; a note here
never turns a row that agrees into a divergence."""

from __future__ import annotations

import numpy as np

from .blocks import stored_shape
from .measure import equal
from .names import step_of
from .placements import placement_notes
from .tracefile import reader


def notes(name: str, sets: dict, paths: dict, readers: list, shape: tuple, rtol: float, atol: float) -> str:
    """The notes for a failing row ("" when none applies): ``readers`` are
    A's and B's ``read(block)`` of the tensor (None for a side whose shards
    hold too little to put it together), ``shape`` the shape both hold."""
    found = [placement_notes(name, sets, paths, readers, shape, rtol, atol),
             unapplied(name, sets, paths, readers, shape)]
    return "; ".join(n for n in found if n)


def unapplied(name: str, sets: dict, paths: dict, readers: list, shape: tuple) -> str:
    """For ``step_s/param/X``: which side's X is exactly what it was before
    step s (``init/X`` or ``step_{s-1}/param/X``) while the other's moved:
    gradients computed and never applied. Read block by block."""
    s = step_of(name)
    if not s or not name.startswith(f"step_{s}/param/"):
        return ""
    param = name.split("/", 2)[2]
    before = f"init/{param}" if s == 1 else f"step_{s - 1}/param/{param}"
    out = []
    for side, mine, theirs in (("A", *readers), ("B", *readers[::-1])):
        if before not in sets[side] or mine is None or theirs is None:
            continue
        if stored_shape(sets[side][before], paths[side]) != shape:
            continue
        old = reader(sets[side][before], paths[side], np.inf, np.inf)[0]
        if old is not None and equal(old, mine, shape) and not equal(old, theirs, shape):
            out.append(f"{side}: {param} is exactly what it was before step {s}: its update was not applied")
    return "; ".join(out)
