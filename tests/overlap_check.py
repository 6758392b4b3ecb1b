"""Run under mpiexec: a layout with its overlap on (the default) against the
same layout with MPICUBE_OVERLAP=0, in float64, bit for bit.

Both are built in this one process (the switch is read when a layout is
built) from the same seed, with dropout, and trained three steps on the same
batches: the losses, logits, gradient norms, every gradient and every
parameter must be equal (==, not close), and so must the communication
counted per axis (elements, bytes, messages): overlap reorders when data
moves, never what moves or what is computed. tests/test_layouts.py checks
the overlapped path against serial; this one carries that check over to the
blocking path.

With a third argument ``moe`` the same check follows for a mixture of
experts (4 experts, top 2, a capacity) on the serial layout with the
experts split over every rank (dp = ep = world): the own rows computed
while the others' travel (model/moe_experts.py) against the blocking
path.

Usage: python -m mpi4py tests/overlap_check.py LAYOUT DEPTH [moe]
"""

import sys

import numpy as np
from mpi4py import MPI

from parallel_check import LLAMA, build
from mpicube.core.config import ModelConfig
from mpicube.training.accum import forward_backward
from mpicube.training.step import make_step


def built(overlap: str, layout_name, cfg, batch, depth, dp=1, ep=1):
    parts = build(layout_name, MPI.COMM_WORLD, cfg, batch, dp, depth, 0.1, settings={"overlap": overlap != "0"},
                  ep=ep)
    assert parts.layout.overlap == (overlap != "0")
    return parts, make_step(parts.store, parts.layout.axes, weight_decay=0.1)


def same(name, a, b):
    a, b = np.asarray(a), np.asarray(b)
    if not (a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a, b)):
        diff = np.abs(a.astype(np.float64) - b.astype(np.float64)).max() if a.shape == b.shape else "shape"
        raise AssertionError(f"rank {MPI.COMM_WORLD.rank}: {name} differs with overlap off (max {diff})")


def compare(layout_name, cfg, depth, dp=1, ep=1, batch=72) -> float:
    """Three steps with overlap off and on: equal bit for bit, with the
    same traffic. Returns the elements rank 0 moved in the last step."""
    rng = np.random.default_rng(5)
    batches = [(rng.integers(0, 61, (batch, cfg.n_ctx)), rng.integers(0, 61, (batch, cfg.n_ctx))) for _ in range(3)]
    runs = [built(flag, layout_name, cfg, batch, depth, dp, ep) for flag in ("0", "1")]
    for step, (x, y) in enumerate(batches, start=1):
        seen = []
        for parts, opt in runs:
            parts.store.zero_grad()
            parts.counters.reset()
            loss = forward_backward(parts, x, y, step, 1.0)
            logits = parts.layout.backend.to_host(parts.model.logits).copy()
            opt.sync()
            norm = opt.grad_norm()
            grads = {name: parts.store.grad[name].copy() for name in parts.store.grad}
            traffic = {axis: (c, parts.counters.bytes[axis], parts.counters.msgs[axis])
                       for axis, c in parts.counters.elems.items()}
            opt.step(1e-2, grad_scale=min(1.0, 1.0 / norm))
            seen.append((loss, logits, norm, grads, traffic))
        (l0, g0_logits, n0, g0, t0), (l1, g1_logits, n1, g1, t1) = seen
        same(f"step {step} loss", l0, l1)
        same(f"step {step} logits", g0_logits, g1_logits)
        same(f"step {step} grad norm", n0, n1)
        for name in g0:
            same(f"step {step} grad {name}", g0[name], g1[name])
        if t0 != t1:
            raise AssertionError(f"rank {MPI.COMM_WORLD.rank}: step {step} traffic off {t0} != on {t1}")
    (off, _), (on, _) = runs
    for name in off.store.data:
        same(f"param {name} after 3 steps", off.store.data[name], on.store.data[name])
    if ep > 1:
        assert t1["ep"][0] > 0, "no rows went over the ep axis"
    return float(sum(c for c, _, _ in t1.values()))


def main():
    layout_name, depth = sys.argv[1], int(sys.argv[2])
    cfg = ModelConfig(vocab_size=61, n_ctx=8, n_layer=2, n_head=12, n_embd=36)
    moved = compare(layout_name, cfg, depth)
    MPI.COMM_WORLD.Barrier()
    world = MPI.COMM_WORLD.size
    if MPI.COMM_WORLD.rank == 0:
        print(f"OK overlap {layout_name} world={world} depth={depth}: bit-identical with "
              f"MPICUBE_OVERLAP=0, same traffic ({moved:.0f} elements on rank 0)")
    if sys.argv[3:] == ["moe"]:
        moe = ModelConfig(vocab_size=61, n_ctx=8, n_layer=2, **LLAMA, n_experts=4, top_k=2, capacity_factor=0.8,
                          router_aux_loss_coef=0.05, router_z_loss_coef=0.01)
        moved = compare("serial", moe, 1, dp=world, ep=world, batch=8)
        MPI.COMM_WORLD.Barrier()
        if MPI.COMM_WORLD.rank == 0:
            print(f"OK overlap moe serial world={world} dp={world} ep={world}: bit-identical with "
                  f"MPICUBE_OVERLAP=0, same traffic ({moved:.0f} elements on rank 0)")


if __name__ == "__main__":
    main()
