"""One tensor of both traces against each other, read in bounded blocks.

A trace is untrusted input, and the memory ``compare`` needs must not be
whatever a file declares: each tensor is read from both files one block
of at most ``BLOCK`` elements at a time (``blocks``), and what the verdict
needs - the largest difference and magnitude, the Frobenius norms, the
first non-finite or differing element - is accumulated block by block
(``Tally``). The shapes were checked against each other before (compare.py),
so a tensor is read only when both traces hold it with the same shape.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from . import tolerance as tol

BLOCK = 1 << 20             # elements read from each trace at a time (8 MiB in float64)


@dataclass
class Row:
    """One tensor, step or attribute of either trace."""

    name: str
    shape: tuple
    max_abs: float
    max_rel: float
    ok: bool
    note: str = ""
    rel_fro: float = math.nan         # relative Frobenius error
    bound: float = math.nan           # its depth-aware bound
    compared: bool = True             # False: missing on one side, nothing to measure
    fp8: dict = None                  # the FP8 unit's statistics (fp8_tolerance.py), float32 FP8 traces only

    @property
    def margin(self) -> float:
        """bound / error: above 1 is within what rounding explains."""
        if not self.compared or math.isnan(self.rel_fro):
            return math.nan
        return math.inf if self.rel_fro == 0 else self.bound / self.rel_fro


def blocks(shape: tuple, limit: int = BLOCK):
    """Tuples of slices that tile ``shape`` in C order, each of at most
    ``limit`` elements (or one row of the innermost axis, if that is
    longer): whole trailing axes, a run along one axis, single indices
    before it. Nothing for a tensor with no elements."""
    shape = tuple(int(n) for n in shape)
    if not shape:
        yield ()
        return
    if 0 in shape:
        return
    k = 0
    while k < len(shape) - 1 and math.prod(shape[k + 1:]) > limit:
        k += 1
    step = max(1, limit // math.prod(shape[k + 1:]))
    rest = (slice(None),) * (len(shape) - k - 1)
    for outer in np.ndindex(*shape[:k]):
        lead = tuple(slice(i, i + 1) for i in outer)
        for lo in range(0, shape[k], step):
            yield lead + (slice(lo, min(lo + step, shape[k])),) + rest


def _start(block: tuple) -> tuple:
    return tuple(s.start or 0 for s in block)


def _where(mask: np.ndarray, start: tuple = ()) -> tuple:
    """The index of mask's first true element, offset by the block's ``start``."""
    local = np.unravel_index(int(np.flatnonzero(mask)[0]), mask.shape)
    return tuple(int(i) + (start[d] if d < len(start) else 0) for d, i in enumerate(local))


class Tally:
    """What the verdict on one tensor needs, accumulated over its blocks."""

    def __init__(self):
        self.odd = None                   # a NaN or infinity on one side only (or two different ones)
        self.shared, self.shared_at, self.kinds = 0, None, set()     # the same non-finite value on both sides
        self.kept = 0                     # finite elements compared
        self.max_abs = self.scale = 0.0
        self.norm_a = self.norm_b = self.norm_d = 0.0
        self.first_diff = None            # the first element that differs (integer tensors)

    def add(self, a: np.ndarray, b: np.ndarray, start: tuple, exact: bool) -> None:
        """One block of each trace, the same shape; ``start``: where it begins."""
        if exact and self.first_diff is None and np.any(a != b):
            self.first_diff = _where(np.atleast_1d(a != b), start) if a.ndim else ()
        a64, b64 = np.atleast_1d(a).astype(np.float64), np.atleast_1d(b).astype(np.float64)
        fa, fb = np.isfinite(a64), np.isfinite(b64)
        if not (fa.all() and fb.all()):
            same = ~fa & ~fb & ((a64 == b64) | (np.isnan(a64) & np.isnan(b64)))
            odd = (~fa | ~fb) & ~same
            if odd.any():
                at = np.unravel_index(int(np.flatnonzero(odd)[0]), odd.shape)
                self.odd = f"{a64[at]} in A vs {b64[at]} in B at {_where(odd, start)}"
                return
            if self.shared_at is None:
                self.shared_at = _where(same, start)
            self.shared += int(same.sum())
            self.kinds |= {str(v) for v in np.unique(a64[same]).tolist()}
            a64, b64 = a64[fa], b64[fa]
        if a64.size == 0:
            return
        self.kept += a64.size
        d = np.abs(a64 - b64)
        self.max_abs = max(self.max_abs, float(d.max()))
        self.scale = max(self.scale, float(np.abs(a64).max()), float(np.abs(b64).max()))
        self.norm_a = math.hypot(self.norm_a, float(np.linalg.norm(a64)))
        self.norm_b = math.hypot(self.norm_b, float(np.linalg.norm(b64)))
        self.norm_d = math.hypot(self.norm_d, float(np.linalg.norm(d)))


def measure(name: str, read_a, read_b, shape: tuple, kinds: tuple, dtype: str, depth_: int, rtol: float,
            atol: float, verdict: str, limit: int = BLOCK) -> Row:
    """The row of a tensor both traces hold with the same ``shape``:
    ``read_a(block)`` and ``read_b(block)`` give a block of each (a tuple
    of slices, or a tuple of indices), ``kinds`` their numpy dtype kinds."""
    exact = kinds[0] not in "fc" and kinds[1] not in "fc"       # tokens, masks: integers agree exactly
    bound = tol.depth_bound(dtype, depth_, exact)
    tally = Tally()
    for block in blocks(shape, limit):
        tally.add(np.asarray(read_a(block)), np.asarray(read_b(block)), _start(block), exact)
        if tally.odd is not None:
            return Row(name, shape, math.inf, math.inf, False, "non-finite: " + tally.odd, math.inf, bound)
    note = ""
    if tally.shared:
        kinds_ = "/".join(sorted(tally.kinds))
        note = f"both hold {kinds_} at {tally.shared} place(s), first {tally.shared_at}"
    if tally.kept == 0:
        return Row(name, shape, 0.0, 0.0, True, note, 0.0, bound)
    max_abs, scale = tally.max_abs, tally.scale
    max_rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else math.inf)
    fro_scale = max(tally.norm_a, tally.norm_b)
    rel_fro = tally.norm_d / fro_scale if fro_scale > 0 else (0.0 if tally.norm_d == 0 else math.inf)
    if exact:
        ok = max_abs == 0
        if not ok and not tally.shared and tally.first_diff is not None:
            note = first_difference(name, read_a, read_b, shape, tally.first_diff)
    elif verdict == "depth":
        ok = rel_fro <= bound
    else:
        ok = max_abs <= atol + rtol * scale
    return Row(name, shape, max_abs, max_rel, ok, note, rel_fro, bound)


def first_difference(name: str, read_a, read_b, shape: tuple, at: tuple) -> str:
    """Where two integer tensors first differ: for a mixture's chosen
    experts (B, T, K) the token and both choices, so that a routing that
    parts is named at the token where it does; else the element."""
    if name.endswith(".experts") and "/moe/" in name and len(shape) == 3:
        b_, t = at[:2]
        choice = (b_, t, slice(None))
        return (f"first differs at token (sequence {b_}, position {t}): experts "
                f"{np.asarray(read_a(choice)).tolist()} in A vs {np.asarray(read_b(choice)).tolist()} in B")
    return f"first differs at {at}: {np.asarray(read_a(at))} in A vs {np.asarray(read_b(at))} in B"


def equal(read_a, read_b, shape: tuple, limit: int = BLOCK) -> bool:
    """Whether two tensors of ``shape`` hold the same values, element for
    element (a NaN equals nothing), read one block at a time."""
    return all(np.array_equal(np.asarray(read_a(block)), np.asarray(read_b(block))) for block in blocks(shape, limit))
