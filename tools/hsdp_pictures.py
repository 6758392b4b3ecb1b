"""Text pictures for docs/hsdp.md, drawn from the code: which shard group
and replica group each data-parallel rank joins under --hsdp
(``gridspec.hsdp_coords``, what ``grid.build_layout`` splits by) and which
chunk of a layer's segment it keeps (``zero.Partition`` over its shard
group, as ``fsdp.SegmentedStore`` cuts it), beside plain --zero 3.

    PYTHONPATH=. python tools/hsdp_pictures.py
    PYTHONPATH=. python tools/hsdp_pictures.py --check docs/hsdp.md

--check exits 1 when the page's pictures differ from what the code draws
now (tests/test_hsdp.py runs it).
"""

from __future__ import annotations

import string
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import doc_pictures  # noqa: E402 (tools/, beside this file)

from mpicube.parallel.gridspec import hsdp_coords  # noqa: E402
from mpicube.parallel.zero import Partition  # noqa: E402

DP, SEGMENT = 8, 24


def picture(dp: int = DP, replicas: int = 2, segment: int = SEGMENT) -> str:
    """One line per dp rank: its shard group, replica group, and the
    elements of a segment of ``segment`` elements it keeps (letters name
    the chunk's owner in its group)."""
    title = (f"--zero 3 over dp {dp}" if replicas == 1 else
             f"--zero 3 --hsdp {replicas} over dp {dp}: {replicas} replicas of {dp // replicas}-rank shard groups")
    lines = [title, f"{'dp rank':<8} {'group':>5} {'shard':>5}  segment of {segment} elements (the chunk it keeps)"]
    for d in range(dp):
        group, shard = hsdp_coords(d, dp, replicas) if replicas > 1 else (0, d)
        part = Partition(segment, dp // replicas, shard)
        own = part.own
        row = "".join(string.ascii_lowercase[shard] if own.start <= k < own.stop else "." for k in range(segment))
        lines.append(f"{d:<8} {group:>5} {shard:>5}  {row}")
    return "\n".join(lines)


def pictures() -> dict:
    return {"zero3": picture(replicas=1), "hsdp": picture(replicas=2)}


if __name__ == "__main__":
    doc_pictures.main(__doc__, pictures, "tools/hsdp_pictures.py")
