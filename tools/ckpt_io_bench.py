"""Real checkpoint save and load times on a real MPI job.

    mpiexec -n 8  python tools/ckpt_io_bench.py
    mpiexec -n 27 python tools/ckpt_io_bench.py --n-embd 144 --n-head 12
    mpiexec -n 64 python tools/ckpt_io_bench.py --repeat 2

Builds a GPT on the 3-D layout (a q x q x q cube of all the ranks), saves
its parameters and AdamW moments with ``checkpoint.save`` and loads them
back as a resumed run does (every rank opens the checkpoint with the
communicator, hashing its share of the files, then reads its blocks),
``--repeat`` times. Prints, per round, the wall time of the save and the
load (the slowest rank's, between barriers) and the time each phase cost
rank 0. No training; the model starts from its seeded initial values.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mpi4py import MPI  # noqa: E402

from mpicube.files import checkpoint  # noqa: E402
from mpicube.core.config import ModelConfig  # noqa: E402
from mpicube.training.optim import AdamW  # noqa: E402
from mpicube.training.state import load_state, state_blocks  # noqa: E402
from mpicube.parallel.planning import resolve  # noqa: E402
from mpicube.training.train import build_parts  # noqa: E402


def timed(comm, fn):
    """(result, seconds of the slowest rank) of a collective ``fn``."""
    comm.Barrier()
    t0 = time.perf_counter()
    out = fn()
    comm.Barrier()
    return out, comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--n-head", type=int, default=12)
    ap.add_argument("--n-embd", type=int, default=144)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = ap.parse_args(argv)
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    q = round(size ** (1 / 3))
    cfg = ModelConfig(vocab_size=256, n_ctx=64, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)
    parts = build_parts(resolve("3d", cfg, q * q, size), comm)
    opt = AdamW(parts.store)
    base = comm.bcast(args.dir or (tempfile.mkdtemp(prefix="ckpt-io-") if rank == 0 else None))
    rounds = []
    for step in range(1, args.repeat + 1):
        blocks = state_blocks(parts.store, opt, parts.layout.axes.dp.rank)
        path, save_s = timed(comm, lambda: checkpoint.save(base, step, blocks, {"config": cfg.to_dict()}, comm=comm,
                                                             keep=1))

        def load():
            with checkpoint.open_checkpoint(path, comm=comm) as ck:
                load_state(ck, parts.store, opt, comm=comm)
        _, load_s = timed(comm, load)
        rounds.append({"save_s": save_s, "load_s": load_s})
    if rank == 0:
        n_bytes = sum(f.stat().st_size for f in Path(path).rglob("*.h5"))
        print(f"{size} ranks (3d, q = {q}), {cfg.n_params():,} parameters, checkpoint {n_bytes / 2**20:.1f} MiB "
              f"in {len(list((Path(path) / 'shards').iterdir()))} shards")
        for i, r in enumerate(rounds, 1):
            print(f"round {i}: save {r['save_s']:.2f} s, load {r['load_s']:.2f} s")
        best = {k: min(r[k] for r in rounds) for k in ("save_s", "load_s")}
        print(json.dumps({"ranks": size, "params": cfg.n_params(), "bytes": n_bytes, **best}))
        if args.dir is None:
            import shutil

            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
