"""What a disagreeing tensor's values say about the bug, beyond that it
disagrees: a pending sum consumed as replicated (placements.py), and an
update that was never applied (the parameter after step s is the one
before it). Called by compare.py for rows that already fail; a note here
never turns a row that agrees into a divergence."""

from __future__ import annotations

import numpy as np

from .names import step_of
from .placements import placement_notes
from .tracefile import read_tensor


def notes(name: str, sets: dict, paths: dict, a: np.ndarray, b: np.ndarray, rtol: float, atol: float) -> str:
    """The notes for a failing row ("" when none applies)."""
    found = [placement_notes(name, sets, paths, a, b, rtol, atol), unapplied(name, sets, paths, a, b)]
    return "; ".join(n for n in found if n)


def unapplied(name: str, sets: dict, paths: dict, a: np.ndarray, b: np.ndarray) -> str:
    """For ``step_s/param/X``: which side's X is exactly what it was before
    step s (``init/X`` or ``step_{s-1}/param/X``) while the other's moved:
    gradients computed and never applied."""
    s = step_of(name)
    if not s or not name.startswith(f"step_{s}/param/"):
        return ""
    param = name.split("/", 2)[2]
    before = f"init/{param}" if s == 1 else f"step_{s - 1}/param/{param}"
    out = []
    for side, mine, theirs in (("A", a, b), ("B", b, a)):
        if before not in sets[side]:
            continue
        old = read_tensor(sets[side][before], paths[side], np.inf, np.inf)[0]
        if np.shape(old) == np.shape(mine) and np.array_equal(old, mine) and not np.array_equal(old, theirs):
            out.append(f"{side}: {param} is exactly what it was before step {s}: its update was not applied")
    return "; ".join(out)
