"""Run on CI's CuPy stand-in under mpiexec: pinned staging buffers are
allocated in the first step and reused afterwards.

Pinned host memory is slow to allocate, and a step repeats the same
collectives with the same shapes, so a well-behaved staging pool stops
allocating after the first step. Counts calls to ``cupyx.empty_pinned``
(wrapped here, in the test) per step and prints them as JSON from rank 0.

Usage: mpiexec -n 2 python tests/gpu_staging_check.py LAYOUT [DTYPE]
(DTYPE float16: the 16-bit wire sums' all-to-all and gather buffers too)
"""

import json
import sys

import cupyx
import numpy as np
from mpi4py import MPI

from mpicube.core.config import ModelConfig
from mpicube.training.optim import AdamW
from mpicube.parallel.gradients import global_grad_norm, sync_gradients
from mpicube.parallel.planning import resolve
from mpicube.training.parts import Numerics
from mpicube.training.train import build_parts

calls = [0]
_empty_pinned = cupyx.empty_pinned


def counting_empty_pinned(*args, **kwargs):
    calls[0] += 1
    return _empty_pinned(*args, **kwargs)


cupyx.empty_pinned = counting_empty_pinned


def main(layout_name: str, dtype: str = "float32") -> None:
    cfg = ModelConfig(vocab_size=61, n_ctx=8, n_layer=2, n_head=4, n_embd=16)
    parts = build_parts(resolve(layout_name, cfg, 4, MPI.COMM_WORLD.Get_size()), MPI.COMM_WORLD, Numerics(dtype, "gpu"),
                        seed=1, dropout=0.1)
    opt = AdamW(parts.store)
    tokens = np.random.default_rng(0).integers(0, 61, (4, 9))
    x, y = tokens[parts.rows, :-1], tokens[parts.rows, 1:]                 # (B_dp, T)
    per_step = []
    for step in range(1, 5):
        parts.store.zero_grad()
        parts.model.forward(x, y, step=step)
        parts.model.backward()
        sync_gradients(parts.store, parts.layout.axes.dp)
        norm = global_grad_norm(parts.store, parts.layout.axes.tp)
        opt.step(1e-3, min(1.0, 1.0 / norm))
        per_step.append(calls[0])
    if MPI.COMM_WORLD.rank == 0:
        print(json.dumps({"pinned_allocations_after_step": per_step}))


if __name__ == "__main__":
    main(*sys.argv[1:3])
