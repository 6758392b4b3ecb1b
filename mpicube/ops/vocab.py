"""Local ops over the vocabulary: softmax cross-entropy over a (possibly
split) vocabulary, and the token embedding's lookup and scatter-add. Part of
``mpicube.ops`` (re-exported there), in a module of their own for length;
the conventions of ops.py apply (16-bit inputs computed in float32, plain
array code unless a kernel module applies, nothing copied to the host).
"""

from __future__ import annotations

import numpy as np

from ..device import cuda_kernels
from ..device.kernels import kernels_for
from ..device.arrays import array_module, identity
from ..device.precision import is_half, narrow, up


# --- softmax cross-entropy over a (possibly split) vocabulary -----------------
def cross_entropy_forward(logits, targets, vocab_start, vocab_size, allmax=identity, allsum=identity):
    """logits (n, V) hold vocabulary columns [vocab_start, vocab_start + V) of
    a vocabulary of ``vocab_size`` real entries (columns past it are padding
    and masked out). targets (n,) global ids. Returns per-row loss (n,).
    Three reductions over the vocabulary split: max, sum of exp, target logit."""
    if is_half(logits.dtype):              # softmax statistics in float32; probabilities kept in 16 bits
        loss, (probs, mine, t_clip) = cross_entropy_forward(up(logits), targets, vocab_start, vocab_size,
                                                             allmax, allsum)
        return loss, (narrow(probs, logits.dtype), mine, t_clip)
    xp = array_module(logits)
    n, V = logits.shape
    n_real = max(0, min(V, vocab_size - vocab_start))
    if cuda_kernels.active(logits):
        row_max = xp.empty(n, dtype=logits.dtype)                     # (n,)
        cuda_kernels.masked_row_max(logits, n_real, row_max)
        row_max = allmax(row_max)
        probs, sum_exp = xp.empty_like(logits), xp.empty(n, dtype=logits.dtype)   # (n, V), (n,)
        cuda_kernels.exp_rows(logits, row_max, n_real, probs, sum_exp)
    else:
        probs = logits.copy()                                         # (n, V) scores, then exp
        if n_real < V:
            probs[:, n_real:] = -xp.inf
        row_max = allmax(probs.max(-1))                               # (n,)
        probs -= row_max[:, None]
        xp.exp(probs, out=probs)
        sum_exp = probs.sum(-1)                                       # (n,)
    sum_exp = allsum(sum_exp)
    probs /= sum_exp[:, None]
    local_t = targets - vocab_start                                   # (n,)
    mine = (local_t >= 0) & (local_t < V)                             # (n,)
    rows = xp.arange(n)
    t_clip = xp.clip(local_t, 0, V - 1)
    target_logit = allsum(xp.where(mine, logits[rows, t_clip], 0.0))  # (n,)
    loss = xp.log(sum_exp) + row_max - target_logit                   # (n,)
    return loss, (probs, mine, t_clip)


def cross_entropy_backward(scale, cache):
    """d(scale * sum(loss))/dlogits (n, V); no communication needed. The
    target column is lowered on every row, by 0 where another rank holds
    the target, instead of selecting rows with a boolean mask (whose size
    a GPU would have to copy to the host)."""
    xp = array_module(cache[0])
    probs, mine, t_clip = cache
    if is_half(probs.dtype):
        return narrow(cross_entropy_backward(scale, (up(probs), mine, t_clip)), probs.dtype)
    dlogits = probs * scale                                           # (n, V)
    rows = xp.arange(probs.shape[0])
    dlogits[rows, t_clip] -= (mine * scale).astype(dlogits.dtype)
    return dlogits


# --- token embedding lookup over a vocabulary block ---------------------------
def embedding_forward(ids, weight, vocab_start):
    """ids (B, T) global -> (B, T, C): rows of ``weight`` (V, C), which holds
    vocabulary [vocab_start, vocab_start + V); ids outside give zeros (another
    rank adds them). The cache is the local row of each id, out-of-range included."""
    xp = array_module(weight)
    V = weight.shape[0]
    local = ids - vocab_start                                         # (B, T)
    mine = (local >= 0) & (local < V)                                 # (B, T)
    out = weight[xp.clip(local, 0, V - 1)]                           # (B, T, C)
    out *= mine[..., None]           # always: asking whether all ids are ours would sync a GPU
    return out, local


def embedding_backward(dy, local, dweight):
    """Adds dy (B, T, C) into the rows of dweight (V, C) its ids selected."""
    scatter_add_rows(dweight, local.reshape(-1), dy.reshape(-1, dy.shape[-1]))


def scatter_add_rows(target, rows, values):
    """target (V, C)[rows[i]] += values[i] (n, C) for every rows[i] in [0, V);
    other rows are skipped. Repeated rows are summed in a fixed order, never
    with atomics, so that a run repeats bit for bit on any device: NumPy's
    add.at and the fused kernels add them in index order; on a GPU without
    kernels a sort-based segmented sum does it (CuPy's scatter_add uses
    atomics, and a one-hot GEMM would cost 2 V n C FLOPs)."""
    xp = array_module(target)
    values = up(values)                                               # (n, C) 16-bit rows added in float32
    k = kernels_for(values, target)
    if k is not None:
        k.scatter_add_rows(target, xp.ascontiguousarray(rows), values)
    elif xp is np:
        keep = (rows >= 0) & (rows < target.shape[0])                 # (n,)
        np.add.at(target, rows[keep], values[keep])
    else:
        scatter_add_sorted(target, rows, values)


def scatter_add_sorted(target, rows, values, chunk_elems: int = 1 << 22):
    """scatter_add_rows by sorting: the rows are ordered by (row, position),
    each run of one row is summed by a segmented inclusive scan in float64
    (ceil(log2 n) shifted adds, each confined to its run, so a sum never
    mixes rows and its rounding error grows with log n, not with the
    magnitude of earlier rows as a cumulative-sum difference would), and
    every member of a run writes target[row] + the run's total, so the
    repeated writes of one row all store the same value and their order
    does not matter. Work is O(n C log n), independent of V; no boolean
    selection, so nothing waits for the host. Sorted rows are taken
    ``chunk_elems // C`` at a time (a run cut by a chunk boundary is added
    in two parts, always the same two), bounding the float64 scratch."""
    xp = array_module(target)
    V, n, C = target.shape[0], rows.shape[0], target.shape[1]
    if n == 0:
        return
    rows = rows.reshape(-1).astype(xp.int64, copy=False)
    mine = (rows >= 0) & (rows < V)                                   # (n,)
    # rows of other ranks join the smallest row of ours with zero values (no
    # compaction, whose size the host would have to learn)
    home = xp.minimum(xp.where(mine, rows, V).min(), V - 1)          # () on the device
    key = xp.where(mine, rows, home)                                  # (n,) all in [0, V)
    order = xp.argsort(key * n + xp.arange(n, dtype=xp.int64))        # (n,) distinct keys: the order is fixed
    key = key[order]                                                  # (n,) sorted
    step = max(1, chunk_elems // max(1, C))
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        pick = order[lo:hi]
        run = key[lo:hi]                                              # (m,)
        acc = xp.where(mine[pick][:, None], values[pick], 0).astype(xp.float64)   # (m, C)
        shift = 1
        while shift < hi - lo:
            same = (run[shift:] == run[:-shift])[:, None]             # (m - shift, 1) same row
            acc[shift:] += xp.where(same, acc[:-shift], 0.0)          # the right side is built first
            shift *= 2
        last = xp.searchsorted(run, run, side="right") - 1            # (m,) each run's last member
        total = acc[last]                                             # (m, C) the run's sum, on every member
        target[run] = (target[run] + total).astype(target.dtype)      # equal values for equal rows
