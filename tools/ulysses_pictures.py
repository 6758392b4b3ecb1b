"""Text pictures for docs/ulysses.md, drawn from the code: which (head,
position) cells each cp rank holds before Ulysses' all-to-all
(``context.local_positions``: every head, a run of positions) and after it
(``ulysses.head_group`` of the group's positions, which the ring over the
groups then shares as ``context.local_positions`` of R ring ranks), for
Ulysses over all cp ranks and for the hybrid.

    PYTHONPATH=. python tools/ulysses_pictures.py            # prints the pictures
    PYTHONPATH=. python tools/ulysses_pictures.py --check docs/ulysses.md

--check exits 1 when the document's pictures differ from what the code
draws now (tests/test_context.py runs it).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import doc_pictures  # noqa: E402 (tools/, beside this file)

from mpicube.parallel import context, ulysses  # noqa: E402

T, NH = 16, 4


def holders(T: int, nh: int, C: int, U: int) -> tuple:
    """(before, after): {(head, position): cp rank} before and after the all-to-all."""
    R = C // U
    before, after = {}, {}
    for r in range(C):
        g, u = divmod(r, U)
        for p in context.local_positions(T, C, r, U).tolist():
            for h in range(nh):
                before[h, p] = r
        group = context.local_positions(T, R, g) if R > 1 else range(T)      # the group's positions, in order
        heads = range(nh)[ulysses.head_group(nh, U, u)]
        for p in list(group):
            for h in heads:
                after[h, p] = r
    return before, after


def picture(C: int, U: int, T: int = T, nh: int = NH) -> str:
    """Heads down, positions across; each cell the cp rank that holds it."""
    before, after = holders(T, nh, C, U)
    R = C // U
    kind = f"ulysses, cp = {C}" if R == 1 else f"hybrid, cp = {C}: Ulysses groups of {U}, a ring of {R} groups"
    lines = [f"T = {T}, {nh} heads, {kind}", f"{'':9}{'before':<{T + 4}}after the all-to-all",
             f"{'position':<9}" + "".join(str(p % 10) for p in range(T)) + "    "
             + "".join(str(p % 10) for p in range(T))]
    for h in range(nh):
        lines.append(f"head {h:<4}" + "".join(str(before[h, p]) for p in range(T)) + "    "
                     + "".join(str(after[h, p]) for p in range(T)))
    return "\n".join(lines)


def pictures() -> dict:
    return {"ulysses": picture(4, 4), "hybrid": picture(4, 2)}


if __name__ == "__main__":
    doc_pictures.main(__doc__, pictures, "tools/ulysses_pictures.py")
