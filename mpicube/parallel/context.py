"""Context parallelism (``--cp C``): every sequence split over C ranks,
attention by a ring that passes K and V.

Load balance. A sequence of T positions is cut into 2C chunks of c = T/(2C);
cp rank r holds chunks r and 2C-1-r (``local_positions``). Under the causal
mask the work of a query chunk grows with its index, so an early chunk and
its mirror together make the same work on every rank: rank r's two query
chunks see r + (2C-1-r) + 1 = 2C key chunks (counting the two diagonal ones
as halves), whatever r.

The ring. Forward: each rank starts with its own K and V and, at each of C
steps, computes its two query chunks against the two key chunks it holds,
while the pair travels on to rank r+1 and the next arrives from r-1
(``Comm.ishift``, nonblocking: the transfer overlaps the block work); C-1
shifts in all. A key chunk after a query chunk is skipped, a chunk against
itself is the diagonal case of blockwise attention, an earlier chunk is
computed whole. Each key block is folded into the query block's running
(max, sum, output) by the online softmax of ``ops.attention_blocks``,
which is the log-sum-exp merge of the partial attention of each arriving
chunk with what came before. Forward keeps q, k, v, y and the per-row
log-sum-exp, as serial blockwise attention does. Backward goes round again:
the K/V pair travels with its own dK/dV accumulators; each rank adds its
queries' share into the pair it holds and passes both on; after C shifts of
dK/dV each rank holds its own keys' complete gradients.

Causal positions and dropout masks use global positions (chunk index x c +
offset), so every mask element is the serial run's element at (sequence,
head, query, key).
"""

from __future__ import annotations

import math

import numpy as np

from ..core.errors import ConfigError
from ..device.arrays import array_module
from ..device.precision import compute_dtype, narrow, up
from ..ops import attention_blocks as ab
from .comm import Comm
from .comm_p2p import ishift


def validate(T: int, cp: int, ulysses: int = 1) -> None:
    """T must split into 2R equal chunks (R = cp / ulysses ring steps), and
    a group's T/R positions into ``ulysses`` equal runs: one line naming the
    nearest sequence lengths and the cp sizes that would work."""
    R = cp // ulysses
    if R > 1 and T % (2 * R):
        below, above = T // (2 * R) * 2 * R, (T // (2 * R) + 1) * 2 * R
        sizes = " or ".join(str(v) for v in (below, above) if v > 0)
        if ulysses == 1:
            cps = [c for c in range(1, T // 2 + 1) if T % (2 * c) == 0]
            raise ConfigError(f"--seq-len {T} must be divisible by 2 x --cp {cp} = {2 * cp} (each sequence is cut "
                              f"into 2C chunks): use --seq-len {sizes}, or --cp one of {cps}")
        raise ConfigError(f"--seq-len {T} must be divisible by 2 x (--cp {cp} / --ulysses {ulysses}) = {2 * R} "
                          f"(each sequence is cut into 2 chunks per ring step): use --seq-len {sizes}")
    step = 2 * cp if R > 1 else cp
    if T % step:
        below, above = T // step * step, (T // step + 1) * step
        sizes = " or ".join(str(v) for v in (below, above) if v > 0)
        raise ConfigError(f"--seq-len {T} must be divisible by {step} (the {ulysses} Ulysses ranks of a group each "
                          f"hold an equal run of its positions): use --seq-len {sizes}")


def chunks(cp: int, r: int) -> tuple:
    """The two chunk indices (of 2C) that cp rank r holds."""
    return r, 2 * cp - 1 - r


def ulysses_of(ring) -> int:
    """The Ulysses group size of a cp communicator (``grid.build_layout``
    sets it; 1: the plain ring)."""
    return getattr(ring, "ulysses", 1)


def local_positions(T: int, cp: int, r: int, ulysses: int = 1) -> np.ndarray:
    """(T/cp,) the global positions of cp rank r's rows.

    Ring (``ulysses`` 1): chunk r then chunk 2C-1-r. With Ulysses groups of
    U = ``ulysses`` consecutive cp ranks, group g = r // U plays ring rank g
    of R = cp / U (its positions: chunks g and 2R-1-g of 2R, or all T in
    order when R is 1), and rank u = r % U of the group holds run u of the
    group's positions: the all-to-all before attention puts the group's U
    runs back together in that order."""
    if cp == 1:
        return np.arange(T)
    R = cp // ulysses
    g, u = divmod(r, ulysses)
    if R == 1:
        group = np.arange(T)
    else:
        c = T // (2 * R)
        group = np.concatenate([np.arange(i * c, (i + 1) * c) for i in chunks(R, g)])
    n = len(group) // ulysses
    return group[u * n:(u + 1) * n]


def _pairs(q_chunks, k_chunks, c: int, block: int):
    """(local q slice, local k slice, global q start, global k start) of
    every query block against every key block at or below the diagonal,
    for query chunks ``q_chunks`` and key chunks ``k_chunks`` held in that
    order (c positions each). Blocks are aligned at chunk starts."""
    for qa, qi in enumerate(q_chunks):
        for ka, kj in enumerate(k_chunks):
            if kj > qi:
                continue                                               # the whole key chunk is in the future
            for i0 in range(0, c, block):
                i1 = min(c, i0 + block)
                for j0 in range(0, c if kj < qi else i1, block):
                    j1 = min(c, j0 + block)
                    yield (slice(qa * c + i0, qa * c + i1), slice(ka * c + j0, ka * c + j1),
                           qi * c + i0, kj * c + j0)


def ring_scores(T: int, cp: int, block: int = ab.BLOCK) -> int:
    """Score elements one head of one sequence computes over all cp ranks
    and ring steps (blocks aligned at chunk starts; ``ops.attention_blocks
    .computed_scores`` for cp 1)."""
    if cp == 1:
        return ab.computed_scores(T, block)
    c = T // (2 * cp)
    n = 2 * cp                                                         # chunks: n (n-1)/2 pairs below, n diagonal
    return n * (n - 1) // 2 * c * c + n * ab.computed_scores(c, block)


def _global(mask, q0, k0, rows, cols):
    """The mask block at global positions for local slices ``rows``, ``cols``."""
    if mask is None:
        return None
    return mask(slice(q0, q0 + rows.stop - rows.start), slice(k0, k0 + cols.stop - cols.start))


class RingAttention:
    """Causal attention of this rank's two chunks over the whole sequence,
    with the same ``attention_forward`` / ``attention_backward`` calls as
    ``ops.attention_blocks``: the model uses one or the other."""

    def __init__(self, ring: Comm, block: int = ab.BLOCK):
        self.cp, self.block = ring, block
        self.C, self.r = ring.size, ring.rank
        self.next, self.prev = (self.r + 1) % self.C, (self.r - 1) % self.C

    def attention_forward(self, qkv, n_head, keep_mask=None, keep_prob=1.0):
        """qkv (B, 2c, 3*nh*hd), this rank's chunks -> y (B, 2c, nh*hd).
        ``keep_mask``: None or a callable (global rows, global cols) -> mask block."""
        xp = array_module(qkv)
        B, T_l, _ = qkv.shape
        c = T_l // 2
        q, k, v, hd = ab._split(qkv, n_head)                           # (B, nh, 2c, hd)
        scale = 1.0 / math.sqrt(hd)
        q = q * q.dtype.type(scale)                                    # (B, nh, 2c, hd)
        kv = xp.stack([k, v])                                          # (2, B, nh, 2c, hd) travels the ring
        cd = compute_dtype(qkv.dtype)
        m = xp.full((B, n_head, T_l, 1), -xp.inf, dtype=cd)            # running max
        l = xp.zeros((B, n_head, T_l, 1), dtype=cd)                    # running sum
        acc = xp.zeros((B, n_head, T_l, hd), dtype=cd)                 # running output
        mine = chunks(self.C, self.r)
        for s in range(self.C):
            pending = ishift(self.cp, kv, self.next, self.prev) if s < self.C - 1 else None
            held = chunks(self.C, (self.r - s) % self.C)
            for rows, cols, q0, k0 in _pairs(mine, held, c, self.block):
                state = [m[:, :, rows], l[:, :, rows], acc[:, :, rows]]
                ab.pair_forward(state, q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols], q0, k0,
                                _global(keep_mask, q0, k0, rows, cols), keep_prob, qkv.dtype)
                m[:, :, rows] = state[0]                               # l and acc were updated in place
            if pending is not None:
                kv = pending.wait()
        acc /= l
        y = xp.empty((B, T_l, n_head, hd), dtype=qkv.dtype)            # (B, 2c, nh, hd)
        y.transpose(0, 2, 1, 3)[...] = narrow(acc, qkv.dtype)
        lse = (m + xp.log(l))[..., 0]                                  # (B, nh, 2c)
        y = y.reshape(B, T_l, n_head * hd)
        return y, (q, k, v, y, lse, keep_mask, keep_prob, scale)

    def attention_backward(self, dy, cache):
        """dy (B, 2c, nh*hd) -> dqkv (B, 2c, 3*nh*hd); dK and dV of each
        key chunk travel with it and come home after C shifts."""
        xp = array_module(dy)
        q, k, v, y, lse, mask, keep_prob, scale = cache
        B, nh, T_l, hd = q.shape
        c = T_l // 2
        cd = compute_dtype(dy.dtype)
        dy4 = dy.reshape(B, T_l, nh, hd).transpose(0, 2, 1, 3)         # (B, nh, 2c, hd)
        y4 = y.reshape(B, T_l, nh, hd).transpose(0, 2, 1, 3)
        d = (up(dy4) * up(y4)).sum(-1, keepdims=True)                  # (B, nh, 2c, 1)
        lse4 = lse[..., None]
        kv = xp.stack([k, v])                                          # (2, B, nh, 2c, hd)
        dkv = xp.zeros((2, B, nh, T_l, hd), dtype=cd)                  # travels with kv
        dq = xp.zeros((B, nh, T_l, hd), dtype=cd)
        mine = chunks(self.C, self.r)
        for s in range(self.C):
            pending = ishift(self.cp, kv, self.next, self.prev) if s < self.C - 1 else None
            held = chunks(self.C, (self.r - s) % self.C)
            for rows, cols, q0, k0 in _pairs(mine, held, c, self.block):
                g_q, g_k, g_v = ab.pair_backward(q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols],
                                                 dy4[:, :, rows], lse4[:, :, rows], d[:, :, rows], q0, k0,
                                                 _global(mask, q0, k0, rows, cols), keep_prob, dy.dtype)
                dq[:, :, rows] += g_q
                dkv[0][:, :, cols] += g_k
                dkv[1][:, :, cols] += g_v
            if self.C > 1:
                dkv = ishift(self.cp, dkv, self.next, self.prev).wait()  # to the rank that holds this kv next
            if pending is not None:
                kv = pending.wait()
        dq *= scale
        dqkv = xp.empty((B, T_l, 3, nh, hd), dtype=dy.dtype)           # the layout of qkv's columns
        dqkv[:, :, 0] = narrow(dq, dy.dtype).transpose(0, 2, 1, 3)
        dqkv[:, :, 1:] = narrow(dkv, dy.dtype).transpose(1, 3, 0, 2, 4)
        return dqkv.reshape(B, T_l, 3 * nh * hd)

