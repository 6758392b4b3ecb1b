"""Run with tests/fake_gpu first on PYTHONPATH (tests/test_gpu_ops.py does):
the embedding backward and the dropout masks on the GPU array path, against
the CPU path, with their scratch memory measured (tracemalloc sees the
stand-in's NumPy memory, as it would see nothing on a real GPU).

- scatter_add_rows (the sorted segmented sum) equals NumPy's add.at to
  1e-12 in float64 and 1e-5 in float32 (the CPU adds a
  repeated row's terms one by one in float32, the GPU sums them in float64), repeats bit for bit, syncs nothing,
  and its scratch memory does not grow with the vocabulary (the one-hot
  GEMM it replaced built a V-by-n matrix a chunk at a time: 2 V n C FLOPs);
- keep_mask from an rng.BlockIndex equals the hash of the materialised
  global indices (the masks before BlockIndex, so trajectories are
  unchanged) bit for bit, on the device and the host, and its scratch stays
  far below the uint64 counters of the mask's size.

Prints one JSON line of figures; any failed check raises.
"""

import json
import tracemalloc

import cupy
import numpy as np

from mpicube import ops
from mpicube.ops import rng
from mpicube.ops.vocab import scatter_add_rows


def peak_bytes(func) -> int:
    """Peak traced bytes allocated while ``func`` runs, beyond what it started with."""
    tracemalloc.start()
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    func()
    peak = tracemalloc.get_traced_memory()[1] - base
    tracemalloc.stop()
    return peak


def embedding_backward(figures):
    r = np.random.default_rng(5)
    for dtype, tol in ((np.float64, 1e-12), (np.float32, 1e-5)):
        V, n, C = 97, 3000, 24
        rows = r.integers(-20, V + 20, n)
        rows[:400] = 7                                               # a frequent token
        values, start = r.standard_normal((n, C)).astype(dtype), r.standard_normal((V, C)).astype(dtype)
        want = start.copy()
        scatter_add_rows(want, rows, values)                        # the CPU path: np.add.at
        got = []
        for _ in range(2):
            target = cupy.asarray(start)
            d_rows, d_values = cupy.asarray(rows), cupy.asarray(values)
            cupy._stand_in.reset_transfers()
            scatter_add_rows(target, d_rows, d_values)
            moved = {k: v for k, v in cupy._stand_in.transfers().items() if v}
            assert not moved, f"the segmented sum copied or synced: {moved}"
            got.append(cupy.asnumpy(target))
        err = np.abs(got[0] - want).max() / np.abs(want).max()
        assert err <= tol, f"{np.dtype(dtype).name}: GPU embedding gradient differs from CPU by {err:.2e}"
        assert np.array_equal(got[0].view(np.uint8), got[1].view(np.uint8)), "not bit for bit on a rerun"
        figures[f"embedding_rel_err_{np.dtype(dtype).name}"] = float(err)
    n, C = 512, 4
    rows = cupy.asarray(r.integers(0, 50, n))
    values = cupy.asarray(r.standard_normal((n, C)))
    scratch = {}
    for V in (64, 1 << 20):                                          # the vocabulary grows 16,000 times
        target = cupy.zeros((V, C))
        scratch[V] = peak_bytes(lambda: scatter_add_rows(target, rows, values))
    figures["embedding_scratch_bytes"] = scratch
    assert scratch[1 << 20] <= 2 * scratch[64] + 65536, f"scratch grows with the vocabulary: {scratch}"


def dropout(figures):
    key = rng.make_key(11, "dropout", 3, "h.1.attn")
    shape = (8, 12, 64, 64)                                        # the global (B, nh, T, T)
    index = (np.arange(2, 8), np.arange(3, 12, 2), np.arange(64), np.arange(64))
    want = (rng.uniform(key, rng.flat_index(shape, index)) >= 0.1).astype(np.float32)   # (6, 5, 64, 64)
    for xp, put, get in ((np, np.asarray, np.asarray), (cupy, cupy.asarray, cupy.asnumpy)):
        block = rng.block_index(shape, tuple(put(ix) for ix in index), xp)
        for chunk in (1 << 20, 1000):            # whole; 15 rows of T at a time inside each head
            got = get(ops.keep_mask(key, block, 0.1, np.float32, chunk_elems=chunk))
            assert np.array_equal(got, want), f"{xp.__name__} chunk {chunk}: the mask changed"
        got = get(ops.keep_mask(key, put(rng.flat_index(shape, index)), 0.1, np.float32))
        assert np.array_equal(got, want), f"{xp.__name__}: the mask of a counter array changed"
        scratch = peak_bytes(lambda: ops.keep_mask(key, block, 0.1, np.float32, chunk_elems=1 << 12))
        counters = want.size * 8                                       # a uint64 per element
        assert scratch - want.nbytes <= counters // 4, f"{xp.__name__}: scratch {scratch} B for {counters} B counters"
        figures[f"dropout_scratch_bytes_{xp.__name__}"] = scratch - want.nbytes
    figures["dropout_counter_bytes_avoided"] = counters


if __name__ == "__main__":
    figures = {}
    embedding_backward(figures)
    dropout(figures)
    print(json.dumps(figures))
