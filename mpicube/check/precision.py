"""Mixed precision that did not take effect, or took effect unasked: a
check of a whole step's activations against the dtype a trace declares.

A 16-bit run stores its activations in 16 bits, so when its trace holds
them (as float32) every value lies on the 16-bit grid; a float32
computation puts almost none there (a float32 number falls on bfloat16's
grid with probability 2^-16). A trace that declares bfloat16 or float16
and whose activations and logits in a step are all off that grid
computed them in float32 - mixed precision silently off - and a float32 or
float64 trace whose activations and logits all lie on a 16-bit grid
computed in 16 bits. Either is a divergence of the step's first
activation, whatever the values: the budget of a 16-bit comparison is
wide enough to pass a float32 run. One tensor on the grid is enough to
spare a 16-bit trace (an autocast LayerNorm's float32 output is off it,
its linears' outputs are on it)."""

from __future__ import annotations

import numpy as np

from .blocks import stored_shape
from .measure import blocks
from .names import step_of
from .tracefile import reader

HALF = ("bfloat16", "float16")
MIN_DISTINCT = 16


def _grid(dtype: str):
    import ml_dtypes

    return ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float16


def facts(read, shape: tuple) -> tuple:
    """({dtype: whether every finite value is exactly a ``dtype`` number,
    and there is one} for each 16-bit dtype, whether the values are
    ``telling``: more than MIN_DISTINCT distinct ones - zeros, ones, a
    constant or a few small integers lie on every grid), read one block at
    a time (a trace's declared sizes do not drive memory)."""
    off, finite, distinct = dict.fromkeys(HALF, False), False, np.empty(0)
    for block in blocks(shape):
        values = np.asarray(read(block)).ravel()
        if distinct.size <= MIN_DISTINCT:               # a few more than enough to tell
            distinct = np.union1d(distinct, np.unique(values))[:MIN_DISTINCT + 1]
        a = values.astype(np.float32)
        a = a[np.isfinite(a)]
        finite = finite or bool(a.size)
        for h in HALF:
            off[h] = off[h] or not np.array_equal(a.astype(_grid(h)).astype(np.float32), a)
    return {h: finite and not off[h] for h in HALF}, distinct.size > MIN_DISTINCT


def _computed(name: str) -> bool:
    local = name.split("/", 1)[1] if step_of(name) else ""
    return local.startswith("act/") or local == "logits"


def precision_rows(rows: dict, order: list, sets: dict, paths: dict, dtypes: tuple) -> None:
    """Mark, per side and step, the first activation of a step whose
    activations and logits contradict the side's declared dtype (the
    module docstring): that row fails with the reason in its note. A
    tensor whose shards hold too little to be put together says nothing
    (its own row fails)."""
    for side, dtype in zip("AB", dtypes):
        steps = {}
        for name in order:
            if name in sets[side] and _computed(name):
                steps.setdefault(step_of(name), []).append(name)
        for names in steps.values():
            found = []                                  # (on each grid, telling) per readable tensor
            for n in names:
                read = reader(sets[side][n], paths[side], np.inf, np.inf)[0]
                if read is not None:
                    found.append(facts(read, stored_shape(sets[side][n], paths[side])))
            if not found:
                continue
            if dtype in HALF:
                if any(grids[dtype] for grids, _ in found):
                    continue
                why = (f"{side}: a {dtype} trace whose activations and logits of this step all lie off the {dtype} "
                       f"grid: computed in float32, mixed precision not in effect")
            else:
                if not any(telling for _, telling in found):
                    continue
                grid = next((h for h in HALF if all(grids[h] for grids, _ in found)), None)
                if grid is None:
                    continue
                why = (f"{side}: a {dtype} trace whose activations and logits of this step all lie on the {grid} "
                       f"grid: computed in 16 bits, not {dtype}")
            row = rows.get(names[0])
            if row is not None:
                row.ok = False
                row.note = "; ".join(filter(None, (row.note, why)))
