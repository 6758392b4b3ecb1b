"""A counter-based random generator: values are a pure function of
(key, global element index).

This is what makes every layout start from the same model and draw the same
dropout masks (docs/design.md section 2): a rank evaluates the generator only at the
global indices of the block it owns, so no rank ever materialises a whole
tensor and no sequential stream has to be replayed or split.

The mixer is the SplitMix64 finaliser, applied to ``index * golden + key``;
it is cheap, vectorises in NumPy's wrapping uint64 arithmetic, and passes the
usual statistical batteries for this use.

``uniform``, ``flat_index`` and ``BlockIndex`` (a block's flat indices kept
as one vector per dimension, so that a dropout mask never needs a uint64
array of its own size) work on NumPy or CuPy arrays alike: uint64
multiplication, xor and shifts wrap the same way on both, and the float64
conversion of a 53-bit integer is exact, so dropout masks drawn on a GPU are
bit-identical to the host's and nothing has to be copied to the device.
``normal`` (initial values, drawn once) stays on the host: its log and cos
may differ in the last bit between the host's and the device's libm.
"""

from __future__ import annotations

import hashlib

import numpy as np

from ..device.arrays import array_module

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def make_key(*parts) -> np.uint64:
    """A 64-bit key from any printable parts, e.g. (seed, "init", name)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return np.uint64(int.from_bytes(digest, "little"))


def _mix(key: np.uint64, counter):
    x = counter.astype(np.uint64) * _GOLDEN + np.uint64(key)
    x ^= x >> np.uint64(30)
    x *= _M1
    x ^= x >> np.uint64(27)
    x *= _M2
    x ^= x >> np.uint64(31)
    return x


def uniform(key: np.uint64, counter):
    """Uniform float64 in [0, 1), one per counter value (same shape and
    array module as ``counter``)."""
    return (_mix(key, counter) >> np.uint64(11)).astype(np.float64) * (2.0 ** -53)


def normal(key: np.uint64, counter: np.ndarray) -> np.ndarray:
    """Standard normal float64 per counter value, by Box-Muller on the
    counters 2c and 2c+1 (so distinct counters never share a uniform)."""
    counter = counter.astype(np.uint64)
    u1 = uniform(key, counter * np.uint64(2))
    u2 = uniform(key, counter * np.uint64(2) + np.uint64(1))
    return np.sqrt(-2.0 * np.log1p(-u1)) * np.cos(2.0 * np.pi * u2)


class BlockIndex:
    """The row-major flat indices of a block of a tensor, kept as one term
    per dimension instead of one uint64 per element: element (i_0, ..., i_k)
    of the block has flat index terms[0][i_0] + ... + terms[k][i_k] (uint64,
    wrapping), terms[d] = global index along d * the tensor's stride of d.
    A dropout mask of an attention site is B nh T T elements, and its
    counters as a uint64 array would be twice the float32 mask; the terms
    are B + nh + 2 T values. Consumers evaluate the sum where they hash it
    (mpicube.device.cuda_kernels.dropout_keep) or a chunk at a time
    (``chunks``)."""

    def __init__(self, terms):
        self.terms = tuple(terms)                                    # per dimension: (block length,) uint64
        self.shape = tuple(int(t.shape[0]) for t in self.terms)
        self.size = int(np.prod(self.shape, dtype=np.int64))

    def flat(self, lead=(), part=slice(None)):
        """uint64 flat indices of the sub-block at integer positions ``lead``
        of the leading dimensions and ``part`` (a slice) of the next one,
        shape (part's length, the remaining dimensions...)."""
        xp = array_module(self.terms[0])
        d = len(lead)
        rest = (self.terms[d][part],) + self.terms[d + 1:]
        flat = xp.zeros(tuple(int(t.shape[0]) for t in rest), dtype=np.uint64)
        for dim, i in enumerate(lead):
            flat += self.terms[dim][i]                               # a scalar on the device
        for dim, term in enumerate(rest):
            axis = [1] * len(rest)
            axis[dim] = term.shape[0]
            flat += term.reshape(axis)
        return flat

    def chunks(self, chunk_elems: int):
        """(index, uint64 flat indices) pieces covering the block, each at
        most max(chunk_elems, one row of the last dimension) elements:
        ``index`` (leading integers, then a slice) selects the piece."""
        yield from self._chunks((), max(1, chunk_elems))

    def _chunks(self, lead, chunk):
        d = len(lead)
        inner = int(np.prod(self.shape[d + 1:], dtype=np.int64))
        if inner <= chunk or d == len(self.shape) - 1:
            step = max(1, chunk // max(1, inner))
            for lo in range(0, self.shape[d], step):
                part = slice(lo, min(lo + step, self.shape[d]))
                yield lead + (part,), self.flat(lead, part)
        else:
            for i in range(self.shape[d]):
                yield from self._chunks(lead + (i,), chunk)


def block_index(shape, index, xp=np) -> BlockIndex:
    """The BlockIndex of the block ``index`` (one global index array per
    dimension) of a tensor of logical ``shape``, its terms on ``xp``."""
    strides = np.cumprod((1,) + tuple(shape[::-1]))[:-1][::-1]
    return BlockIndex(xp.asarray(ix, dtype=np.uint64) * np.uint64(stride) for ix, stride in zip(index, strides))


def flat_index(shape, index, xp=np):
    """Row-major flat indices (uint64) of the block ``index`` (one global
    index array per dimension, NumPy or already on ``xp``'s device) of a
    tensor of logical ``shape``, broadcast to the block's shape, built with
    the array module ``xp``."""
    strides = np.cumprod((1,) + tuple(shape[::-1]))[:-1][::-1]
    flat = xp.zeros(tuple(len(ix) for ix in index), dtype=np.uint64)
    for dim, (ix, stride) in enumerate(zip(index, strides)):
        axis = [1] * len(index)
        axis[dim] = len(ix)
        flat += xp.asarray(ix, dtype=np.uint64).reshape(axis) * np.uint64(stride)
    return flat
