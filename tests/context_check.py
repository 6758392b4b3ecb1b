"""Ring attention (mpicube.parallel.context.RingAttention) on a real cp
ring against serial blockwise attention over the whole sequence, float64,
with a dropout mask, blocks smaller than a chunk (so the diagonal chunk has
blocks above its own diagonal skipped too): every rank's outputs and
q/k/v gradients equal the serial ones at its global positions to 1e-12,
and the ring's measured messages and elements equal the cost model's count
for one layer.

    mpiexec -n C python -m mpi4py tests/context_check.py
"""

import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mpicube.device.backend import make_backend  # noqa: E402
from mpicube.ops import attention_blocks as ab  # noqa: E402
from mpicube.parallel.comm import Comm, Counters  # noqa: E402
from mpicube.parallel.context import RingAttention, local_positions  # noqa: E402


def main():
    world = MPI.COMM_WORLD
    C, r = world.size, world.rank
    B, nh, hd, T, block = 2, 3, 4, 16 * C, 4                        # chunks of 8: two blocks each
    rng = np.random.default_rng(5)
    qkv = rng.standard_normal((B, T, 3 * nh * hd))                  # (B, T, 3 C) the whole sequence, everywhere
    dy = rng.standard_normal((B, T, nh * hd))
    keep = (rng.random((B, nh, T, T)) > 0.25).astype(float)         # (B, nh, T, T) at global indices
    mask = lambda rows, cols: keep[:, :, rows, cols]                # noqa: E731
    y0, cache0 = ab.attention_forward(qkv, nh, mask, 0.75, block=block)
    g0 = ab.attention_backward(dy, cache0)

    counters = Counters()
    ring = RingAttention(Comm(world, "cp", make_backend("cpu", "float64"), counters), block=block)
    pos = local_positions(T, C, r)                                  # (T/C,)
    y, cache = ring.attention_forward(np.ascontiguousarray(qkv[:, pos]), nh, mask, 0.75)
    g = ring.attention_backward(np.ascontiguousarray(dy[:, pos]), cache)
    for name, got, want in (("y", y, y0[:, pos]), ("dqkv", g, g0[:, pos])):
        err = np.abs(got - want).max() / np.abs(want).max()
        assert err < 1e-12, f"rank {r}: {name} differs from serial by {err:.2e}"
    kv = 2 * B * (T // C) * nh * hd                                  # one K/V (or dK/dV) pair
    want = ((2 * (C - 1) + C) * kv, 2 * (C - 1) + C)                 # forward C-1, backward C-1 + C shifts
    got = (counters.elems.get("cp", 0), counters.msgs.get("cp", 0))
    assert got == want, f"rank {r}: ring moved {got} (elements, messages), expected {want}"
    world.Barrier()
    if r == 0:
        print(f"OK ring attention cp={C} T={T} block={block}")


if __name__ == "__main__":
    main()
