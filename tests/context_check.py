"""Ring attention (mpicube.parallel.context.RingAttention), Ulysses
(mpicube.parallel.ulysses.UlyssesAttention over all C ranks) and the
hybrid (Ulysses groups of 2, a ring over the C/2 groups) on real cp ranks
against serial blockwise attention over the whole sequence, float64,
with a dropout mask, blocks smaller than a chunk (so the diagonal chunk has
blocks above its own diagonal skipped too): every rank's outputs and
q/k/v gradients equal the serial ones at its global positions to 1e-12,
and the ring's and the all-to-alls' measured messages and elements equal
the cost model's count for one layer.

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
from mpicube.parallel.ulysses import UlyssesAttention  # noqa: E402


def main():
    world = MPI.COMM_WORLD
    C, r = world.size, world.rank
    B, nh, hd, T, block = 2, 4, 4, 16 * C, 4                        # chunks of 8: two blocks each
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
    for U in (C, 2):                                                # Ulysses over all C; hybrid: groups of 2
        check_ulysses(world, U, (B, nh, hd, T, block), qkv, dy, mask, (y0, g0))


def check_ulysses(world, U, sizes, qkv, dy, mask, serial):
    """Ulysses groups of U consecutive ranks, a ring over the C/U groups:
    outputs and gradients equal serial's at this rank's positions, and
    each axis moved what the cost model says."""
    B, nh, hd, T, block = sizes
    C, r = world.size, world.rank
    R, nu = C // U, nh // U
    counters = Counters()
    cp = Comm(world, "cpall", make_backend("cpu", "float64"), counters)
    group, ring = cp.split("ulysses", r // U, r % U), cp.split("cp", r % U, r // U)
    op = UlyssesAttention(group, ring, block=block)
    pos = local_positions(T, C, r, U)                               # (T/C,)
    y, cache = op.attention_forward(np.ascontiguousarray(qkv[:, pos]), nh, mask, 0.75)
    g = op.attention_backward(np.ascontiguousarray(dy[:, pos]), cache)
    for name, got, want in (("y", y, serial[0][:, pos]), ("dqkv", g, serial[1][:, pos])):
        err = np.abs(got - want).max() / np.abs(want).max()
        assert err < 1e-12, f"rank {r} U={U}: {name} differs from serial by {err:.2e}"
    t = T // C                                                       # positions a rank holds
    a2a = (U - 1) * B * t * nu * hd * (3 + 1 + 1 + 3)                # qkv and y forward, dy and dqkv backward
    kv = 2 * B * (T // R) * nu * hd                                  # the ring's K/V pair: the group's positions
    want = {"ulysses": (a2a, 4 * (U - 1)), "cp": ((2 * (R - 1) + R) * kv if R > 1 else 0,
                                                  2 * (R - 1) + R if R > 1 else 0)}
    got = {axis: (counters.elems.get(axis, 0), counters.msgs.get(axis, 0)) for axis in want}
    assert got == want, f"rank {r} U={U}: moved {got} (elements, messages), expected {want}"
    world.Barrier()
    if r == 0:
        print(f"OK ulysses {U} x ring {R} T={T} block={block}")


if __name__ == "__main__":
    main()
