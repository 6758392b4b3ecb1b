"""DeepSeek-V3's local ops (``ops.mla``, ``ops.deepseek_router``,
``ops.mtp``): every backward against central finite differences in
float64, and known answers for group-limited top-k with ties, the bias
update's sign and MTP's token shift and loss weights. No MPI, no torch.
"""

import numpy as np
import pytest

from mpicube import ops
from mpicube.ops import deepseek_router as router
from mpicube.ops import attention_blocks, mla, mtp, yarn


def numeric_grad(f, x, eps=1e-6):
    """Central differences of the scalar f() in every element of x (changed in place and restored)."""
    g = np.zeros_like(x)
    flat, gflat = x.reshape(-1), g.reshape(-1)
    for i in range(flat.size):
        keep = flat[i]
        flat[i] = keep + eps
        up = f()
        flat[i] = keep - eps
        down = f()
        flat[i] = keep
        gflat[i] = (up - down) / (2 * eps)
    return g


def assert_grad(analytic, f, x, rtol=1e-7):
    numeric = numeric_grad(f, x)
    scale = np.abs(numeric).max()
    assert scale > 1e-6                                              # the check sees a real gradient
    np.testing.assert_allclose(analytic, numeric, rtol=0, atol=rtol * scale)


# --- MLA -----------------------------------------------------------------------
@pytest.mark.parametrize("interleaved", [True, False])
def test_mla_attention_backward_matches_finite_differences(interleaved):
    rng = np.random.default_rng(1)
    B, T, nh = 2, 5, 3
    dims = mla.MlaDims(nope=4, rope=6, v=3, kv_rank=7, interleaved=interleaved)
    q = rng.normal(size=(B, T, nh * dims.qk))                        # (B, T, nh (dn + dr))
    kv = rng.normal(size=(B, T, nh * (dims.nope + dims.v)))          # (B, T, nh (dn + dv))
    k_pe = rng.normal(size=(B, T, dims.rope))                        # (B, T, dr)
    cos, sin = ops.rope_tables(np.arange(3, 3 + T), dims.rope, 100.0)   # (T, dr) at positions 3..
    G = rng.normal(size=(B, T, nh * dims.v))                         # dL/dy

    def loss():
        return float((mla.attention_forward(q, kv, k_pe, nh, dims, cos, sin)[0] * G).sum())

    y, tape = mla.attention_forward(q, kv, k_pe, nh, dims, cos, sin)
    dq, dkv, dk_pe = mla.attention_backward(G, tape)
    assert_grad(dq, loss, q)
    assert_grad(dkv, loss, kv)
    assert_grad(dk_pe, loss, k_pe)


def test_mla_dropout_backward_matches_finite_differences():
    rng = np.random.default_rng(2)
    B, T, nh = 1, 4, 2
    dims = mla.MlaDims(nope=2, rope=4, v=3, kv_rank=5)
    q, kv = rng.normal(size=(B, T, nh * dims.qk)), rng.normal(size=(B, T, nh * (dims.nope + dims.v)))
    k_pe = rng.normal(size=(B, T, dims.rope))
    cos, sin = ops.rope_tables(np.arange(T), dims.rope, 10000.0)
    mask = (rng.random((B, nh, T, T)) > 0.3).astype(np.float64)
    G = rng.normal(size=(B, T, nh * dims.v))

    def loss():
        return float((mla.attention_forward(q, kv, k_pe, nh, dims, cos, sin, keep_mask=mask, keep_prob=0.7)[0]
                      * G).sum())

    _, tape = mla.attention_forward(q, kv, k_pe, nh, dims, cos, sin, keep_mask=mask, keep_prob=0.7)
    dq, dkv, dk_pe = mla.attention_backward(G, tape)
    assert_grad(dq, loss, q)
    assert_grad(dkv, loss, kv)
    assert_grad(dk_pe, loss, k_pe)


def test_mla_heads_split_sum_their_k_pe_gradients():
    """Two halves of the heads give the whole core's outputs, and dk_pe is
    the SUM of the halves' (what a tensor-parallel layout all-reduces)."""
    rng = np.random.default_rng(3)
    B, T, nh = 2, 4, 4
    dims = mla.MlaDims(nope=3, rope=4, v=2, kv_rank=5)
    q, kv = rng.normal(size=(B, T, nh * dims.qk)), rng.normal(size=(B, T, nh * (dims.nope + dims.v)))
    k_pe, G = rng.normal(size=(B, T, dims.rope)), rng.normal(size=(B, T, nh * dims.v))
    cos, sin = ops.rope_tables(np.arange(T), dims.rope, 10000.0)
    y, tape = mla.attention_forward(q, kv, k_pe, nh, dims, cos, sin)
    dk_pe = mla.attention_backward(G, tape)[2]
    half_q, half_kv, half_v = 2 * dims.qk, 2 * (dims.nope + dims.v), 2 * dims.v
    parts = []
    for h in range(2):
        yh, th = mla.attention_forward(q[..., h * half_q:(h + 1) * half_q], kv[..., h * half_kv:(h + 1) * half_kv],
                                       k_pe, 2, dims, cos, sin)
        np.testing.assert_array_equal(yh, y[..., h * half_v:(h + 1) * half_v])
        parts.append(mla.attention_backward(G[..., h * half_v:(h + 1) * half_v], th)[2])
    np.testing.assert_allclose(parts[0] + parts[1], dk_pe, rtol=1e-13, atol=1e-14)
    assert np.abs(parts[0] - dk_pe).max() > 1e-3                     # one half alone is wrong




def test_mla_layer_backward_through_its_linears_matches_finite_differences():
    """The whole layer, the way a model composes the pieces: x -> q_down ->
    latent norm -> q_up; x -> kv_down -> split_latent -> (latent norm ->
    kv_up, k_pe); core; c_proj. The gradient of x and of every weight,
    k_pe's path through kv_down included, against finite differences."""
    rng = np.random.default_rng(10)
    B, T, C, nh = 2, 4, 6, 2
    dims = mla.MlaDims(nope=2, rope=4, v=3, kv_rank=5, q_rank=3)
    w = {"x": rng.normal(size=(B, T, C)), "q_down": rng.normal(size=(C, 3)) * 0.5, "q_norm": 1 + rng.normal(size=3),
         "q_up": rng.normal(size=(3, nh * dims.qk)) * 0.5, "kv_down": rng.normal(size=(C, 5 + 4)) * 0.5,
         "kv_norm": 1 + rng.normal(size=5), "kv_up": rng.normal(size=(5, nh * 5)) * 0.5,
         "c_proj": rng.normal(size=(nh * 3, C)) * 0.5}
    G = rng.normal(size=(B, T, C))
    cos, sin = ops.rope_tables(np.arange(T), dims.rope, 10000.0)
    eps = mla.LATENT_EPS

    def forward():
        cq = w["x"] @ w["q_down"]                                                # (B, T, rq)
        nq, s_q = ops.rmsnorm_forward(cq, w["q_norm"], 3, eps)
        q = nq @ w["q_up"]                                                       # (B, T, nh qk)
        ckv = w["x"] @ w["kv_down"]                                              # (B, T, rkv + dr)
        c_kv, k_pe = mla.split_latent(ckv, dims.kv_rank)
        nkv, s_kv = ops.rmsnorm_forward(c_kv, w["kv_norm"], 5, eps)
        kv = nkv @ w["kv_up"]                                                    # (B, T, nh (dn + dv))
        y, tape = mla.attention_forward(q, kv, k_pe, nh, dims, cos, sin)
        return y @ w["c_proj"], (nq, s_q, nkv, s_kv, y, tape)

    _, (nq, s_q, nkv, s_kv, y, tape) = forward()
    g = {k: np.zeros_like(v) for k, v in w.items()}
    g["c_proj"] += y.reshape(-1, nh * 3).T @ G.reshape(-1, C)
    dq, dkv, dk_pe = mla.attention_backward(G @ w["c_proj"].T, tape)
    g["kv_up"] += nkv.reshape(-1, 5).T @ dkv.reshape(-1, dkv.shape[-1])
    dc_kv = ops.rmsnorm_backward(dkv @ w["kv_up"].T, s_kv, w["kv_norm"], g["kv_norm"], 5)
    dckv = mla.join_latent_grads(dc_kv, dk_pe)                                  # (B, T, rkv + dr)
    g["kv_down"] += w["x"].reshape(-1, C).T @ dckv.reshape(-1, 9)
    g["q_up"] += nq.reshape(-1, 3).T @ dq.reshape(-1, dq.shape[-1])
    dcq = ops.rmsnorm_backward(dq @ w["q_up"].T, s_q, w["q_norm"], g["q_norm"], 3)
    g["q_down"] += w["x"].reshape(-1, C).T @ dcq.reshape(-1, 3)
    g["x"] += dckv @ w["kv_down"].T + dcq @ w["q_down"].T
    for name in w:
        assert_grad(g[name], lambda: float((forward()[0] * G).sum()), w[name])


def test_seq_aux_loss_over_split_sequences_equals_whole():
    """Under context parallelism: each chunk's allsum adds the other chunk's
    partial sums; both chunks return the whole sequence's loss, and their
    score gradients are the whole gradient's rows."""
    rng = np.random.default_rng(11)
    B, T, E, K = 2, 6, 8, 2
    scores = router.sigmoid(rng.normal(size=(B, T, E)))
    chosen = np.stack([router.top_indices(scores[b], K) for b in range(B)])      # (B, T, K)
    whole, whole_tape = router.seq_aux_forward(scores, chosen, 0.01, T, B)
    halves = [slice(0, 2), slice(2, T)]                                           # uneven chunks
    partial = []
    for h in halves:
        router.seq_aux_forward(scores[:, h], chosen[:, h], 0.01, T, B, allsum=lambda a: partial.append(a) or a)
    grads = []
    for i, h in enumerate(halves):
        loss, tape = router.seq_aux_forward(scores[:, h], chosen[:, h], 0.01, T, B,
                                            allsum=lambda a, i=i: a + partial[1 - i])
        assert loss == pytest.approx(whole, rel=1e-14)
        grads.append(router.seq_aux_backward(1.0, tape))
    np.testing.assert_allclose(np.concatenate(grads, axis=1), router.seq_aux_backward(1.0, whole_tape), rtol=1e-13)


class Blocks:
    """ops.attention_blocks with small blocks, so a short sequence crosses several."""

    def __init__(self, block):
        self.block = block

    def attention_forward(self, qkv, n_head, keep_mask=None, keep_prob=1.0):
        return attention_blocks.attention_forward(qkv, n_head, keep_mask, keep_prob, block=self.block)

    def attention_backward(self, dy, cache):
        return attention_blocks.attention_backward(dy, cache)


# YaRN with both corrections: tables x table_factor ~0.93, softmax scale x ~1.41
YARN = yarn.YarnScaling(factor=40.0, original_max_position_embeddings=64, mscale=1.0, mscale_all_dim=1.6)


@pytest.mark.parametrize("attention", [ops, Blocks(4)], ids=["full", "blocks"])
@pytest.mark.parametrize("scaling", [None, YARN], ids=["plain", "yarn"])
def test_packed_mla_through_the_projects_attention_ops_equals_the_core(attention, scaling):
    """pack -> any attention op -> unpack gives attention_forward's numbers
    (v zero-padded to dn + dr), and its backward attention_backward's; with
    YaRN's softmax factor (folded into q by pack) and its scaled tables too."""
    rng = np.random.default_rng(9)
    B, T, nh = 2, 10, 3
    factor = 1.0 if scaling is None else scaling.softmax_factor
    dims = mla.MlaDims(nope=4, rope=6, v=3, kv_rank=7, softmax_factor=factor)
    q, kv = rng.normal(size=(B, T, nh * dims.qk)), rng.normal(size=(B, T, nh * (dims.nope + dims.v)))
    k_pe, G = rng.normal(size=(B, T, dims.rope)), rng.normal(size=(B, T, nh * dims.v))
    cos, sin = ops.rope_tables(np.arange(T), dims.rope, 100.0, scaling)
    want, tape = mla.attention_forward(q, kv, k_pe, nh, dims, cos, sin)
    y, cache = attention.attention_forward(mla.pack(q, kv, k_pe, nh, dims, cos, sin), nh)
    np.testing.assert_array_equal(y.reshape(B, T, nh, dims.qk)[..., dims.v:], 0.0)
    np.testing.assert_allclose(mla.unpack(y, nh, dims), want, rtol=1e-13, atol=1e-14)
    dqkv = attention.attention_backward(mla.unpack_backward(G, dims), cache)
    for got, ref_grad in zip(mla.pack_backward(dqkv, nh, dims, cos, sin), mla.attention_backward(G, tape)):
        np.testing.assert_allclose(got, ref_grad, rtol=1e-12, atol=1e-13 * np.abs(ref_grad).max())
    with pytest.raises(ValueError, match="v_head_dim 11 exceeds"):
        mla.pack(q, kv, k_pe, nh, mla.MlaDims(nope=4, rope=6, v=11, kv_rank=7), cos, sin)


def test_yarn_frequencies_and_scales_known_answers():
    """YaRN (ops.yarn): frequencies turning more than beta_fast times over
    the original context kept, fewer than beta_slow times divided by the
    factor, a linear ramp in the index between (floor/ceil ends with
    truncate); DeepSeek-V3's mscale = mscale_all_dim = 1 leaves the tables
    unscaled and multiplies the softmax scale by (0.1 ln 40 + 1)^2; the
    rotary op and its backward stay each other's transpose with scaled tables."""
    dr, theta, L = 64, 10000.0, 4096
    released = yarn.YarnScaling(factor=40.0, original_max_position_embeddings=L, mscale=1.0, mscale_all_dim=1.0)
    f = 1.0 / theta ** (np.arange(0, dr, 2) / dr)                                    # (32,)
    turns = L * f / (2 * np.pi)
    got = ops.rope_inv_freq(dr, theta, released)
    np.testing.assert_array_equal(got[turns > 32], f[turns > 32])
    np.testing.assert_allclose(got[turns < 1], f[turns < 1] / 40, rtol=1e-15)
    low = np.floor(dr * np.log(L / (32 * 2 * np.pi)) / (2 * np.log(theta)))
    high = np.ceil(dr * np.log(L / (2 * np.pi)) / (2 * np.log(theta)))
    m = np.arange(dr // 2)
    ramp = np.clip((m - low) / (high - low), 0, 1)
    assert 0 < ramp[m == low + 1][0] < 1
    np.testing.assert_allclose(got, f / 40 * ramp + f * (1 - ramp), rtol=1e-15)
    assert released.table_factor == 1.0 and released.softmax_factor == pytest.approx((0.1 * np.log(40) + 1) ** 2)
    assert yarn.YarnScaling(40.0, L).softmax_factor == 1.0 and yarn.YarnScaling(40.0, L).table_factor > 1
    assert yarn.YarnScaling(40.0, L, attention_factor=0.5).table_factor == 0.5
    cos, sin = ops.rope_tables(np.arange(5), 8, 100.0, YARN)
    assert np.allclose(cos[0], YARN.table_factor) and YARN.table_factor != 1.0
    rng = np.random.default_rng(3)
    x, dy = rng.normal(size=(2, 5, 3, 8)), rng.normal(size=(2, 5, 3, 8))
    for inter in (True, False):                                  # <R x, dy> == <x, R^T dy>
        assert np.sum(mla.rotary_forward(x, cos, sin, inter) * dy) == pytest.approx(
            np.sum(x * mla.rotary_backward(dy, cos, sin, inter)), rel=1e-13)


def test_interleaved_rotary_is_deepseeks_pairwise_rotation():
    """rotary_forward(interleaved) = rotating pairs (x_2m, x_2m+1) by angle pos * f_m, de-interleaved."""
    rng = np.random.default_rng(4)
    T, dr = 3, 6
    x = rng.normal(size=(1, T, 2, dr))
    cos, sin = ops.rope_tables(np.arange(T) + 5, dr, 50.0)
    got = mla.rotary_forward(x, cos, sin, interleaved=True)
    ang = (np.arange(T) + 5)[:, None] * (1.0 / 50.0 ** (np.arange(0, dr, 2) / dr))[None, :]    # (T, dr/2)
    c, s = np.cos(ang)[None, :, None, :], np.sin(ang)[None, :, None, :]
    even, odd = x[..., 0::2], x[..., 1::2]
    np.testing.assert_allclose(got, np.concatenate([even * c - odd * s, odd * c + even * s], -1), rtol=1e-14)
    np.testing.assert_array_equal(mla.interleave(mla.deinterleave(x)), x)


def test_decode_with_latent_cache_equals_full_attention():
    """Prefill 3 positions, then 1 and 2 at a time through the latent cache:
    the outputs equal the full causal core's rows."""
    rng = np.random.default_rng(5)
    B, T, nh = 2, 6, 2
    dims = mla.MlaDims(nope=3, rope=4, v=5, kv_rank=4)
    q = rng.normal(size=(B, T, nh * dims.qk))
    c_kv = rng.normal(size=(B, T, dims.kv_rank))                      # normed latent
    w_up = rng.normal(size=(dims.kv_rank, nh * (dims.nope + dims.v)))   # kv_up (rkv, nh (dn + dv))
    k_pe = rng.normal(size=(B, T, dims.rope))
    cos, sin = ops.rope_tables(np.arange(T), dims.rope, 10000.0)
    full, _ = mla.attention_forward(q, c_kv @ w_up, k_pe, nh, dims, cos, sin)
    cache = mla.LatentCache(np, B, T, dims, np.float64)
    for t0, t1 in [(0, 3), (3, 4), (4, 6)]:
        cache.append(c_kv[:, t0:t1], mla.rotate_k_pe(k_pe[:, t0:t1], cos[t0:t1], sin[t0:t1], dims.interleaved))
        lat, kpe = cache.view()
        y = mla.decode_forward(q[:, t0:t1], lat @ w_up, kpe, nh, dims, cos[t0:t1], sin[t0:t1], q0=t0)
        np.testing.assert_allclose(y, full[:, t0:t1], rtol=1e-12, atol=1e-13)
    assert cache.c_kv.shape == (B, T, dims.kv_rank) and cache.k_pe.shape == (B, T, dims.rope)
    with pytest.raises(ValueError, match="holds 6 positions"):
        cache.append(c_kv[:, :1], k_pe[:, :1])


# --- the router ----------------------------------------------------------------
def test_group_limited_topk_known_answer_with_ties():
    # 8 experts, 4 groups of 2: group sums (biased) 0.9+0.1=1.0, 0.5+0.5=1.0, 0.7+0.2=0.9, 1.0+0.0=1.0
    choice = np.array([[0.9, 0.1, 0.5, 0.5, 0.7, 0.2, 1.0, 0.0]])
    # top-2 groups: three tie at 1.0 -> the lower indices 0 and 1 stay; group 3 (expert 6, 1.0) is excluded
    chosen = router.group_limited_topk(choice, top_k=3, n_groups=4, topk_groups=2)
    np.testing.assert_array_equal(chosen, [[0, 2, 3]])               # 0.9, then the tie 0.5/0.5 in index order
    # one group: plain top-k, ties to the lower index
    np.testing.assert_array_equal(router.group_limited_topk(choice, 4, 1, 1), [[6, 0, 4, 2]])
    # a group's score is its TWO best, not its max: group 1 (0.6 + 0.6) beats group 0 (1.0 + 0.0)
    choice = np.array([[1.0, 0.0, 0.6, 0.6]])
    np.testing.assert_array_equal(router.group_limited_topk(choice, 1, 2, 1), [[2]])


def test_route_bias_steers_choice_but_not_weights():
    logits = np.array([[2.0, 1.0, 0.0, -1.0]])
    bias = np.array([0.0, 0.0, 0.0, 5.0])
    scores, chosen, weights, _ = router.route(logits, bias, top_k=2, norm_topk=True, scaling=2.5)
    s = 1.0 / (1.0 + np.exp(-logits[0]))
    np.testing.assert_array_equal(chosen, [[3, 0]])                   # the bias pulls expert 3 in
    np.testing.assert_allclose(weights, [[2.5 * s[3] / (s[3] + s[0]), 2.5 * s[0] / (s[3] + s[0])]], rtol=1e-15)
    _, _, raw, _ = router.route(logits, bias, top_k=2, norm_topk=False, scaling=1.0)
    np.testing.assert_allclose(raw, [[s[3], s[0]]], rtol=1e-15)


@pytest.mark.parametrize("norm_topk", [True, False])
def test_route_backward_matches_finite_differences(norm_topk):
    rng = np.random.default_rng(6)
    n, E = 5, 8
    logits, bias = rng.normal(size=(n, E)), rng.normal(size=E) * 0.1
    G = rng.normal(size=(n, 3))

    def loss():
        return float((router.route(logits, bias, 3, 4, 2, norm_topk, 2.5)[2] * G).sum())

    _, chosen, _, tape = router.route(logits, bias, 3, 4, 2, norm_topk, 2.5)
    assert_grad(router.route_backward(G, tape), loss, logits)


def test_seq_aux_loss_backward_matches_finite_differences():
    rng = np.random.default_rng(7)
    B, T, E, K = 2, 6, 8, 2
    logits, bias = rng.normal(size=(B * T, E)), np.zeros(E)
    _, chosen, _, _ = router.route(logits, bias, K)                  # the choice is fixed under the small steps

    def loss():
        scores = router.sigmoid(logits).reshape(B, T, E)
        return float(router.seq_aux_forward(scores, chosen.reshape(B, T, K), 0.01, T, B)[0])

    scores, chosen, weights, tape = router.route(logits, bias, K)
    value, aux_tape = router.seq_aux_forward(scores.reshape(B, T, E), chosen.reshape(B, T, K), 0.01, T, B)
    dscores = router.seq_aux_backward(1.0, aux_tape).reshape(B * T, E)
    dlogits = router.route_backward(np.zeros_like(weights), tape, dscores_all=dscores)
    assert_grad(dlogits, loss, logits)
    # known answer: f_e = E/(K T) * choices, P_e = mean of s/sum(s); balanced-by-construction check
    s = scores.reshape(B, T, E)
    counts = np.stack([np.bincount(chosen.reshape(B, T * K)[b], minlength=E) for b in range(B)])
    want = 0.01 * sum(((E / (K * T)) * counts[b] * (s[b] / s[b].sum(-1, keepdims=True)).mean(0)).sum()
                      for b in range(B)) / B
    assert value == pytest.approx(want, rel=1e-14)


def test_bias_update_sign_and_centring():
    bias = np.zeros(4, dtype=np.float32)
    loads = np.array([10, 2, 4, 8])                                  # mean 6
    np.testing.assert_array_equal(router.bias_update(bias, loads, 0.001),
                                  np.array([-0.001, 0.001, 0.001, -0.001], dtype=np.float32))
    loads = np.array([9, 3, 6, 6])                                   # mean 6: experts 2, 3 at the mean keep theirs
    np.testing.assert_array_equal(router.bias_update(np.ones(4), loads, 0.5), [0.5, 1.5, 1.0, 1.0])
    loads = np.array([1, 1, 1, 9])                                   # mean 3: updates +r +r +r -r, mean r/2
    centred = router.bias_update(np.zeros(4), loads, 1.0, centred=True)
    np.testing.assert_array_equal(centred, [0.5, 0.5, 0.5, -1.5])
    assert centred.sum() == 0.0
    assert router.bias_update(bias, loads, 1.0).dtype == np.float32
    np.testing.assert_array_equal(router.expert_loads(np.array([[0, 3], [3, 1]]), 5), [1, 1, 0, 2, 0])


# --- multi-token prediction ----------------------------------------------------
def test_mtp_depth_tokens_shift_and_mask():
    y = np.array([[11, 12, 13, 14, 15]])                             # y_i = t_{i+1}
    ids, tgt, valid = mtp.depth_tokens(y, 2)
    np.testing.assert_array_equal(ids, [[12, 13, 14, 0, 0]])         # t_{i+2} = y_{i+1}
    np.testing.assert_array_equal(tgt, [[13, 14, 15, 0, 0]])         # t_{i+3} = y_{i+2}
    np.testing.assert_array_equal(valid, [[True, True, True, False, False]])
    assert not mtp.depth_tokens(y, 5)[2].any()


def test_mtp_input_and_projection_backward_match_finite_differences():
    rng = np.random.default_rng(8)
    B, T, C = 2, 3, 4
    hid, emb = rng.normal(size=(B, T, C)), rng.normal(size=(B, T, C))
    wh, we, wp = rng.normal(size=C), rng.normal(size=C), rng.normal(size=(2 * C, C))
    G = rng.normal(size=(B, T, C))

    def loss():
        u, _ = mtp.input_forward(hid, emb, wh, we, C, 1e-6)
        return float((mtp.project_forward(u, wp) * G).sum())

    u, tape = mtp.input_forward(hid, emb, wh, we, C, 1e-6)
    np.testing.assert_allclose(u[..., :C], ops.rmsnorm_forward(emb, we, C, 1e-6)[0], rtol=1e-15)   # embedding first
    dwh, dwe, dwp = np.zeros(C), np.zeros(C), np.zeros((2 * C, C))
    du = mtp.project_backward(G, u, wp, dwp)
    dhid, demb = mtp.input_backward(du, tape, wh, we, dwh, dwe, C)
    for analytic, x in [(dhid, hid), (demb, emb), (dwh, wh), (dwe, we), (dwp, wp)]:
        assert_grad(analytic, loss, x)


def test_mtp_loss_weights_each_depth_by_its_global_count():
    loss, depth_losses, scales = mtp.combine_losses(20.0, [9.0, 16.0], 10, [9, 8], weight=0.3)
    assert depth_losses == [1.0, 2.0]
    assert loss == pytest.approx(2.0 + 0.3 / 2 * (1.0 + 2.0), rel=1e-15)
    assert scales == pytest.approx([0.1, 0.3 / (2 * 9), 0.3 / (2 * 8)], rel=1e-15)
