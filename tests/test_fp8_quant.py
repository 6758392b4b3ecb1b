"""The FP8 quantizers (mpicube/ops/fp8.py, fp8_recipes.py) against known
answers worked out by hand from the written definitions (the e4m3/e5m2
encodings, torchao's scale rule, DeepSeek-V3's tiles and blocks, OCP MX
v1.0 6.3), and, where torchao imports, against its bytes."""

import ml_dtypes
import numpy as np
import pytest

from mpicube.ops import fp8
from mpicube.ops.fp8_recipes import Recipe, quantize_operand

E4, E5 = fp8.E4M3, fp8.E5M2


def cast(values, fmt, scale=1.0):
    x = np.asarray(values, dtype=np.float32)[None]                  # (1, n)
    return fp8.quantize(x, np.float32(scale), "tensor", fmt)[0]     # (n,)


def test_e4m3_saturates_instead_of_overflowing_to_nan():
    q = cast([448, 464, 500, -1000, 1e30], E4)
    assert q.astype(np.float32).tolist() == [448, 448, 448, -448, 448]
    assert fp8.fp8_bytes(q).tolist() == [0x7E, 0x7E, 0x7E, 0xFE, 0x7E]   # 0x7F would be NaN


def test_e5m2_saturates_to_its_largest_finite():
    q = cast([57344, 60000, -1e9], E5)
    assert q.astype(np.float32).tolist() == [57344, 57344, -57344]
    assert fp8.fp8_bytes(q).tolist() == [0x7B, 0x7B, 0xFB]


def test_ties_round_to_even():
    # e4m3 spacing in [1, 2) is 1/8: 1 + 1/16 lies halfway between 1 (even) and 1.125
    q = cast([1 + 1 / 16, 1 + 3 / 16, 1 + 5 / 16, -(1 + 1 / 16)], E4)
    assert q.astype(np.float32).tolist() == [1.0, 1.25, 1.25, -1.0]
    # e5m2 spacing in [1, 2) is 1/4
    q = cast([1 + 1 / 8, 1 + 3 / 8], E5)
    assert q.astype(np.float32).tolist() == [1.0, 1.5]


def test_subnormals():
    # e4m3: smallest subnormal 2^-9 (byte 0x01); 2^-10 is the tie between 0 and it
    # the largest subnormal 7 2^-9 is 0x07; 3.5 2^-9 ties to 4 2^-9 (even)
    q = cast([2.0 ** -9, 2.0 ** -10, 3 * 2.0 ** -10, 7 * 2.0 ** -9, 7 * 2.0 ** -10], E4)
    assert fp8.fp8_bytes(q).tolist() == [0x01, 0x00, 0x02, 0x07, 0x04]
    # e5m2: smallest subnormal 2^-16
    q = cast([2.0 ** -16, 2.0 ** -17, 3 * 2.0 ** -17], E5)
    assert fp8.fp8_bytes(q).tolist() == [0x01, 0x00, 0x02]


def test_current_scale_rule():
    assert fp8.current_scale(2.0, E4) == np.float32(224)
    assert fp8.current_scale(3.0, E4) == np.float32(448 / 3)
    assert fp8.current_scale(3.0, E4, power_of_2=True) == np.float32(128)
    assert fp8.current_scale(0.0, E4) == np.float32(448 / 1e-12)     # an all-zero tensor: torchao's EPS


def test_tensorwise_maps_the_amax_to_the_format_max():
    x = np.array([[1.0, -2.0], [0.5, 0.25]])                         # (2, 2)
    qo = quantize_operand(x, "x", "forward", Recipe("tensorwise"))
    assert qo.scale.item() == 224
    assert qo.q.astype(np.float32).tolist() == [[224, -448], [112, 56]]
    np.testing.assert_array_equal(qo.values(np.float64), x)          # exact here: 224 x is representable


def test_rowwise_one_scale_per_row_along_the_contraction():
    x = np.array([[1.0, -2.0], [0.5, 0.25]])                         # (2, 2)
    qo = quantize_operand(x, "x", "forward", Recipe("rowwise", grad_format="e4m3"))
    assert qo.scale.ravel().tolist() == [224, 896]
    assert qo.q.astype(np.float32).tolist() == [[224, -448], [448, 224]]
    pow2 = quantize_operand(np.array([[3.0, 1.0]]), "x", "forward", Recipe("rowwise", power_of_2=True))
    assert pow2.scale.item() == 128 and pow2.q.astype(np.float32).tolist() == [[384, 128]]


def test_blockwise_tiles_and_blocks():
    r = Recipe("blockwise", grad_format="e4m3", block=128)
    x = np.zeros((2, 256))                                            # (2, 256): two 1 x 128 tiles per row
    x[0, 5], x[0, 200], x[1, 7] = 2.0, -8.0, 0.5
    qo = quantize_operand(x, "x", "forward", r)
    assert qo.scale.shape == (2, 2)
    assert qo.scale.tolist() == [[224, 56], [896, np.float32(448 / 1e-12)]]   # an all-zero tile: its elements 0
    q = qo.q.astype(np.float32)
    assert (q[0, 5], q[0, 200], q[1, 7]) == (448, -448, 448) and np.count_nonzero(q) == 3
    w = np.zeros((256, 128))                                          # (K_in, K_out): two 128 x 128 blocks
    w[3, 4], w[130, 100] = 1.0, -4.0
    wq = quantize_operand(w, "w", "forward", r)
    assert wq.scale.shape == (2, 1) and wq.scale.ravel().tolist() == [448, 112]
    # a block reads the same in either orientation: W^T's blocks are W's, transposed
    wq_t = quantize_operand(w.T.copy(), "w", "dgrad", r)
    np.testing.assert_array_equal(fp8.fp8_bytes(wq_t.q), fp8.fp8_bytes(wq.q).T)


def test_a_tile_never_straddles_the_edge_and_a_short_last_one_is_zero_padded():
    with pytest.raises(ValueError, match="tiles of 128"):
        fp8.group_amax(np.ones((2, 200)), ("tile", 128))
    # an expert's token rows come in any number: the last tile is short, padded with zeros (no amax changes)
    x = np.zeros((1, 40))
    x[0, 3], x[0, 35] = 2.0, 0.5                                     # tile [0, 32) amax 2, short tile [32, 40) 0.5
    qo = quantize_operand(x, "x", "forward", Recipe("mxfp8", grad_format="e4m3", block=32))
    assert qo.q.shape == (1, 64) and fp8.fp8_bytes(qo.scale).tolist() == [[127 - 7, 127 - 9]]
    np.testing.assert_array_equal(qo.values(np.float64)[:, :40], x)


def mx(x):
    return quantize_operand(np.asarray(x, dtype=np.float32)[None], "x", "forward",
                            Recipe("mxfp8", grad_format="e4m3", block=len(x)))


def test_mx_scale_is_the_spec_power_of_two():
    x = np.zeros(32, dtype=np.float32)
    x[0], x[1], x[2] = 6.0, 0.75, -1.0
    qo = mx(x)
    # floor(log2 6) = 2, minus e4m3's emax 8: X = 2^-6, biased 121
    assert fp8.fp8_bytes(qo.scale).tolist() == [[121]]
    assert qo.q.astype(np.float32)[0, :3].tolist() == [384, 48, -64]


def test_mx_elements_saturate_above_the_format_max():
    x = np.zeros(32, dtype=np.float32)
    x[0], x[1] = 500.0, 1.0                         # X = 2^(8-8) = 1: 500 does not fit e4m3 and clamps to 448
    qo = mx(x)
    assert fp8.fp8_bytes(qo.scale).tolist() == [[127]] and qo.q.astype(np.float32)[0, :2].tolist() == [448, 1]


def test_mx_subnormal_ties_and_zero_block():
    x = np.zeros(32, dtype=np.float32)
    x[0], x[1], x[2] = 1.0, 2.0 ** -18, 3 * 2.0 ** -18     # X = 2^-8: 2^-10 ties to 0, 3 2^-10 to 2^-8
    assert fp8.fp8_bytes(mx(x).q)[0, :3].tolist() == [0x78, 0x00, 0x02]   # 1 / X = 2^8: 0 1111 000
    zero = mx(np.zeros(32, dtype=np.float32))
    assert fp8.fp8_bytes(zero.scale).tolist() == [[0]] and not fp8.fp8_bytes(zero.q).any()   # X = 2^-127
    tiny = mx(np.full(32, 2.0 ** -126, dtype=np.float32))          # exponent -134 clamps to E8M0's -127
    assert fp8.fp8_bytes(tiny.scale).tolist() == [[0]]


def test_mx_nan_or_inf_makes_the_block_nan():
    for bad in (np.nan, np.inf):
        x = np.ones(64, dtype=np.float32)
        x[3] = bad
        qo = quantize_operand(x[None], "x", "forward", Recipe("mxfp8", grad_format="e4m3", block=32))
        assert fp8.fp8_bytes(qo.scale).tolist() == [[0xFF, 127 - 8]]           # first block NaN, second 2^-8
        assert np.isnan(qo.q[0, :32].astype(np.float32)).all()
        assert (qo.q[0, 32:].astype(np.float32) == 256).all()


def test_require_finite_names_the_tensor():
    fp8.require_finite(np.ones(3), "h.0.mlp.c_fc x")
    with pytest.raises(fp8.NonFiniteError, match="NaN reached the FP8 quantizer of h.0.mlp.c_fc x"):
        fp8.require_finite(np.array([1.0, np.nan]), "h.0.mlp.c_fc x")
    with pytest.raises(fp8.NonFiniteError, match="inf reached"):
        fp8.require_finite(np.array([1.0, -np.inf]), "w")


def test_dequantized_values_are_exact_in_float64():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 64))                                  # (8, 64)
    for r in (Recipe("tensorwise"), Recipe("rowwise"), Recipe("blockwise", block=32), Recipe("mxfp8", block=32)):
        qo = quantize_operand(x, "x", "forward", r)
        v = qo.values(np.float64)
        if r.name != "mxfp8":                                         # q = v * scale again, exactly
            back = (v * fp8.expand(qo.scale, qo.group, v.shape).astype(np.float64)).astype(np.float32)
            np.testing.assert_array_equal(back.astype(ml_dtypes.float8_e4m3fn).view(np.uint8), qo.q.view(np.uint8))
        assert np.abs(v - x).max() <= np.abs(x).max() / 8


# --- torchao, where it imports ---------------------------------------------------

def torch_ao():
    torch = pytest.importorskip("torch")
    pytest.importorskip("torchao")
    return torch


def sample(shape, seed=1):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32) * np.exp2(rng.integers(-6, 6, size=shape)).astype(np.float32)
    x[0, :3] = 0.0
    return x


def bits(t):
    return t.view(__import__("torch").uint8).numpy()


def test_tensorwise_and_rowwise_bytes_equal_torchao():
    torch = torch_ao()
    from torchao.float8.float8_utils import amax_to_scale, to_fp8_saturated
    x = sample((16, 96))
    for fmt, tdt in ((E4, torch.float8_e4m3fn), (E5, torch.float8_e5m2)):
        xt = torch.from_numpy(x)
        scale = amax_to_scale(xt.abs().max(), tdt)
        ref = to_fp8_saturated(xt * scale, tdt)
        ours = fp8.quantize(x, fp8.current_scale(fp8.group_amax(x, "tensor"), fmt), "tensor", fmt)
        assert scale.item() == fp8.current_scale(np.abs(x).max(), fmt)
        np.testing.assert_array_equal(fp8.fp8_bytes(ours), bits(ref))
    xt = torch.from_numpy(x)
    row_scale = amax_to_scale(xt.abs().amax(dim=-1, keepdim=True), torch.float8_e4m3fn, round_scales_to_power_of_2=True)
    ref = to_fp8_saturated(xt * row_scale, torch.float8_e4m3fn)
    ours = quantize_operand(x, "x", "forward", Recipe("rowwise", grad_format="e4m3", power_of_2=True))
    np.testing.assert_array_equal(ours.scale, row_scale.numpy())
    np.testing.assert_array_equal(fp8.fp8_bytes(ours.q), bits(ref))


def test_blockwise_bytes_equal_torchao():
    torch = torch_ao()
    kernels = pytest.importorskip("torchao.prototype.blockwise_fp8_training.kernels")
    r = Recipe("blockwise", grad_format="e4m3", block=128)
    x = sample((4, 256))
    ref_q, ref_s = kernels.torch_blockwise_scale_act_quant_lhs(torch.from_numpy(x), 128)
    ours = quantize_operand(x, "x", "forward", r)
    np.testing.assert_array_equal(fp8.fp8_bytes(ours.q), bits(ref_q))
    np.testing.assert_array_equal(1 / ours.scale, ref_s.numpy())          # torchao returns the reciprocal
    w = sample((256, 384), seed=2)                                       # torch's (out, in) weight
    ref_q, ref_s = kernels.torch_blockwise_scale_weight_quant(torch.from_numpy(w), 128)
    ours = quantize_operand(w, "w", "forward", r)
    np.testing.assert_array_equal(fp8.fp8_bytes(ours.q), bits(ref_q))
    np.testing.assert_array_equal(1 / ours.scale, ref_s.numpy())


def test_mx_bytes_equal_torchao_to_mx():
    torch = torch_ao()
    from torchao.prototype.mx_formats.mx_tensor import to_mx
    x = sample((8, 128))
    x[1, 32:64] = 0.0                                                    # a zero block
    ref_s, ref_q = to_mx(torch.from_numpy(x), torch.float8_e4m3fn, 32)
    ours = quantize_operand(x, "x", "forward", Recipe("mxfp8", grad_format="e4m3", block=32))
    np.testing.assert_array_equal(fp8.fp8_bytes(ours.scale), bits(ref_s).reshape(8, 4))
    np.testing.assert_array_equal(fp8.fp8_bytes(ours.q), bits(ref_q))


# --- float32 accumulation: the bound between layouts' summation orders (docs/fp8.md) ---

UNIT_F32 = 2.0 ** -24                            # float32's unit roundoff


def gamma(n):
    """Higham's gamma_n = n u / (1 - n u): the relative error bound of n float32 roundings."""
    return n * UNIT_F32 / (1 - n * UNIT_F32)


def order_bound(k, chunks):
    """docs/fp8.md's bound on |GEMM in one order - GEMM split into ``chunks`` pieces
    of the contraction k|, per unit of sum_k |a_k b_k|: gamma_k (one BLAS sum)
    plus gamma_{k/chunks + chunks - 1} (each piece's BLAS sum, then the
    pieces in any order)."""
    return gamma(k) + gamma(k // chunks + chunks - 1)


def split_orders(a, b, chunks):
    """a (n, K) @ b (N, K)^T in float32, the contraction cut into ``chunks``
    pieces, each piece a BLAS GEMM (as a rank's or a panel's), summed as the
    layouts sum them: one after another in rank order (SUMMA's panels, a
    16-bit wire's sums, DeepSeek's promotions) and, for 4, pairwise (MPI's
    recursive doubling)."""
    m = a.shape[1] // chunks
    parts = [a[:, i * m:(i + 1) * m] @ b[:, i * m:(i + 1) * m].T for i in range(chunks)]   # chunks x (n, N)
    in_rank_order = parts[0]
    for part in parts[1:]:
        in_rank_order = in_rank_order + part                                                # (n, N) float32
    orders = [in_rank_order]
    if chunks == 4:
        orders.append((parts[0] + parts[1]) + (parts[2] + parts[3]))
    return orders


@pytest.mark.parametrize("recipe", [Recipe("tensorwise"), Recipe("delayed"),
                                    Recipe("rowwise", grad_format="e4m3"),
                                    Recipe("rowwise", grad_format="e4m3", power_of_2=True),
                                    Recipe("blockwise", grad_format="e4m3", block=128),
                                    Recipe("mxfp8", grad_format="e4m3", block=32)],
                         ids=lambda r: r.name + ("-pow2" if r.power_of_2 else ""))
def test_float32_summation_orders_agree_within_the_documented_bound(recipe):
    """The same quantized operands (as every layout has them), their GEMM in
    float32 unsplit and split as 1-D's row-parallel linear, SUMMA's panels
    and DeepSeek's 128-element promotion split it: every output within
    docs/fp8.md's bound. Not vacuous: the orders do differ, by at least a
    thousandth of the bound somewhere, and one FP8 code changed in one
    operand (a quantization difference, not an order one) exceeds it."""
    k = 1024
    x, w = sample((32, k), seed=3), sample((k, 128), seed=4)           # (n, K), (K, N)
    qx = quantize_operand(x, "x", "forward", recipe)
    qw = quantize_operand(w.T.copy(), "w", "forward", recipe)         # W^T (N, K)
    a, b = qx.values(np.float32), qw.values(np.float32)               # (n, K), (N, K): the layouts' bits
    unsplit = (a @ b.T).astype(np.float64)                            # (n, N)
    abs_sum = np.abs(a).astype(np.float64) @ np.abs(b).astype(np.float64).T   # (n, N): sum_k |a_k b_k|, to 1e-13 relative
    worst = 0.0
    for chunks in (2, 4, k // 128):                                   # 1-D over 2 and 4 ranks; 128-element promotions
        bound = order_bound(k, chunks) * abs_sum                      # (n, N)
        for split in split_orders(a, b, chunks):
            diff = np.abs(split.astype(np.float64) - unsplit)         # (n, N)
            assert (diff <= bound).all(), (chunks, (diff / bound).max())
            worst = max(worst, (diff / bound).max())
    assert worst >= 1e-3, worst

    # a one-code change of the largest product's x element moves that output beyond the bound
    i, j = 0, 0
    kk = int(np.argmax(np.abs(a[i] * b[j])))
    q = qx.q.copy()
    q.view(np.uint8)[i, kk] -= 1                                       # the next FP8 code toward zero (never NaN)
    flipped = type(qx)(q, qx.scale, qx.group).values(np.float32)      # (n, K)
    moved = abs(float((flipped[i] @ b[j]) - (a[i] @ b[j])))
    flip_bound = order_bound(k, 2) * abs_sum[i, j]
    assert moved > flip_bound, (moved, flip_bound)
    print(f"{recipe.name}{'-pow2' if recipe.power_of_2 else ''}: the orders differ by up to {worst:.1%} of the "
          f"bound; one FP8 code moves an output {moved / flip_bound:.0f} times past it")


@pytest.mark.parametrize("fmt", [E4, E5], ids=["e4m3", "e5m2"])
def test_gpu_rounding_is_ml_dtypes_cast_on_every_tie_and_edge(fmt):
    """round_to_format (what a GPU run rounds with: CuPy has no FP8 type)
    against ml_dtypes' cast, bit for bit, on the values where a rounding
    can go wrong: every value of the format, every midpoint between two
    neighbours (a tie) and the float32 numbers either side of it, the
    subnormals and the float32 subnormals below them, +-0, the bound and
    NaN; then a million random magnitudes across the whole range."""
    codes = np.arange(256, dtype=np.uint8).view(fmt.dtype).astype(np.float32)      # every value, NaN too
    finite = np.unique(np.abs(codes[np.isfinite(codes)]))                            # 0 .. max, ascending
    mid = ((finite[:-1].astype(np.float64) + finite[1:]) / 2).astype(np.float32)     # exact: one more bit
    near = np.concatenate([mid, np.nextafter(mid, np.float32(0)), np.nextafter(mid, np.float32(np.inf)),
                           finite, np.nextafter(finite, np.float32(np.inf))])
    tiny = np.array([1e-45, 1e-40, 1e-38, np.finfo(np.float32).tiny], dtype=np.float32)
    rng = np.random.default_rng(0)
    random = np.exp2(rng.uniform(-30, np.log2(fmt.max), 1_000_000)).astype(np.float32)
    magnitudes = np.concatenate([near, tiny, random])
    v = np.clip(np.concatenate([magnitudes, -magnitudes, [0.0, -0.0, np.nan]]).astype(np.float32),
                -fmt.max, fmt.max)
    want = v.astype(fmt.dtype).astype(np.float32)
    got = fp8.round_to_format(v, fmt)
    assert got.dtype == np.float32 and mid.size > 100
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), \
        v[got.view(np.uint32) != want.view(np.uint32)][:5]
