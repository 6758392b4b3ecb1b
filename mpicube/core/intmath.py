"""Integer arithmetic that both the layouts and the grid need (the grid
builds layouts, so this sits below both)."""

from __future__ import annotations


def integer_root(n: int, k: int):
    """r with r**k == n, or None."""
    r = round(n ** (1.0 / k))
    for cand in (r - 1, r, r + 1):
        if cand >= 1 and cand ** k == n:
            return cand
    return None
