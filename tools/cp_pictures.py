"""Text pictures for docs/context-parallelism.md, drawn from the code:
which chunks each cp rank holds (``context.local_positions``), the ring's
steps and which blocks each rank computes or skips (``context._pairs``,
the schedule RingAttention runs), and the online-softmax merge of one row
(``attention_blocks.pair_forward`` on a real row of scores).

    PYTHONPATH=. python tools/cp_pictures.py            # prints the pictures
    PYTHONPATH=. python tools/cp_pictures.py --check docs/context-parallelism.md

--check exits 1 when the document's pictures differ from what the code
draws now (tests/test_context.py runs it).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import doc_pictures  # noqa: E402 (tools/, beside this file)

from mpicube.ops import attention_blocks as ab  # noqa: E402
from mpicube.parallel import context  # noqa: E402

T, C, BLOCK = 16, 2, 2          # 4 chunks of 4 positions, blocks of 2: two per chunk


def chunk_picture(T: int = T, C: int = C) -> str:
    """One line per cp rank: the positions it holds, by chunk."""
    c = T // (2 * C)
    lines = [f"T = {T}, cp = {C}: {2 * C} chunks of {c} positions"]
    lines.append("position  " + "".join(f"{p % 10}" for p in range(T)))
    for r in range(C):
        held = set(context.local_positions(T, C, r).tolist())
        row = "".join(str(p // c) if p in held else "." for p in range(T))
        lines.append(f"rank {r}    {row}   chunks {context.chunks(C, r)}")
    return "\n".join(lines)


def ring_picture(T: int = T, C: int = C, block: int = BLOCK) -> str:
    """Per rank and ring step: the (query, key) score grid of the whole
    sequence, # where the rank computes a block, . where nothing is done
    (blocks above the diagonal, or pairs other ranks or steps compute)."""
    c = T // (2 * C)
    out = []
    for r in range(C):
        for s in range(C):
            grid = np.full((T, T), ".")
            owner = (r - s) % C
            for rows, cols, q0, k0 in context._pairs(context.chunks(C, r), context.chunks(C, owner), c, block):
                n, m = rows.stop - rows.start, cols.stop - cols.start
                grid[q0:q0 + n, k0:k0 + m] = "#"
            out.append(f"rank {r}, step {s}: queries of chunks {context.chunks(C, r)} x keys of rank {owner}'s "
                       f"chunks {context.chunks(C, owner)}")
            out += ["  " + "".join(row) for row in grid]
            out.append("")
    total = context.ring_scores(T, C, block)
    out.append(f"computed score elements: {total} of {T * T} (blockwise serial: {ab.computed_scores(T, block)})")
    return "\n".join(out)


def merge_picture() -> str:
    """One query row against two key blocks: the running (max, sum, output)
    after each block (the second block's larger score rescales what the
    first left by exp(old max - new max)), and the final output against the
    plain softmax."""
    q = np.array([1.0, 0.0]).reshape(1, 1, 1, 2)               # (B, nh, 1, hd) one scaled query
    k = np.array([[0.5, 0], [1.0, 0], [2.0, 0], [-0.5, 0]]).reshape(1, 1, 4, 2)   # scores 0.5, 1, 2, -0.5
    v = np.array([[1.0, 0], [0, 1.0], [1.0, 1.0], [-1.0, 0]]).reshape(1, 1, 4, 2)
    state = [np.full((1, 1, 1, 1), -np.inf), np.zeros((1, 1, 1, 1)), np.zeros((1, 1, 1, 2))]
    lines = ["query at position 3 against key blocks [0, 2) and [2, 4):"]
    for j0 in (0, 2):
        scores = (q @ k[:, :, j0:j0 + 2].swapaxes(-1, -2)).ravel()
        ab.pair_forward(state, q, k[:, :, j0:j0 + 2], v[:, :, j0:j0 + 2], 3, j0, None, 1.0, np.float64)
        m, l, acc = (float(state[0].ravel()[0]), float(state[1].ravel()[0]), state[2].ravel())
        lines.append(f"  block [{j0}, {j0 + 2}): scores {np.round(scores, 3).tolist()} -> running max {m:.3f}, "
                     f"sum {l:.3f}, output {np.round(acc, 3).tolist()}")
    y = state[2].ravel() / state[1].ravel()[0]
    s = (q @ k.swapaxes(-1, -2)).ravel()
    p = np.exp(s - s.max())
    want = (p / p.sum()) @ v[0, 0]
    lines.append(f"  output / sum = {np.round(y, 6).tolist()}; softmax(all 4 scores) @ v = "
                 f"{np.round(want, 6).tolist()}")
    lines.append(f"  log-sum-exp kept for backward: {float(state[0].ravel()[0] + np.log(state[1].ravel()[0])):.6f}")
    return "\n".join(lines)


def pictures() -> dict:
    return {"chunks": chunk_picture(), "ring": ring_picture(), "merge": merge_picture()}


if __name__ == "__main__":
    doc_pictures.main(__doc__, pictures, "tools/cp_pictures.py")
