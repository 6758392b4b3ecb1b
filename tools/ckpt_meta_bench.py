"""The metadata side of a checkpoint save at scale, without training or MPI.

    python tools/ckpt_meta_bench.py                 # 512 ranks, the model of jobs/slurm_512gpu.sh
    python tools/ckpt_meta_bench.py --ranks 64 --n-layer 4

Builds, in one process, what every rank of a 3-D (q x q x q) job does with
its metadata when saving parameters and AdamW moments: describe its blocks
(the real layout's, through the real checkpoint code), sort them by the
owner of each tensor (pickled per owner, as the alltoall sends them), and,
as an owner, merge the pieces of its tensors, check that every element is
written once, write its index file of virtual datasets and check it. Then
what rank 0 does on top: unpickle the owners' summaries and write
checkpoint.h5 over the index files. Every rank's time is measured in turn;
the figures are rank 0's total, and the slowest rank's. The blocks are
views of one zero, so no tensor data exists and no shard is written: the
index files and checkpoint.h5 are built exactly as a save builds them, over
shard files that are not there.
"""

from __future__ import annotations

import argparse
import json
import pickle
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mpicube.files.checkpoint import Block, meta, vds  # noqa: E402
from mpicube.files.checkpoint.format import MAIN_FILE  # noqa: E402
from mpicube.files.checkpoint.write import describe_blocks  # noqa: E402
from mpicube.core.config import ModelConfig  # noqa: E402
from mpicube.core.intmath import integer_root  # noqa: E402
from mpicube.parallel.layouts.cube import CubeLayout  # noqa: E402
from mpicube.model.gpt import gpt_params  # noqa: E402


def cube_blocks(cfg: ModelConfig, q: int, rank: int) -> list:
    """The checkpoint blocks of tensor-parallel rank ``rank`` of a q^3 cube
    (parameters, m and v), from the 3-D layout's own ``shard``."""
    i, rest = divmod(rank, q * q)
    j, k = divmod(rest, q)
    cell = SimpleNamespace(q=q, i=i, j=j, k=k, vocab_padded=CubeLayout.pad_to(cfg.vocab_size, q), ij=None, ik=None,
                           head_split=CubeLayout.head_coords(q ** 3, 1, rank)[:2], kv_comm=None)
    cell.first_columns = lambda decl: CubeLayout.first_columns(cell, decl)    # heads over j, as the layout
    zero = np.zeros((), np.float32)
    blocks = []
    for decl in gpt_params(cfg):
        spec = CubeLayout.shard(cell, decl)
        local = np.broadcast_to(zero, spec.local_shape)          # no memory: a view of one zero
        for prefix in ("model", "optimizer/m", "optimizer/v"):
            blocks.append(Block(f"{prefix}/{decl.name}", local, decl.shape, spec.index, spec.writer))
    return blocks


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=512, help="world size, a cube q^3")
    ap.add_argument("--n-layer", type=int, default=32)
    ap.add_argument("--n-head", type=int, default=64)
    ap.add_argument("--n-embd", type=int, default=4096)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--json", action="store_true", help="end with one JSON line of the figures")
    args = ap.parse_args(argv)
    q = integer_root(args.ranks, 3)
    if q is None:
        ap.error(f"--ranks {args.ranks} is not a cube")
    cfg = ModelConfig(vocab_size=256, n_ctx=args.seq_len, n_layer=args.n_layer, n_head=args.n_head,
                      n_embd=args.n_embd)

    print(f"{args.ranks} ranks (q = {q}), n_layer {cfg.n_layer}, n_embd {cfg.n_embd}", flush=True)
    P = args.ranks
    own = np.zeros(P)                    # seconds each rank spends on its own metadata
    outbox = []                          # outbox[src][dst]: pickled entries for owner dst
    shards = []
    for rank in range(P):
        t0 = time.perf_counter()
        entries, to_write = describe_blocks(rank, cube_blocks(cfg, q, rank))
        rel = f"shards/rank_{rank:05d}.h5" if to_write else None
        outbox.append([pickle.dumps((bucket, rel), protocol=pickle.HIGHEST_PROTOCOL)
                       for bucket in meta.route(entries, P)])
        shards.append(rel)
        own[rank] += time.perf_counter() - t0
    sent = sum(len(b) for row in outbox for b in row)
    print(f"described and routed every rank's blocks ({sent / 2**20:.1f} MiB sent in the alltoall)", flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        reports, n_maps = [], 0
        for rank in range(P):
            t0 = time.perf_counter()
            owned = meta.assemble([pickle.loads(outbox[src][rank]) for src in range(P)])
            index = None
            if any(t["pieces"] for t in owned.values()):
                rel = vds.index_rel(rank)
                vds.write_index(tmp / rel, owned)
                vds.verify_index(tmp / rel, owned)
                index = (rel, "0" * 64, (tmp / rel).stat().st_size)
            summary = {name: (t["shape"], t["dtype"], index[0] if t["pieces"] else None,
                              t["scalar"][0][1] if t["scalar"] else None) for name, t in owned.items()}
            n_maps += sum(len(p[3]) for t in owned.values() for p in t["pieces"])
            files = [f for f in ((shards[rank], "0" * 64, 1) if shards[rank] else None, index) if f]
            reports.append(pickle.dumps((None, summary, files), protocol=pickle.HIGHEST_PROTOCOL))
            own[rank] += time.perf_counter() - t0
        t0 = time.perf_counter()
        got = [pickle.loads(r) for r in reports]
        tensors = {name: t for _, s, _ in got for name, t in s.items()}
        files = {rel: (digest, n) for *_, fs in got for rel, digest, n in fs}
        vds.write_main(tmp / MAIN_FILE, 1, {"config": json.dumps(cfg.to_dict())}, tensors, files)
        main_s = time.perf_counter() - t0
        size = (tmp / MAIN_FILE).stat().st_size + sum(p.stat().st_size for p in (tmp / vds.INDEX_DIR).iterdir())
    rank0 = own[0] + main_s
    print(f"tensors {len(tensors)}, virtual mappings {n_maps:,} in {len(files) - sum(map(bool, shards))} index "
          f"files, {size / 2**20:.1f} MiB of metadata")
    print(f"rank 0: its own blocks and tensors {own[0]:.2f} s, checkpoint.h5 {main_s:.2f} s: total {rank0:.2f} s")
    print(f"any rank's own blocks and tensors: mean {own.mean():.2f} s, slowest {own.max():.2f} s "
          f"(rank {int(own.argmax())})")
    figures = {"ranks": P, "tensors": len(tensors), "mappings": n_maps, "rank0_s": rank0, "main_s": main_s,
               "own_mean_s": float(own.mean()), "own_max_s": float(own.max())}
    if args.json:
        print(json.dumps(figures))
    return figures


if __name__ == "__main__":
    main()
