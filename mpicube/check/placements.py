"""Placements: for each block of a sharded tensor, how it stands on each
axis of the mesh of ranks - replicated (``R``), one block of a split
along dimensions d, e, ... (``S(d)``, ``S(d,e)``), a pending sum whose
parts the ranks along the axis hold (``P``), or held at some coordinates
of the axis only (``-``: a pipeline stage's layers).

Why a checker wants them: a pending sum consumed as if it were
replicated (a missing all-reduce) gives the right number whenever the
ranks happen to hold the same values, and a wrong one later. Blocks and
indices alone say where each rank's numbers go; placements say what they
are, so ``compare`` can sum the parts of a pending sum before comparing,
refuse a placement that cannot be right (a parameter that is a pending
sum, ranks that disagree on a tensor's placement, a sum with a part
missing), and, where a replicated tensor is wrong, test whether the sum
over an axis of its copies is right - naming the bug and its ranks
(``pending_sum_note``).

On disk (format version 3, docs/trace-format.md "Placements"): the root
attribute ``mesh`` (JSON ``{"axes": [...], "sizes": [...]}``) and on each
shard member the attributes ``placement`` (``"R,S(1),P"``: one entry per
mesh axis) and ``coords`` (int64, the rank's coordinate on each axis).
mpicube infers its placements from its layouts' indices (``infer``), the
torch recorder declares a DTensor's ``Partial`` and infers the rest.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace

import numpy as np

from ..core.errors import UserError
from .blocks import is_sharded, merge, read_blocks, stored_shape
from .measure import measure

REPLICATE, PARTIAL, ABSENT = "R", "P", "-"
_SHARD = re.compile(r"S\((\d+(?:;\d+)*)\)")
# a pending sum is never right here: what the step consumes as it is, or what no reduction produces
NEVER_PENDING = ("init/", "param/", "dropout/", "lr", "tokens")


def shard_entry(dims) -> str:
    """``S(1)``, or ``S(0;2)`` for a block split along several dimensions."""
    return "S(" + ";".join(str(d) for d in sorted(dims)) + ")"


def valid_entry(entry: str) -> bool:
    return entry in (REPLICATE, PARTIAL, ABSENT) or bool(_SHARD.fullmatch(entry))


# --------------------------------------------------------------------------- writing: inferred from the indices


def infer(tensor, sizes):
    """``tensor`` (a shards.Sharded) with every shard's placement filled in, on each axis of a
    mesh of ``sizes``, from the shards' ``coords`` and indices: a shard's
    partners on axis a are the shards whose coords differ on a only; held
    by partners at every coordinate of a with the same index, ``R``; with
    indices that differ, ``S(dims)``; not held at every coordinate, ``-``.
    An entry already declared (a DTensor's ``P``) is kept."""
    keyed = [(s, tuple(_as_index(ix, n) for ix, n in zip(s.index, tensor.shape))) for s in tensor.shards]
    out = []
    for shard, index in keyed:
        entries = list(shard.placement or (None,) * len(sizes))
        for a, size in enumerate(sizes):
            if entries[a] is not None:
                continue
            if size == 1:
                entries[a] = REPLICATE
                continue
            at = {}                                        # coordinate on a -> indices held there
            for other, other_index in keyed:
                if all(c == o for k, (c, o) in enumerate(zip(shard.coords, other.coords)) if k != a):
                    at.setdefault(other.coords[a], []).append(other_index)
            if len(at) < size:
                entries[a] = ABSENT
                continue
            dims = set()
            for c, held in at.items():
                if c == shard.coords[a] or any(_same(index, h) for h in held):
                    continue
                dims |= {d for d, (mine, theirs) in enumerate(zip(index, held[0])) if not np.array_equal(mine, theirs)}
            entries[a] = shard_entry(dims) if dims else REPLICATE
        out.append(replace(shard, placement=tuple(entries), coords=tuple(shard.coords)))
    return replace(tensor, shards=out)


def _as_index(ix, n) -> np.ndarray:
    return np.arange(n)[ix] if isinstance(ix, slice) else np.asarray(ix, dtype=np.int64)


def _same(a, b) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(a, b))


def mesh_attr(axes, sizes) -> str:
    return json.dumps({"axes": list(axes), "sizes": [int(n) for n in sizes]})


# --------------------------------------------------------------------------- reading


def read_mesh(group, path) -> tuple:
    """(axis names, sizes) of the trace holding ``group``; a placed tensor
    in a trace without a readable ``mesh`` is bad input."""
    raw = group.file.attrs.get("mesh")
    try:
        mesh = json.loads(raw.decode() if isinstance(raw, bytes) else str(raw))
        axes, sizes = [str(a) for a in mesh["axes"]], [int(n) for n in mesh["sizes"]]
        if len(axes) != len(sizes) or any(n < 1 for n in sizes):
            raise ValueError
    except (TypeError, ValueError, KeyError):
        raise UserError(f"{path}: {group.name.lstrip('/')} has placements but the trace has no readable "
                        f"'mesh' attribute ({{\"axes\": [...], \"sizes\": [...]}})") from None
    return axes, sizes


def read_placed(group, path) -> tuple:
    """(axes, sizes, [(key, rank, coords, placement, index, data)])."""
    axes, sizes = read_mesh(group, path)
    name = group.name.lstrip("/")
    placed = []
    for key, rank, index, data in read_blocks(group, path):
        attrs = group[key].attrs
        text = attrs.get("placement")
        text = text.decode() if isinstance(text, bytes) else str(text) if text is not None else None
        entries = tuple(text.split(",")) if text is not None else ()
        coords = tuple(int(c) for c in np.atleast_1d(attrs.get("coords", [])))
        if len(entries) != len(axes) or not all(valid_entry(e) for e in entries):
            raise UserError(f"{path}: {name}/{key}: placement {text!r} is not one of R, S(d), P, - per mesh axis "
                            f"({', '.join(axes)})")
        if len(coords) != len(axes) or any(not 0 <= c < n for c, n in zip(coords, sizes)):
            raise UserError(f"{path}: {name}/{key}: coords {list(coords)} do not fit the mesh {sizes}")
        placed.append((key, rank, coords, entries, index, data))
    return axes, sizes, placed


def assemble_placed(group, path, rtol: float, atol: float):
    """(tensor, problem or "") of a tensor whose blocks carry placements:
    the placements checked (``placement_problem``), each pending sum's
    parts added, then put together as any sharded tensor (blocks.merge:
    replicas must agree, every element must be held)."""
    axes, sizes, placed = read_placed(group, path)
    problem = placement_problem(group.name.lstrip("/"), axes, sizes, placed)
    blocks = sum_partials(placed, [a for a in range(len(axes)) if any(p[3][a] == PARTIAL for p in placed)])
    tensor, merged = merge(blocks, group, path, rtol, atol)
    return tensor, problem or merged


def placement_problem(name: str, axes, sizes, placed) -> str:
    """What makes these placements impossible, or "": ranks that disagree
    on an axis's placement; a pending sum where none may stand; a pending
    sum with a part missing."""
    for a, axis in enumerate(axes):
        kinds = {}
        for _, rank, _, entries, _, _ in placed:
            kinds.setdefault(entries[a], rank)
        if len(kinds) > 1:
            (p1, r1), (p2, r2) = list(kinds.items())[:2]
            what = " (a pending sum consumed as replicated)" if {p1, p2} == {PARTIAL, REPLICATE} else ""
            return f"placements disagree on {axis}: rank {r1} holds {p1}, rank {r2} {p2}{what}"
    local = name.split("/", 1)[1] if name.startswith("step_") else name
    for _, rank, _, entries, _, _ in placed:
        if PARTIAL in entries and local.startswith(NEVER_PENDING):
            axis = axes[entries.index(PARTIAL)]
            return f"rank {rank} holds a pending sum over {axis}, which this tensor cannot be"
    for a, axis in enumerate(axes):
        if placed and placed[0][3][a] == PARTIAL:
            for group in _groups(placed, [a]).values():
                if len(group) != sizes[a]:
                    return (f"a pending sum over {axis} with {len(group)} of its {sizes[a]} parts "
                            f"(ranks {', '.join(str(p[1]) for p in group)})")
    return ""


def _groups(placed, over) -> dict:
    """Blocks that are parts of one sum over the axes ``over``: the same
    coordinates elsewhere and the same index."""
    groups = {}
    for p in placed:
        coords = tuple(c for k, c in enumerate(p[2]) if k not in over)
        key = (coords, tuple(ix.tobytes() for ix in p[4]))
        groups.setdefault(key, []).append(p)
    return groups


def sum_partials(placed, over) -> list:
    """``read_blocks``-style blocks with the parts of every sum over the
    axes ``over`` added (in float64, stored back in the blocks' dtype)."""
    if not over:
        return [(key, rank, index, data) for key, rank, _, _, index, data in placed]
    blocks = []
    for group in _groups(placed, over).values():
        total = sum(np.asarray(p[5], dtype=np.float64) for p in group)
        key, rank, _, _, index, data = group[0]
        blocks.append((key, rank, index, total.astype(data.dtype)))
    return sorted(blocks, key=lambda b: b[1])


# --------------------------------------------------------------------------- diagnosis


def pending_sum_note(group, path, other, shape: tuple, rtol: float, atol: float) -> str:
    """Where a placed tensor of ``shape`` disagrees with ``other`` (the
    other trace's tensor of that shape, as a measure.py ``read(block)``,
    read block by block): the axis, if any, over which the sum of its
    copies that say ``R`` is ``other`` to the budget - a pending sum
    consumed as replicated - with the ranks that hold it; else ""."""
    if not any("placement" in group[k].attrs for k in group):
        return ""
    axes, sizes, placed = read_placed(group, path)
    found = []                      # every axis whose sum is right: identical copies cannot tell them apart
    for a, axis in enumerate(axes):
        if sizes[a] == 1 or not placed or any(p[3][a] != REPLICATE for p in placed):
            continue
        partial = [b for b in range(len(axes)) if placed[0][3][b] == PARTIAL]
        summed, _ = merge(sum_partials(placed, [a, *partial]), group, path, np.inf, np.inf)
        if summed is None or summed.shape != shape or not np.isfinite(summed).all():
            continue
        summed = np.asarray(summed, dtype=np.float64)
        if measure("", lambda block, values=summed: values[block], other, shape, ("f", "f"), "float64", 1, rtol, atol,
                   "budget").ok:
            found.append(axis)
    if not found:
        return ""
    over = " or ".join(found)
    ranks = ", ".join(str(r) for r in sorted({p[1] for p in placed}))
    return (f"a pending sum over {over} consumed as replicated: ranks {ranks} hold parts whose sum over {over} "
            f"is the other trace's tensor")


def placement_notes(name: str, sets: dict, paths: dict, readers: list, shape: tuple, rtol: float,
                    atol: float) -> str:
    """``pending_sum_note`` for a tensor that disagrees, each side's that
    carries placements tested against the other's tensor (``readers``: A's
    and B's ``read(block)``, None for one that could not be put together;
    "" otherwise): the one call compare.py makes into this module."""
    notes = []
    for side, theirs in (("A", readers[1]), ("B", readers[0])):
        group = sets[side].get(name)
        if group is None or not is_sharded(group) or theirs is None:
            continue
        if stored_shape(group, paths[side]) == shape:
            note = pending_sum_note(group, paths[side], theirs, shape, rtol, atol)
            if note:
                notes.append(f"{side}: {note}")
    return "; ".join(notes)
