"""Text pictures for docs/deepseek.md, drawn from the code: which rows and
columns of DeepSeek-V3's attention (MLA) and shared-expert weights each
tensor-parallel rank holds on serial, 1-D, 2-D, 2.5-D and 3-D, and which
weights every rank holds whole.

    PYTHONPATH=. python tools/mla_pictures.py
    PYTHONPATH=. python tools/mla_pictures.py --check docs/deepseek.md

Nothing here restates a layout's rule: the weights are the family's own
declarations (``family_of(cfg).params``: q_down and kv_down REPLICATED,
q_up and kv_up COLUMN, c_proj ROW, the shared experts' c_fc COLUMN and
c_proj ROW), and each rank's block is the ``ParamSpec`` its layout's
``shard`` gives, the layout built by its own class on paper
communicators (``analysis.costplace.rank_layout``, as ``info --experts``
does), so no MPI. --check exits 1 when the page's pictures differ from
what the code draws now (tests/test_deepseek_model.py runs it).
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import doc_pictures  # noqa: E402 (tools/, beside this file)

from mpicube.analysis.costplace import grid_words, rank_layout  # noqa: E402
from mpicube.core.config import ModelConfig  # noqa: E402
from mpicube.model.families import family_of  # noqa: E402
from mpicube.parallel.gridspec import GridSpec  # noqa: E402
from mpicube.parallel.planning import resolve  # noqa: E402

# Toy sizes: h 8, 4 heads of qk = nope 2 + rope 2 and v 2, q rank 4, kv rank 4, one shared expert of width 4.
CFG = ModelConfig(vocab_size=16, n_ctx=4, n_layer=1, n_head=4, n_embd=8, arch="deepseek_v3", q_lora_rank=4,
                  kv_lora_rank=4, qk_rope_head_dim=2, qk_nope_head_dim=2, v_head_dim=2, n_experts=4, top_k=2,
                  n_shared_experts=1, moe_ffn_hidden=4, router="sigmoid")
WEIGHTS = ("attn.q_down", "attn.q_up", "attn.kv_down", "attn.kv_up", "attn.c_proj", "moe.shared.c_fc",
           "moe.shared.c_proj")
GRIDS = {"serial": (1, 1, "serial on 1 rank"), "1d": (4, 1, "1-D on 4 ranks (t)"),
         "2d": (4, 1, "2-D on a 2 x 2 grid (r, c)"), "2.5d": (8, 2, "2.5-D on 2 x 2 x depth 2 (l, r, c)"),
         "3d": (8, 1, "3-D on a 2 x 2 x 2 cube (i, j, k)")}
KINDS = {"w_replicated": "REPLICATED", "w_column": "COLUMN", "w_row": "ROW"}


def declarations(cfg: ModelConfig) -> dict:
    """{name: ParamDecl} of the family's parameters for ``cfg``."""
    return {d.name: d for d in family_of(cfg).params(cfg)}


def runs(index) -> str:
    """Global indices as runs: [0, 1, 4, 5] -> '0-1|4-5', [2] -> '2'."""
    index = np.asarray(index)
    parts = np.split(index, np.flatnonzero(np.diff(index) != 1) + 1)
    return "|".join(f"{p[0]}" if len(p) == 1 else f"{p[0]}-{p[-1]}" for p in parts)


def block(spec) -> str:
    """'whole', or 'rows x columns' as index runs."""
    if all(len(ix) == n for ix, n in zip(spec.index, spec.decl.shape)):
        return "whole"
    return " x ".join(runs(ix) for ix in spec.index)


def describe(decl) -> str:
    return f"{decl.name.split('.', 2)[2][:-len('.weight')]} {decl.shape[0]}x{decl.shape[1]} {KINDS[decl.role]}"


def legend() -> str:
    """The weights' shapes and kinds, from the family's declarations, and
    what their columns hold (ops/mla.py's per-head order)."""
    cfg, decls = CFG, declarations(CFG)
    dn, dr, dv, rkv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    qk, kv = dn + dr, dn + dv
    s = decls["h.0.moe.shared.c_proj.weight"].shape[0]                  # the shared experts' width
    q_proj = declarations(replace(cfg, q_lora_rank=0))["h.0.attn.q_proj.weight"]
    return "\n".join(
        [f"block 0's weights, rows x columns and kind (h {cfg.n_embd}, {cfg.n_head} heads, q rank "
         f"{cfg.q_lora_rank}, kv rank {rkv}, one shared expert of width {s}):"]
        + [f"  {describe(decls[f'h.0.{w}.weight'])}" for w in WEIGHTS]
        + [f"  without --q-lora-rank: {describe(q_proj)} in place of q_down and q_up, split by heads as q_up",
           f"  q_up's columns: head n's [q_nope {dn} | q_pe {dr}] at {qk}n-{qk}n+{qk - 1}; "
           f"kv_up's: head n's [k_nope {dn} | v {dv}] at {kv}n-{kv}n+{kv - 1}",
           f"  c_proj's rows: head n's v at {dv}n-{dv}n+{dv - 1}",
           f"  kv_down's columns: the kv latent 0-{rkv - 1}, k_pe (the rope key every head shares) "
           f"{rkv}-{rkv + dr - 1}",
           f"  shared.c_fc's columns: [gate 0-{s - 1} | up {s}-{2 * s - 1}]"])


def rank_specs(layout: str, sequence_parallel: bool = False) -> list:
    """[(layout object, [ParamSpec of each of WEIGHTS])] for every tensor-parallel rank."""
    tp, depth, _ = GRIDS[layout]
    run = resolve(GridSpec(layout, depth=depth, sequence_parallel=sequence_parallel), CFG, tp * 4, tp)
    decls = declarations(CFG)
    out = []
    for rank in range(tp):
        lay, _, _ = rank_layout(run, rank)
        out.append((lay, [lay.shard(decls[f"h.0.{w}.weight"]) for w in WEIGHTS]))
    return out


def summed(held: list) -> str:
    """Where the REPLICATED weights' partial gradients are summed (``ParamSpec.grad_comm``)."""
    axes = {s.grad_comm.axis for _, specs in held for s in specs
            if KINDS[s.decl.role] == "REPLICATED" and s.grad_comm is not None}
    return f"summed over {', '.join(sorted(axes))} (the ranks hold different canonical blocks)" if axes else \
        "each rank's whole, no sum"


def picture(layout: str) -> str:
    """One line per tensor-parallel rank: its coordinates, heads, and the
    block of each weight it holds; then where the REPLICATED weights'
    gradients are summed."""
    held = rank_specs(layout)
    rows = [[str(rank), grid_words(lay)[2:] if layout == "2d" else grid_words(lay),     # 2-D: its l is always 0
             runs(lay.head_ids)] + [block(s) for s in specs] for rank, (lay, specs) in enumerate(held)]
    head = ["rank", "grid", "heads"] + [w.split(".")[-1] if w.startswith("attn") else "shared." + w.split(".")[-1]
                                       for w in WEIGHTS]
    widths = [max(len(r[i]) for r in rows + [head]) for i in range(len(head))]
    lines = [GRIDS[layout][2]] + ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [head] + rows]
    lines.append(f"q_down, kv_down gradients: {summed(held)}")
    if layout == "1d":
        split = rank_specs(layout, sequence_parallel=True)
        same = all([block(s) for s in a] == [block(s) for s in b] for (_, a), (_, b) in zip(held, split))
        lines.append(f"  under --sequence-parallel ({'the same' if same else 'other'} blocks): {summed(split)}")
    return "\n".join(lines)


def pictures() -> dict:
    return {"weights": legend(),
            **{layout: picture(layout) for layout in GRIDS}}


if __name__ == "__main__":
    doc_pictures.main(__doc__, pictures, "tools/mla_pictures.py")
