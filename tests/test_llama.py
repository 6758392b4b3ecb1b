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


def test_head_split_finer_than_kv_heads_is_refused():
    """Each rank must hold whole kv heads (replicating them is not implemented yet)."""
    from mpicube.core.errors import ConfigError
    from mpicube.model.llama import RotaryAttention

    with pytest.raises(ConfigError, match="splits the heads 4 ways"):
        RotaryAttention(small_llama(), ops, head_ids=np.arange(1))          # 4 heads, 2 kv heads, split 4 ways


# one launch each: GQA's kv heads split with their queries; under cp 2 each rank's
# rows are two chunks of every sequence, rotated at their global positions
LAYOUT_CASES = [(2, "1d", 1), (4, "2d", 1), (8, "3d", 1), (4, "1d", 2)]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("ranks,layout,cp", LAYOUT_CASES, ids=[f"{c[1]}-n{c[0]}-cp{c[2]}" for c in LAYOUT_CASES])
def test_llama_layout_matches_serial(ranks, layout, cp):
    """Llama training (dropout on, batch 8) follows serial to 1e-10 in float64 on
    the layout: loss, logits, every gradient, the parameters after three steps."""
    from mpirun import mpiexec

    proc = mpiexec(ranks, ["-m", "mpi4py", "tests/parallel_check.py", layout, 1, 1, 0.1, 8], timeout=180,
                   env={"MPICUBE_CHECK_ARCH": "llama", "MPICUBE_CHECK_CP": str(cp)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"OK {layout} world={ranks} dp=1 depth=1" in proc.stdout and f"cp={cp}" in proc.stdout
    assert "arch=llama" in proc.stdout


def test_cached_decode_equals_the_full_forward():
    """Token-by-token decoding with the KV cache rotates each new row at its
    position: its logits are the training forward's (float64, serial)."""
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
    steps = [model.decode(idx[:, :2], 0, caches)] + [model.decode(idx[:, t:t + 1], t, caches) for t in range(2, 6)]
    assert np.allclose(np.concatenate(steps, axis=1), full, rtol=1e-12, atol=1e-12)
