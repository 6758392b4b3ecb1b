"""The Llama family in float64: its ops against central differences and
their definitions, the whole serial model's gradient (grouped-query
attention, untied head, dropout on), and the configuration's defaults."""

import numpy as np
import pytest

from mpicube import ops
from mpicube.core.config import ModelConfig
from test_ops import assert_close, check_whole_model_gradient, numeric_grad

rng = np.random.default_rng(5)


def small_llama(**kw) -> ModelConfig:
    sizes = dict(vocab_size=11, n_ctx=5, n_layer=2, n_head=4, n_embd=8, arch="llama", n_kv_head=2, ffn_hidden=8,
                 rope_theta=50.0, rms_eps=1e-5)
    return ModelConfig(**{**sizes, **kw})


def test_rmsnorm():
    x, gamma, w = rng.normal(size=(2, 3, 6)), rng.normal(size=6), rng.normal(size=(2, 3, 6))
    y, cache = ops.rmsnorm_forward(x, gamma, 6, 1e-5)
    assert np.allclose(y, gamma * x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-5), rtol=1e-13)
    dgamma = np.zeros(6)
    dx = ops.rmsnorm_backward(w, cache, gamma, dgamma, 6)
    assert_close(dx, numeric_grad(lambda: (ops.rmsnorm_forward(x, gamma, 6, 1e-5)[0] * w).sum(), x))
    assert_close(dgamma, numeric_grad(lambda: (ops.rmsnorm_forward(x, gamma, 6, 1e-5)[0] * w).sum(), gamma))


def test_rope_is_hf_half_split_rotation():
    """Pair (m, m + hd/2) of a head rotates by pos * theta^(-2m/hd), and backward is its transpose."""
    T, hd, theta = 4, 6, 30.0
    pos = np.array([3, 0, 7, 2])
    cos, sin = ops.rope_tables(pos, hd, theta)                  # (T, hd)
    x, w = rng.normal(size=(2, T, 3, hd)), rng.normal(size=(2, T, 3, hd))
    y = ops.rope_forward(x, cos, sin)
    for m in range(hd // 2):
        a = pos * theta ** (-2 * m / hd)                        # (T,)
        c, s = np.cos(a)[None, :, None], np.sin(a)[None, :, None]
        x1, x2 = x[..., m], x[..., m + hd // 2]
        assert np.allclose(y[..., m], x1 * c - x2 * s, rtol=1e-13)
        assert np.allclose(y[..., m + hd // 2], x2 * c + x1 * s, rtol=1e-13)
    assert_close(ops.rope_backward(w, cos, sin), numeric_grad(lambda: (ops.rope_forward(x, cos, sin) * w).sum(), x))


def llama3_reference(f, factor, low, high, context):
    """Llama 3's scaled frequency of one inverse frequency f, band by band, as Meta's release states it."""
    wavelen = 2 * np.pi / f
    if wavelen < context / high:                 # fast: kept
        return f
    if wavelen > context / low:                  # slow: stretched factor times
        return f / factor
    s = (context / wavelen - low) / (high - low)
    return (1 - s) * f / factor + s * f


def test_llama3_rope_scaling_in_each_band_and_at_its_edges():
    """Each of 32 frequencies (over all three bands) as the band rule says; a
    wavelength exactly at a band's edge takes the blend's end value, which is
    its neighbour's (f / factor at the slow edge, f at the fast one), and just
    beside an edge the value moves by no more than rounding."""
    scaling = (8.0, 1.0, 4.0, 256)
    got = ops.rope_inv_freq(64, 10000.0, scaling)                               # (32,)
    base = ops.rope_inv_freq(64, 10000.0)
    assert np.array_equal(base, 1.0 / 10000.0 ** (np.arange(0, 64, 2) / 64))
    want = np.array([llama3_reference(f, *scaling) for f in base])
    fast, slow = (2 * np.pi / base < 256 / 4).sum(), (2 * np.pi / base > 256).sum()
    assert min(fast, slow, 32 - fast - slow) >= 3, (fast, slow)                  # every band is met
    assert np.allclose(got, want, rtol=1e-15, atol=0)
    # head size 2: the one frequency is 1.0, wavelength 2 pi, placed exactly on each edge
    for low, high, context, edge_value in ((1.0, 4.0, 2 * np.pi, 1.0 / 8.0), (1.0, 2.0, 4 * np.pi, 1.0)):
        assert ops.rope_inv_freq(2, 50.0, (8.0, low, high, context))[0] == edge_value
        for beside in (np.nextafter(context, 0), np.nextafter(context, 10 * context)):
            assert abs(ops.rope_inv_freq(2, 50.0, (8.0, low, high, beside))[0] - edge_value) < 1e-14
    cos, sin = ops.rope_tables(np.array([0, 5, 9]), 64, 10000.0, scaling)        # (3, 64): angles pos * f
    assert np.allclose(np.arctan2(sin[2, :32], cos[2, :32]), np.angle(np.exp(1j * 9 * want)), rtol=1e-12)
    assert np.array_equal(cos[:, :32], cos[:, 32:])


def test_rope_scaling_is_stored_and_checked():
    from mpicube.core.config import ModelConfig, RopeScaling

    cfg = small_llama(rope_scaling=RopeScaling(8.0, 1.0, 4.0, 16))
    stored = cfg.to_dict()["rope_scaling"]
    assert stored == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 16}
    assert ModelConfig.from_dict(cfg.to_dict()).rope_scaling == cfg.rope_scaling
    assert "rope_scaling" not in small_llama().to_dict()                         # unscaled: stored as before
    for bad, field in (({**stored, "factor": 0.5}, "factor"), ({**stored, "high_freq_factor": 1.0}, "low_freq_factor"),
                       ({k: v for k, v in stored.items() if k != "original_max_position_embeddings"},
                        "original_max_position_embeddings")):
        with pytest.raises(ValueError, match=f"rope_scaling.{field}"):
            ModelConfig.from_dict({**cfg.to_dict(), "rope_scaling": bad})


def test_swiglu():
    f, w = rng.normal(size=(3, 2, 8)), rng.normal(size=(3, 2, 4))
    y, saved = ops.swiglu_forward(f)
    gate, up = f[..., :4], f[..., 4:]
    assert np.allclose(y, gate / (1 + np.exp(-gate)) * up, rtol=1e-13)
    assert_close(ops.swiglu_backward(w, saved), numeric_grad(lambda: (ops.swiglu_forward(f)[0] * w).sum(), f))


def test_config_defaults_keep_gpt2_and_count_llama():
    gpt = ModelConfig(vocab_size=11, n_ctx=5, n_layer=2, n_head=2, n_embd=8)
    assert gpt.to_dict() == dict(vocab_size=11, n_ctx=5, n_layer=2, n_head=2, n_embd=8)
    assert ModelConfig.from_dict(gpt.to_dict()) == gpt
    cfg = small_llama()
    assert ModelConfig.from_dict(cfg.to_dict()).to_dict() == cfg.to_dict()
    from mpicube.model.gpt import gpt_params, param_names
    decls = gpt_params(cfg)
    assert [d.name for d in decls] == list(param_names(cfg))
    assert sum(int(np.prod(d.shape)) for d in decls) == cfg.n_params()
    assert ModelConfig(n_embd=4096, n_head=32, arch="llama").ffn == 11008      # Llama 2 7B's rule


def test_whole_llama_gradient():
    """d loss / d every parameter of the serial Llama (GQA, untied head, dropout on)."""
    cfg = small_llama()
    assert check_whole_model_gradient(cfg) == cfg.n_params()      # no biases, no position table


def test_kv_heads_must_divide_heads():
    from mpicube.core.errors import ConfigError
    from mpicube.model.gpt import gpt_params

    with pytest.raises(ConfigError, match="--n-kv-head 3 must divide --n-head 4"):
        gpt_params(small_llama(n_kv_head=3))


def test_head_split_must_hold_whole_kv_groups():
    """A head split s must divide n_kv (whole kv heads per rank) or be a
    multiple of it (one kv head shared by s / n_kv ranks): 12 heads over 4
    kv heads split 6 ways would give a rank queries of two kv heads, half
    of one. The plan refuses it before any communicator exists."""
    from mpicube.core.errors import ConfigError
    from mpicube.parallel.planning import resolve

    cfg = small_llama(n_head=12, n_embd=24, n_kv_head=4)
    with pytest.raises(ConfigError, match="--n-kv-head 4: the layout splits the heads 6 ways"):
        resolve("1d", cfg, 8, 6)
    for tp in (2, 4, 12):                                   # 2 divides 4; 4 is 4; 12 is a multiple of 4
        resolve("1d", cfg, 8, tp)


def test_heads_split_finer_than_kv_heads_share_them():
    """Each block of a split finer than the kv heads gets its whole query
    heads and the one kv head they read (query head i reads i // (n_head /
    n_kv)); ``shared_columns`` names those columns, at the block's end."""
    from mpicube.model.gpt import gpt_params
    from mpicube.parallel.params import shared_columns, split_decl

    cfg = small_llama(n_head=8, n_embd=16, n_kv_head=2)      # hd 2, 4 query heads per kv head
    decl = next(d for d in gpt_params(cfg) if d.name.endswith("c_attn.weight"))
    hd = cfg.head_dim
    for t in range(8):
        cols = split_decl(decl, 8, t)
        kv = t // 4
        assert list(cols) == [t * hd, t * hd + 1, 16 + kv * hd, 16 + kv * hd + 1, 20 + kv * hd, 20 + kv * hd + 1]

    class Four:                                               # a stand-in kv group of 4 ranks
        size = 4

    shared = shared_columns(decl, 8, 5, Four())
    assert shared.cols == slice(2, 6) and shared.share == 4 and not shared.writer
    assert shared_columns(decl, 8, 4, Four()).writer
    assert shared_columns(decl, 2, 1, None) is None           # 2 ways: each rank holds one whole kv head


def test_strided_pieces_cover_exactly_the_shared_columns_of_a_window():
    """The norm's correction under ZeRO reads a block's shared columns
    inside the chunk a rank owns: every window of a (5, 7) block's columns
    2..4, in the pieces strided_pieces gives, is exactly the positions a
    brute-force mask finds, each once."""
    from mpicube.parallel.gradients import strided_pieces

    lo, rows, width, cols = 3, 5, 7, slice(2, 5)
    buf = np.arange(60.0)
    want_mask = np.zeros(60, dtype=bool)
    for r in range(rows):
        want_mask[lo + r * width + cols.start:lo + r * width + cols.stop] = True
    for s in range(lo, lo + rows * width):
        for e in range(s + 1, lo + rows * width + 1):
            got = []
            for a, b, nrows, w, c in strided_pieces(lo, width, cols, s, e, shift=1):
                got += list(buf[a:b] if not nrows else buf[a:b].reshape(nrows, w)[:, c].reshape(-1))
            want = buf[np.flatnonzero(want_mask[s:e]) + s - 1]
            assert sorted(got) == sorted(want), (s, e)


def test_head_placement_is_drawn_from_the_layouts():
    """``info --heads``' table (analysis/heads.py): 1-D tp 8 over 2 kv heads
    gives ranks 0-3 kv head 0 and 4-7 kv head 1, one query head each; the
    3-D cube over 1 kv head shares it between j = 0 and 1 of each (i, k);
    2 kv heads on the cube are held whole (nothing summed)."""
    from mpicube.analysis.heads import head_placement

    cfg = small_llama(n_head=8, n_embd=16, n_kv_head=2)
    one_d = head_placement("1d", cfg, 8)
    assert [(r.q, r.kv, r.sharers) for r in one_d[:5]] == [([t], [0], [0, 1, 2, 3]) for t in range(4)] + [
        ([4], [1], [4, 5, 6, 7])]
    cube = head_placement("3d", small_llama(n_head=8, n_embd=16, n_kv_head=1), 8)
    assert [r.sharers for r in cube] == [[0, 2], [1, 3], [0, 2], [1, 3], [4, 6], [5, 7], [4, 6], [5, 7]]
    assert [r.q for r in cube[:4]] == [[0, 1, 2, 3]] * 2 + [[4, 5, 6, 7]] * 2
    assert all(len(r.sharers) == 1 for r in head_placement("3d", cfg, 8))


# Llama on every layout against serial: tests/test_combo_matrix.py's LLAMA_CASES
# (in the matrix's launches; the separate launches that stood here are retired).


def test_cached_decode_equals_the_full_forward():
    """Token-by-token decoding with the KV cache rotates each new row at its
    position and keeps the 2 kv heads only (not the 4 query heads' repeats):
    its logits are the training forward's (float64, serial)."""
    from mpi4py import MPI

    from mpicube.device.backend import make_backend
    from mpicube.model.gpt import gpt_params
    from mpicube.parallel.grid import build_layout
    from mpicube.parallel.params import ParamStore
    from mpicube.parallel.planning import resolve
    from mpicube.training.driver import make_runner

    cfg = small_llama(n_ctx=6)
    backend = make_backend("cpu", "float64")
    layout = build_layout(resolve("serial", cfg, 2, 1), backend, MPI.COMM_SELF)
    store = ParamStore([layout.shard(d) for d in gpt_params(cfg)], backend, seed=2)
    store.flat[:] += rng.normal(0, 0.3, store.flat.shape)
    model = make_runner(cfg, layout, store)
    idx = rng.integers(0, 11, (2, 6))
    full = model.full_logits(idx)                                        # (2, 6, V)
    caches = model.new_caches()
    assert caches[0].k.shape == (2, 2, 6, 2)                             # (B, n_kv, n_ctx, hd): kv heads only
    steps = [model.decode(idx[:, :2], 0, caches)] + [model.decode(idx[:, t:t + 1], t, caches) for t in range(2, 6)]
    assert np.allclose(np.concatenate(steps, axis=1), full, rtol=1e-12, atol=1e-12)
