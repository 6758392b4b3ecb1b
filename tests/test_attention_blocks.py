"""Blockwise causal attention (mpicube.ops.attention_blocks) against the
attention that holds T x T (ops.attention_forward/backward): the same
outputs, probabilities and gradients to 1e-12 in float64, with and without
dropout; blocks above the diagonal never computed; the model's block-wise
dropout masks the same elements as its full mask. No MPI."""

import numpy as np
import pytest
from mpi4py import MPI

from mpicube import ops
from mpicube.device import fused
from mpicube.core.config import ModelConfig
from mpicube.model.tape import Micro
from mpicube.ops import attention_blocks as ab
from mpicube.parallel.planning import resolve
from mpicube.training.parts import Numerics, build_parts

rng = np.random.default_rng(22)


def rel(a, b):
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-300))


# (B, T, nh, hd, block): T a multiple of the block, not one, shorter than one, a single position
SHAPES = [(2, 37, 3, 4, 8), (1, 64, 2, 8, 16), (2, 20, 2, 4, 64), (1, 1, 1, 4, 8), (2, 300, 2, 4, ab.BLOCK)]


@pytest.fixture(params=["kernels", "numpy"])
def path(request):
    """Both ways of running the softmax steps: device.fused_attention's
    kernels (the CPU default) and the array code (GPUs, MPICUBE_KERNELS=numpy)."""
    previous = fused.use(request.param == "kernels")
    yield request.param
    fused.use(previous)


@pytest.mark.parametrize("dropout", [False, True])
@pytest.mark.parametrize("B,T,nh,hd,block", SHAPES)
def test_equals_full_attention(B, T, nh, hd, block, dropout, path):
    """y, the probabilities exp(s - lse) and dqkv equal the full op's (1e-12)."""
    qkv = rng.standard_normal((B, T, 3 * nh * hd))                     # (B, T, 3 C)
    dy = rng.standard_normal((B, T, nh * hd))                          # (B, T, C)
    keep = (rng.random((B, nh, T, T)) > 0.3).astype(float) if dropout else None   # (B, nh, T, T)
    y0, cache0 = ops.attention_forward(qkv, nh, keep, 0.7)
    y1, cache1 = ab.attention_forward(qkv, nh, keep, 0.7, block=block)
    assert rel(y1, y0) < 1e-12
    q, k, lse = cache1[0], cache1[1], cache1[4]                        # scaled q, k (B, nh, T, hd); (B, nh, T)
    scores = q @ k.swapaxes(-1, -2) + ops.causal_bias(np, T, np.float64)
    assert rel(np.exp(scores - lse[..., None]), cache0[3]) < 1e-12     # cache0[3]: the full op's probabilities
    g0 = ops.attention_backward(dy, cache0)
    g1 = ab.attention_backward(dy, cache1)
    assert rel(g1, g0) < 1e-12


def test_keeps_no_scores():
    """What forward keeps is O(T) per head: q, k, v, y and lse, never (T, T)."""
    B, T, nh, hd = 1, 512, 2, 4
    qkv = rng.standard_normal((B, T, 3 * nh * hd))
    _, cache = ab.attention_forward(qkv, nh, block=64)
    owners = {id(a): a for a in (a if a.base is None else a.base for a in cache if hasattr(a, "shape"))}
    assert sorted(a.size for a in owners.values()) == [B * nh * T, B * T * nh * hd, B * T * nh * hd, qkv.size]
    assert qkv.size < B * nh * T * T / 10                              # lse, y, scaled q, qkv (behind k, v)
    assert cache[4].shape == (B, nh, T)


def test_blocks_above_the_diagonal_are_skipped(path):
    """Forward: NaN keys and values from the second block on leave the
    first query block's output finite. Backward: NaN queries in the first
    block leave the key and value gradients of later blocks finite. So no
    block right of the diagonal is read either way; 3 blocks are 6 of 9."""
    B, T, nh, hd, block = 1, 24, 2, 4, 8
    base = rng.standard_normal((B, T, 3, nh * hd))                     # (B, T, [q|k|v], C)
    qkv = base.copy()
    qkv[:, block:, 1:] = np.nan                                        # k and v of positions 8..23
    y, _ = ab.attention_forward(qkv.reshape(B, T, -1), nh, block=block)
    assert np.isfinite(y[:, :block]).all() and np.isnan(y[:, block:]).all()
    qkv = base.copy()
    qkv[:, :block, 0] = np.nan                                         # q of positions 0..7
    y, cache = ab.attention_forward(qkv.reshape(B, T, -1), nh, block=block)
    dqkv = ab.attention_backward(np.ones((B, T, nh * hd)), cache).reshape(B, T, 3, -1)
    assert np.isfinite(dqkv[:, block:, 1:]).all() and np.isnan(dqkv[:, :block, 1:]).all()
    assert ab.computed_pairs(T, block) == 6 and ab.computed_pairs(1) == 1


def test_merge_of_two_key_halves():
    """Attention over keys [0, T) equals the lse-merge of [0, T/2) and [T/2, T)
    (what the ring does with chunks from other ranks)."""
    B, T, nh, hd = 2, 16, 2, 4
    qkv = rng.standard_normal((B, T, 3 * nh * hd)).reshape(B, T, 3, nh, hd).transpose(2, 0, 3, 1, 4)
    q, k, v = qkv[0] / np.sqrt(hd), qkv[1], qkv[2]                     # (B, nh, T, hd)
    s = q[:, :, T - 4:] @ k.swapaxes(-1, -2)                          # the last 4 queries see every key
    parts = []
    for cols in (slice(0, T // 2), slice(T // 2, T)):
        part = s[..., cols]
        lse = np.log(np.exp(part).sum(-1))
        parts += [np.exp(part - lse[..., None]) @ v[:, :, cols], lse]
    y, lse = ab.merge(*parts)
    p = np.exp(s - s.max(-1, keepdims=True))
    assert rel(y, (p / p.sum(-1, keepdims=True)) @ v) < 1e-12
    assert rel(lse, np.log(np.exp(s).sum(-1))) < 1e-12


@pytest.mark.parametrize("block", [16, ab.BLOCK])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_narrow_formats_follow_float64(dtype, block, path):
    """float32 and bfloat16 inputs (float32 accumulation) stay near the
    float64 result, in blocks and as one block (float32's single pair
    writes its products straight into y and dqkv)."""
    from mpicube.device.precision import dtype_of
    B, T, nh, hd = 2, 40, 2, 8
    qkv, dy = rng.standard_normal((B, T, 3 * nh * hd)), rng.standard_normal((B, T, nh * hd))
    dt = dtype_of(dtype)
    y64, c64 = ab.attention_forward(qkv, nh, block=block)
    y, c = ab.attention_forward(qkv.astype(dt), nh, block=block)
    tol = 1e-5 if dtype == "float32" else 3e-2
    assert y.dtype == dt and rel(y.astype(np.float64), y64) < tol
    g = ab.attention_backward(dy.astype(dt), c)
    assert g.dtype == dt and rel(g.astype(np.float64), ab.attention_backward(dy, c64)) < 10 * tol


def test_model_masks_by_blocks_equal_the_full_mask():
    """Dropout.attention_blocks draws, block by block, the elements of the
    (B, nh, T, T) mask Dropout.attention draws (the same global indices)."""
    cfg = ModelConfig(vocab_size=11, n_ctx=12, n_layer=1, n_head=2, n_embd=8)
    parts = build_parts(resolve("serial", cfg, 3, 1), MPI.COMM_SELF, Numerics("float64"), seed=5, dropout=0.3)
    drop, ctx = parts.model.model.dropout, Micro(step=4)
    full = drop.attention(ctx, "h.0.attn", 10)                        # (B, nh, T, T)
    blocks = drop.attention_blocks(ctx, "h.0.attn", 10)
    got = np.concatenate([np.concatenate([blocks(slice(i, min(i + 4, 10)), slice(j, min(j + 4, 10)))
                                          for j in (0, 4, 8)], -1) for i in (0, 4, 8)], -2)   # global slices
    np.testing.assert_array_equal(got, full)
    assert 0 < (full == 0).mean() < 0.6


def test_blockwise_masks_count_by_terms_not_per_element(monkeypatch):
    """Each block of the model's blockwise attention mask reaches keep_mask
    as an rng.BlockIndex (B + nh + rows + cols terms), never a uint64
    counter per element: with the CUDA kernels on, the kernel adds the
    terms per element and no array the mask's size of counters exists."""
    from mpicube.model import block as block_module
    from mpicube.ops import rng

    cfg = ModelConfig(vocab_size=11, n_ctx=12, n_layer=1, n_head=2, n_embd=8)
    parts = build_parts(resolve("serial", cfg, 3, 1), MPI.COMM_SELF, Numerics("float64"), seed=5, dropout=0.3)
    seen = []
    real = block_module.ops.keep_mask
    monkeypatch.setattr(block_module.ops, "keep_mask",
                        lambda key, counter, *a, **k: seen.append(counter) or real(key, counter, *a, **k))
    blocks = parts.model.model.dropout.attention_blocks(Micro(step=4), "h.0.attn", 10)
    mask = blocks(slice(0, 8), slice(0, 4))                           # (B, nh, 8, 4)
    assert len(seen) == 1 and isinstance(seen[0], rng.BlockIndex), seen
    assert seen[0].shape == mask.shape and sum(int(t.shape[0]) for t in seen[0].terms) == 3 + 2 + 8 + 4
