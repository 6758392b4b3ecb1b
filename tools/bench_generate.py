"""Time per generated token against the prompt length, with and without
the key/value cache (issue 11's target: flat with the cache).

    python tools/bench_generate.py                          # GPT-2 small's shape, random weights
    mpiexec -n 8 python tools/bench_generate.py --layout 3d --n-layer 4 --n-embd 256 --n-head 8

For each prompt length P it generates --new-tokens tokens greedily and
prints the median time per new token with the cache (one position's
forward each) and without it (the whole prefix each time), and the
prefill time. The weights come from mpicube's seeded initialisation, so
no model file is needed; a file's weights would time the same.
"""

from __future__ import annotations

import argparse
import json

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n-layer", type=int, default=12)
    ap.add_argument("--n-head", type=int, default=12)
    ap.add_argument("--n-embd", type=int, default=768)
    ap.add_argument("--n-ctx", type=int, default=1024)
    ap.add_argument("--vocab-size", type=int, default=50257)
    ap.add_argument("--layout", default="auto")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prompt-lengths", default="16,128,512,1000")
    ap.add_argument("--new-tokens", type=int, default=16, help="timed tokens per prompt length, cached")
    ap.add_argument("--recompute-tokens", type=int, default=3, help="the same without the cache (0 = skip)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    from mpi4py import MPI

    from mpicube.core.config import ModelConfig
    from mpicube.cli.generate import Generator, Sampler, generation_batch
    from mpicube.parallel.planning import resolve
    from mpicube.training.parts import Numerics
    from mpicube.training.train import build_parts

    world = MPI.COMM_WORLD
    cfg = ModelConfig(vocab_size=args.vocab_size, n_ctx=args.n_ctx, n_layer=args.n_layer, n_head=args.n_head,
                      n_embd=args.n_embd)
    batch = generation_batch(args.layout, cfg, world.Get_size(), 1, 1)
    parts = build_parts(resolve(args.layout, cfg, batch, world.Get_size()), world, Numerics(args.dtype), seed=0)
    gen = Generator(parts)
    rng = np.random.default_rng(0)
    rows = []
    for length in (int(p) for p in args.prompt_lengths.split(",")):
        prompt = [int(t) for t in rng.integers(0, cfg.vocab_size, length)]
        new = min(args.new_tokens, cfg.n_ctx - length)
        cached = gen.run(prompt, new + 1, Sampler(0.0, 0, 0), cache=True)
        row = {"prompt": length, "cached_ms": 1e3 * float(np.median(cached["step_times_s"])),
               "prefill_ms": 1e3 * cached["prefill_s"]}
        if args.recompute_tokens:
            full = gen.run(prompt, min(args.recompute_tokens, new) + 1, Sampler(0.0, 0, 0), cache=False)
            row["recompute_ms"] = 1e3 * float(np.median(full["step_times_s"]))
        rows.append(row)
    if world.Get_rank() == 0:
        layout = parts.layout.describe()
        print(f"model: n_layer {cfg.n_layer}, n_head {cfg.n_head}, n_embd {cfg.n_embd}, n_ctx {cfg.n_ctx}, "
              f"vocab {cfg.vocab_size}; {layout['layout']} on {world.Get_size()} rank(s), {args.dtype}")
        print(f"{'prompt':>7s} {'cached ms/token':>16s} {'recompute ms/token':>19s} {'prefill ms':>11s}")
        for r in rows:
            recompute = f"{r['recompute_ms']:19.1f}" if "recompute_ms" in r else f"{'-':>19s}"
            print(f"{r['prompt']:7d} {r['cached_ms']:16.2f} {recompute} {r['prefill_ms']:11.1f}")
        if args.json:
            print(json.dumps({"layout": layout, "ranks": world.Get_size(), "rows": rows}))


if __name__ == "__main__":
    main()
