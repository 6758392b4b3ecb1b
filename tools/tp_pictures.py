"""Pictures for docs/tensor-parallelism.md: which block of X, W and Y each
rank holds, and what each collective of one linear moves.

    PYTHONPATH=. python tools/tp_pictures.py --out docs/tp      # needs matplotlib (pip install -e '.[bench]')

Ownership is not drawn from a description: for each scheme the script runs
the real layout under ``mpiexec`` (1-D on 4 ranks, 2-D on 2 x 2, 2.5-D on
2 x 2 x 2, 3-D on 2 x 2 x 2) and asks every rank which global rows and
columns of X, W and Y it holds (``Layout.canonical_seqs``,
``canonical_cols``, ``mid_seqs`` and ``Layout.shard``), so a picture cannot
drift from the code. The collectives are the sequence each layout's linear
runs (layouts/*.py), each drawn for the group that contains rank 0.

Toy sizes: B = 4 sequences of length 1 (so rows are sequences), h_in =
h_out = 8 for the first linear of a pair (c_attn, c_fc), and its partner
(attn.c_proj, mlp.c_proj) for 1-D.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
B, H = 4, 8
GRIDS = {"1d": (4, 1), "2d": (4, 1), "2.5d": (8, 2), "3d": (8, 1)}     # ranks, depth
TITLES = {"1d": "1-D (Megatron) on 4 ranks", "2d": "2-D (SUMMA) on a 2 x 2 grid",
          "2.5d": "2.5-D (Tesseract) on 2 x 2 x 2 (depth 2)", "3d": "3-D (cube) on 2 x 2 x 2"}


# --------------------------------------------------------------------------- collecting, under mpiexec


def collect(layout_name: str, depth: int, out: str) -> None:
    """Every rank: its coordinates and its blocks of X, W, Y (and, for the
    1-D pair, W2 and Y2); rank 0 writes them as JSON."""
    from mpi4py import MPI

    from mpicube.device.backend import make_backend
    from mpicube.core.config import ModelConfig
    from mpicube.parallel.grid import build_layout
    from mpicube.parallel.planning import resolve
    from mpicube.parallel.gridspec import GridSpec
    from mpicube.parallel.params import ParamDecl

    world = MPI.COMM_WORLD
    cfg = ModelConfig(vocab_size=16, n_ctx=1, n_layer=1, n_head=4, n_embd=H)
    layout = build_layout(resolve(GridSpec(layout_name, depth=depth), cfg, B, world.Get_size()),
                          make_backend("cpu", "float64"), world)
    coords = {name: int(getattr(layout, name)) for name in ("t", "l", "r", "c", "i", "j", "k") if hasattr(layout, name)}
    if layout_name == "2d":
        coords.pop("l", None)

    def cols(role, n):
        return [int(v) for v in layout.shard(ParamDecl("b", (n,), role, "zeros")).index[0]]

    def weight(role):
        rows, columns = layout.shard(ParamDecl("W", (H, H), role, "normal")).index
        return [[int(v) for v in rows], [int(v) for v in columns]]

    seqs = [int(v) for v in layout.canonical_seqs]
    canon_cols = [int(v) for v in layout.canonical_cols]
    mine = {"rank": world.rank, "coords": coords,
            "X": [seqs, canon_cols],
            "W": weight("w_column"),
            "Y": [[int(v) for v in layout.mid_seqs], cols("b_column", H)],
            "W2": weight("w_row"),
            "Y2": [seqs, canon_cols]}
    every = world.gather(mine, root=0)
    if world.rank == 0:
        Path(out).write_text(json.dumps(every))


def gather_ownership(layout: str) -> list:
    ranks, depth = GRIDS[layout]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "own.json"
        mpiexec = Path(sys.executable).parent / "mpiexec"
        env = dict(os.environ, PYTHONPATH=str(ROOT), MPIR_CVAR_ENABLE_HEAVY_YIELD="1", MPIEXEC_TIMEOUT="300")
        subprocess.run([str(mpiexec if mpiexec.exists() else "mpiexec"), "-n", str(ranks), sys.executable, __file__,
                        "--collect", layout, str(depth), str(out)], check=True, env=env, cwd=ROOT)
        return json.loads(out.read_text())


# --------------------------------------------------------------------------- what each linear does

# (phase, collective, operand, axes of the group, root index or None, what the code does), for one
# linear; operands: X/dX as X's blocks, W/dW as W's, Y/dY as Y's (the partner linear: W2, Y2).
SEQUENCES = {
    "1d": [("forward", "none", "Y", (), None, "c_fc: X replicated, W column block t: Y column block t, no communication"),
           ("backward", "all-reduce", "X", ("t",), None, "c_fc backward: each rank's dX = dY_t W_t^T is partial: all-reduce"),
           ("forward", "all-reduce", "Y2", ("t",), None, "c_proj (row split): each X_t W2_t is partial: all-reduce Y"),
           ("backward", "none", "W2", (), None, "c_proj backward: dY replicated, dX column block t: no communication")],
    "2d": [("forward", "broadcast", "X", ("c",), 0, "SUMMA step 0: X[r, 0] along the row"),
           ("forward", "broadcast", "W", ("r",), 0, "SUMMA step 0: W[0, c] down the column"),
           ("forward", "broadcast", "X", ("c",), 1, "SUMMA step 1: X[r, 1] along the row"),
           ("forward", "broadcast", "W", ("r",), 1, "SUMMA step 1: W[1, c] down the column"),
           ("backward", "reduce", "X", ("c",), 0, "dX[r, 0] = sum_c dY[r, c] W[0, c]^T, reduced along the row"),
           ("backward", "reduce", "X", ("c",), 1, "dX[r, 1]: the same onto column 1"),
           ("backward", "reduce", "W", ("r",), 0, "dW[0, c] = sum_r X[r, 0]^T dY[r, c], reduced down the column"),
           ("backward", "reduce", "W", ("r",), 1, "dW[1, c]: the same onto row 1")],
    "2.5d": [("forward", "broadcast", "X", ("c",), 0, "each depth slice runs 2-D SUMMA: step 0, X[r, 0] along the row"),
             ("forward", "broadcast", "W", ("r",), 0, "W[0, c] down the column (W is replicated over depth)"),
             ("backward", "all-reduce", "W", ("l",), None, "dW summed over the depth slices")],
    "3d": [("forward", "all-gather", "X", ("j",), None, "all-gather X over j"),
           ("forward", "all-gather", "W", ("i",), None, "all-gather W over i"),
           ("forward", "reduce-scatter", "Y", ("k",), None, "local GEMM, then reduce-scatter Y over k"),
           ("backward", "all-gather", "Y", ("k",), None, "all-gather dY over k"),
           ("backward", "reduce-scatter", "X", ("j",), None, "dX = dY W^T, reduce-scatter over j"),
           ("backward", "reduce-scatter", "W", ("i",), None, "dW = X^T dY, reduce-scatter over i")],
}


def group_of(ranks: list, axes: tuple, rank: int = 0) -> list:
    """Ranks that differ from ``rank`` only along ``axes``."""
    me = ranks[rank]["coords"]
    return [r["rank"] for r in ranks if all(r["coords"][a] == me[a] for a in me if a not in axes)]


# --------------------------------------------------------------------------- drawing


def cells(block) -> set:
    return {(r, c) for r in block[0] for c in block[1]}


def shape_of(operand: str) -> tuple:
    return (H, H) if operand.startswith("W") else (B, H)


def draw_matrix(ax, operand, ranks, colors, shown=None, hatched=(), outline=(), label=None):
    """One matrix: each cell coloured by the rank(s) in ``shown`` holding it."""
    import matplotlib.patches as patches

    rows, cols = shape_of(operand)
    shown = [r["rank"] for r in ranks] if shown is None else shown
    owners = {}
    for r in ranks:
        if r["rank"] in shown:
            for cell in cells(r[operand]):
                owners.setdefault(cell, []).append(r["rank"])
    for rr in range(rows):
        for cc in range(cols):
            who = owners.get((rr, cc), [])
            face = colors[who[0]] if len(who) == 1 else ("#d9d9d9" if who else "white")
            ax.add_patch(patches.Rectangle((cc, rows - 1 - rr), 1, 1, facecolor=face, edgecolor="#999999", lw=0.5,
                                           hatch="//" if (rr, cc) in hatched else None))
            if who:
                text = str(who[0]) if len(who) == 1 else ("all" if len(who) == len(ranks) else
                                                          ",".join(map(str, who)))
                ax.text(cc + 0.5, rows - 0.5 - rr, text, ha="center", va="center", fontsize=6 if len(text) > 2 else 8)
    if outline:
        rs = [c[0] for c in outline]
        cs = [c[1] for c in outline]
        ax.add_patch(patches.Rectangle((min(cs), rows - 1 - max(rs)), max(cs) - min(cs) + 1, max(rs) - min(rs) + 1,
                                       fill=False, edgecolor="black", lw=2.2))
    ax.set_xlim(0, cols)
    ax.set_ylim(0, rows)
    ax.set_aspect("equal")
    ax.set_xticks([])
    ax.set_yticks([])
    ax.set_title(label or operand, fontsize=9)


def rank_label(r: dict) -> str:
    c = r["coords"]
    return f"rank {r['rank']} (" + ", ".join(f"{k}={v}" for k, v in c.items()) + ")"


def ownership_figure(layout, ranks, colors, path):
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(11, 3.6), gridspec_kw={"width_ratios": [1, 1, 1]})
    names = {"X": f"X ({B} sequences x h_in {H})", "W": f"W (h_in {H} x h_out {H})", "Y": f"Y ({B} x h_out {H})"}
    for ax, operand in zip(axes, ("X", "W", "Y")):
        draw_matrix(ax, operand, ranks, colors, label=names[operand])
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[r["rank"]]) for r in ranks]
    fig.legend(handles, [rank_label(r) for r in ranks], loc="lower center", ncol=4, fontsize=7, frameon=False)
    fig.suptitle(f"{TITLES[layout]}: who holds which block of Y = X W (first linear of a pair)", fontsize=10)
    fig.tight_layout(rect=(0, 0.12, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def collectives_figure(layout, ranks, colors, path):
    """One panel per collective of the sequence, for the group holding rank 0."""
    import matplotlib.pyplot as plt

    steps = SEQUENCES[layout]
    ncol = min(4, len(steps))
    nrow = -(-len(steps) // ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(3.3 * ncol, 3.0 * nrow + 0.9), squeeze=False)
    for ax in axes.flat[len(steps):]:
        ax.axis("off")
    by_rank = {r["rank"]: r for r in ranks}
    for ax, (phase, op, operand, axes_of, root, what) in zip(axes.flat, steps):
        group = group_of(ranks, axes_of) if axes_of else [0]
        union = set().union(*(cells(by_rank[g][operand]) for g in group))
        name = {"X": "dX" if phase == "backward" else "X", "W": "dW" if phase == "backward" else "W",
                "Y": "dY" if phase == "backward" else "Y", "Y2": "Y (c_proj)", "W2": "W (c_proj)"}[operand]
        if op == "broadcast" or op == "reduce":
            coord = axes_of[0]
            root_rank = next(g for g in group if by_rank[g]["coords"][coord] == root)
            shown, outline = [root_rank], cells(by_rank[root_rank][operand])
            hatched = outline if op == "reduce" else ()
            who = f"rank {root_rank} " + ("sends to" if op == "broadcast" else "receives the sum from") + \
                  f" ranks {', '.join(map(str, group))}"
        elif op == "none":
            shown, outline, hatched, who = None, (), (), "ranks 0-3"
        else:
            shown, outline = group, union
            hatched = union if op in ("all-reduce", "reduce-scatter") else ()
            who = f"ranks {', '.join(map(str, group))}"
        title = (f"{phase}: {name}, no communication" if op == "none" else
                 f"{phase}: {op} {name}" + (f" over {'/'.join(axes_of)}" if axes_of else ""))
        draw_matrix(ax, operand, ranks, colors, shown=shown, hatched=hatched, outline=outline, label=title)
        ax.set_xlabel(_wrap(f"{what}; {who}", 44), fontsize=7)
    fig.suptitle(f"{TITLES[layout]}: the collectives of one linear (outlined: what the group ends up with; "
                 f"hatched: partial sums before the reduction)", fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _wrap(text: str, width: int) -> str:
    import textwrap

    return "\n".join(textwrap.wrap(text, width))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "docs" / "tp"), help="folder for the PNG files")
    ap.add_argument("--collect", nargs=3, metavar=("LAYOUT", "DEPTH", "JSON"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.collect:
        collect(args.collect[0], int(args.collect[1]), args.collect[2])
        return 0

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    palette = plt.get_cmap("tab10").colors
    for layout in GRIDS:
        ranks = gather_ownership(layout)
        colors = {r["rank"]: palette[r["rank"] % 10] for r in ranks}
        ownership_figure(layout, ranks, colors, out / f"{layout.replace('.', '_')}_blocks.png")
        collectives_figure(layout, ranks, colors, out / f"{layout.replace('.', '_')}_collectives.png")
        print(f"wrote {out}/{layout.replace('.', '_')}_blocks.png and _collectives.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
