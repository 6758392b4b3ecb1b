"""Which query and kv heads each tensor-parallel rank holds, drawn from
the code that places them (``mpicube info --heads``; the pictures of
docs/llama.md).

Nothing here restates a layout's rule: each rank's head block comes from
the layout's own ``head_coords`` (the classmethod its ``__init__`` builds
``head_ids`` and the kv group from), its columns of ``c_attn`` from
``params.split_decl`` on the model's own declaration of ``c_attn``, and the
ranks that replicate a kv head are those that hold the same rows of the
weight (the same ``line``) and the same kv columns: the sub-group whose
gradients ``gradients.sync_shared`` sums. Pure, no MPI.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.config import ModelConfig
from ..model.gpt import gpt_params
from ..parallel.layouts import LAYOUTS
from ..parallel.params import split_decl


@dataclass
class RankHeads:
    """One tensor-parallel rank's heads."""

    rank: int
    coords: str             # the layout's coordinates of the rank, e.g. "(i,j,k)=(0,1,0)"
    q: list                 # query heads
    kv: list                # kv heads (their k and v columns)
    sharers: list           # its kv group: the ranks of its line holding the same kv columns (itself included)


def coords_of(layout: str, tp: int, depth: int, rank: int) -> str:
    """The rank's coordinates in the layout's own names (the divmods of
    each layout's ``__init__``)."""
    if layout == "1d":
        return f"t={rank}"
    if layout in ("2d", "2.5d"):
        q = LAYOUTS[layout].grid_side(tp, depth)
        l, rest = divmod(rank, q * q)
        r, c = divmod(rest, q)
        return f"(r,c)=({r},{c})" if layout == "2d" else f"(l,r,c)=({l},{r},{c})"
    if layout == "3d":
        q = LAYOUTS[layout].cube_side(tp)
        i, rest = divmod(rank, q * q)
        j, k = divmod(rest, q)
        return f"(i,j,k)=({i},{j},{k})"
    return "-"


def head_placement(layout: str, cfg: ModelConfig, tp: int, depth: int = 1) -> list:
    """[RankHeads] for every tensor-parallel rank of ``layout`` on ``tp``
    ranks (``depth``: 2.5-D's), for the model ``cfg`` (GPT-2's heads are
    their own kv heads)."""
    cls = LAYOUTS[layout]
    decl = next(d for d in gpt_params(cfg) if d.name == "h.0.attn.c_attn.weight")
    hd, nq = cfg.head_dim, cfg.n_head
    nkv = cfg.kv_heads if cfg.llama else cfg.n_head
    rows, holders = [], {}
    for rank in range(tp):
        split, block, line = cls.head_coords(tp, depth, rank)
        cols = split_decl(decl, split, block)                               # (columns,) of [q | k | v]
        q = sorted({int(c) // hd for c in cols if c < nq * hd})
        kv = sorted({(int(c) - nq * hd) // hd for c in cols if nq * hd <= c < (nq + nkv) * hd})
        key = (line, tuple(kv))
        holders.setdefault(key, []).append(rank)
        rows.append((rank, q, kv, key))
    return [RankHeads(rank, coords_of(layout, tp, depth, rank), q, kv, holders[key]) for rank, q, kv, key in rows]


def _span(ids: list) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    out, ids = [], sorted(ids)
    start = prev = ids[0]
    for i in ids[1:] + [None]:
        if i is not None and i == prev + 1:
            prev = i
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if i is not None:
            start = prev = i
    return ",".join(out)


def heads_table(layout: str, cfg: ModelConfig, tp: int, depth: int = 1) -> str:
    """The placement as text: one line per tensor-parallel rank."""
    placed = head_placement(layout, cfg, tp, depth)
    nkv = cfg.kv_heads if cfg.llama else cfg.n_head
    split = LAYOUTS[layout].head_coords(tp, depth, 0)[0]
    where = {"1d": "over t", "2d": "over the grid's columns c", "2.5d": "over the grid's columns c",
             "3d": "over j", "serial": "none"}[layout]
    share = max(1, split // nkv)
    lines = [f"heads: {cfg.n_head} query heads over {nkv} kv head{'s' if nkv > 1 else ''} "
             f"({cfg.n_head // nkv} queries per kv head); "
             f"layout {layout} on {tp} ranks splits them {split} ways ({where})",
             "each kv head is " + (f"replicated on {share} ranks (its k/v gradient summed over them)"
                                   if share > 1 else "held whole by one rank of each line")]
    width = max([len('coords')] + [len(r.coords) for r in placed])
    lines.append(f"{'rank':>4}  {'coords':<{width}}  {'q heads':<8}  {'kv heads':<8}  kv gradient summed over ranks")
    for r in placed:
        lines.append(f"{r.rank:>4}  {r.coords:<{width}}  {_span(r.q):<8}  {_span(r.kv):<8}  "
                     f"{_span(r.sharers) if len(r.sharers) > 1 else '-'}")
    return "\n".join(lines)

