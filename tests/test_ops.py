"""Finite-difference checks (float64) of every local op and of the whole
serial model: analytic backward == central differences to 1e-6 relative."""

from types import SimpleNamespace

import numpy as np
import pytest

from mpicube import ops
from mpicube.parallel.layouts.modules import DenseLinear, LayerNorm

EPS = 1e-6
RTOL = 1e-6
rng = np.random.default_rng(0)


def numeric_grad(f, x):
    """Central differences of the scalar f() with respect to array x (in place)."""
    grad = np.zeros_like(x)
    flat, gflat = x.reshape(-1), grad.reshape(-1)
    for i in range(flat.size):
        old = flat[i]
        flat[i] = old + EPS
        up = f()
        flat[i] = old - EPS
        down = f()
        flat[i] = old
        gflat[i] = (up - down) / (2 * EPS)
    return grad


def assert_close(analytic, numeric):
    err = np.abs(analytic - numeric).max() / np.abs(numeric).max()
    assert err < RTOL, f"relative error {err:.2e}"


def test_layernorm():
    x, gamma, beta = rng.normal(size=(2, 3, 5)), rng.normal(size=5), rng.normal(size=5)
    r = rng.normal(size=(2, 3, 5))
    loss = lambda: float((ops.layernorm_forward(x.copy(), gamma, beta, 5)[0] * r).sum())
    y, cache = ops.layernorm_forward(x.copy(), gamma, beta, 5)
    dgamma, dbeta = np.zeros(5), np.zeros(5)
    dx = ops.layernorm_backward(r, cache, gamma, dgamma, dbeta, 5)
    assert_close(dx, numeric_grad(loss, x))
    assert_close(dgamma, numeric_grad(loss, gamma))
    assert_close(dbeta, numeric_grad(loss, beta))


def test_layernorm_module_accumulates():
    store = SimpleNamespace(data={"ln.weight": rng.normal(size=4), "ln.bias": rng.normal(size=4)},
                            grad={"ln.weight": np.ones(4), "ln.bias": np.ones(4)})
    store.work = store.data                 # the working copy the layers read: the master itself here
    ln = LayerNorm(store, "ln", 4)
    x, r = rng.normal(size=(1, 2, 4)), rng.normal(size=(1, 2, 4))
    ln.backward(r, ln.forward(x)[1])
    ln.backward(r, ln.forward(x)[1])
    one = np.zeros(4)
    _, cache = ops.layernorm_forward(x.copy(), store.data["ln.weight"], store.data["ln.bias"], 4)
    ops.layernorm_backward(r, cache, store.data["ln.weight"], one, np.zeros(4), 4)
    np.testing.assert_allclose(store.grad["ln.weight"], 1 + 2 * one, rtol=1e-12)


def test_gelu():
    x, r = rng.normal(size=(3, 7)) * 2, rng.normal(size=(3, 7))
    loss = lambda: float((ops.gelu_forward(x)[0] * r).sum())
    y, cache = ops.gelu_forward(x)
    assert_close(ops.gelu_backward(r, cache), numeric_grad(loss, x))
    # GPT-2's tanh approximation, not the exact erf form
    v = np.array([1.0])
    expected = 0.5 * (1 + np.tanh(np.sqrt(2 / np.pi) * (1 + 0.044715)))
    np.testing.assert_allclose(ops.gelu_forward(v)[0], expected, rtol=1e-14)


@pytest.mark.parametrize("dropout", [False, True])
def test_attention(dropout):
    B, T, nh, hd = 2, 4, 3, 2
    qkv, r = rng.normal(size=(B, T, 3 * nh * hd)), rng.normal(size=(B, T, nh * hd))
    keep = (rng.random((B, nh, T, T)) > 0.3).astype(float) if dropout else None
    loss = lambda: float((ops.attention_forward(qkv, nh, keep, 0.7)[0] * r).sum())
    y, cache = ops.attention_forward(qkv, nh, keep, 0.7)
    assert_close(ops.attention_backward(r, cache), numeric_grad(loss, qkv))


def test_attention_is_causal():
    B, T, nh, hd = 1, 5, 2, 3
    qkv = rng.normal(size=(B, T, 3 * nh * hd))
    y, _ = ops.attention_forward(qkv, nh)
    changed = qkv.copy()
    changed[:, 3:] += 1.0                         # the future of positions 0..2
    y2, _ = ops.attention_forward(changed, nh)
    np.testing.assert_array_equal(y[:, :3], y2[:, :3])
    assert not np.allclose(y[:, 3:], y2[:, 3:])


def test_cross_entropy_with_padding():
    n, V, real = 6, 7, 5                           # last two columns are padding
    logits = rng.normal(size=(n, V))
    targets = rng.integers(0, real, n)
    loss = lambda: float(ops.cross_entropy_forward(logits, targets, 0, real)[0].sum())
    row_loss, cache = ops.cross_entropy_forward(logits, targets, 0, real)
    ref = -np.log(np.exp(logits[:, :real]) / np.exp(logits[:, :real]).sum(1, keepdims=True))[np.arange(n), targets]
    np.testing.assert_allclose(row_loss, ref, rtol=1e-12)
    dlogits = ops.cross_entropy_backward(1.0, cache)
    assert_close(dlogits, numeric_grad(loss, logits))
    assert np.all(dlogits[:, real:] == 0)


def test_embedding_block():
    weight = rng.normal(size=(4, 3))               # vocabulary ids 5..8
    ids = np.array([[5, 9, 8], [2, 5, 6]])
    r = rng.normal(size=(2, 3, 3))
    out, cache = ops.embedding_forward(ids, weight, 5)
    np.testing.assert_array_equal(out[0, 0], weight[0])
    np.testing.assert_array_equal(out[0, 1], 0.0)   # id 9 belongs to another rank
    loss = lambda: float((ops.embedding_forward(ids, weight, 5)[0] * r).sum())
    dweight = np.zeros_like(weight)
    ops.embedding_backward(r, cache, dweight)
    assert_close(dweight, numeric_grad(loss, weight))


def test_dense_linear():
    from mpicube.device.backend import make_backend
    from mpicube.parallel.params import ParamDecl, ParamSpec, ParamStore

    specs = [ParamSpec(ParamDecl("l.weight", (4, 5), "w_column", "normal", 1.0), (np.arange(4), np.arange(5))),
             ParamSpec(ParamDecl("l.bias", (5,), "b_column", "normal", 1.0), (np.arange(5),))]
    store = ParamStore(specs, make_backend("cpu", "float64"), seed=2)
    store.zero_grad()
    lin = DenseLinear(store, "l")
    x, r = rng.normal(size=(2, 3, 4)), rng.normal(size=(2, 3, 5))
    loss = lambda: float((DenseLinear(store, "l").forward(x)[0] * r).sum())
    _, saved = lin.forward(x)
    dx = lin.backward(r, saved)
    assert_close(dx, numeric_grad(loss, x))
    assert_close(store.grad["l.weight"], numeric_grad(loss, store.data["l.weight"]))
    assert_close(store.grad["l.bias"], numeric_grad(loss, store.data["l.bias"]))


def check_whole_model_gradient(cfg):
    """d loss / d every parameter of the serial model ``cfg`` describes,
    dropout on, against central differences; returns the store (callers
    check its size). Every model family runs through this one check."""
    from mpi4py import MPI

    from mpicube.device.backend import make_backend
    from mpicube.parallel.grid import build_layout
    from mpicube.parallel.planning import resolve
    from mpicube.model.gpt import gpt_params
    from mpicube.parallel.params import ParamStore
    from mpicube.training.driver import make_runner

    backend = make_backend("cpu", "float64")
    layout = build_layout(resolve("serial", cfg, 3, 1), backend, MPI.COMM_SELF)
    store = ParamStore([layout.shard(d) for d in gpt_params(cfg)], backend, seed=1)
    size = store.flat.size
    store.flat[:] += rng.normal(0, 0.1, store.flat.shape)   # generic norm weights and biases
    model = make_runner(cfg, layout, store, dropout=0.1, seed=3)
    idx, tgt = rng.integers(0, cfg.vocab_size, (3, 5)), rng.integers(0, cfg.vocab_size, (3, 5))
    store.zero_grad()
    model.forward(idx, tgt, step=2)
    model.backward()
    analytic = store.flat_grad.copy()
    numeric = numeric_grad(lambda: model.forward(idx, tgt, step=2), store.flat)
    for spec in store.specs:
        lo, hi = store.offsets[spec.name]
        err = np.abs(analytic[lo:hi] - numeric[lo:hi]).max() / np.abs(numeric).max()
        assert err < RTOL, f"{spec.name}: relative error {err:.2e}"
    return size


def test_whole_model_gradient():
    """d loss / d every parameter of the serial GPT, with dropout on."""
    from mpicube.core.config import ModelConfig

    check_whole_model_gradient(ModelConfig(vocab_size=11, n_ctx=5, n_layer=2, n_head=2, n_embd=8))


def test_row_reductions_are_accurate_in_float32():
    """Bias and LayerNorm parameter gradients sum over every token row; over
    4M rows of one sign a running float32 sum is off by percents. Measured
    through the ops the layers call, against float64."""
    from mpicube.device.backend import make_backend
    from mpicube.parallel.params import ParamDecl, ParamSpec, ParamStore

    n, C = 1 << 22, 2
    dy = rng.uniform(0.5, 1.5, (n, C)).astype(np.float32)                 # (n, C)
    xhat = rng.uniform(0.5, 1.5, (n, C)).astype(np.float32)               # (n, C)
    want_sum = dy.astype(np.float64).sum(0)
    want_dot = (dy.astype(np.float64) * xhat).sum(0)
    for got, want in ((ops.column_sums(dy), want_sum), (ops.column_dots(dy, xhat), want_dot)):
        assert got.dtype == np.float32
        assert np.abs(got - want).max() / np.abs(want).max() < 1e-6

    # the same through a layer: the bias gradient of a linear over those rows
    specs = [ParamSpec(ParamDecl("l.weight", (C, C), "w_column", "normal", 1.0), (np.arange(C), np.arange(C))),
             ParamSpec(ParamDecl("l.bias", (C,), "b_column", "zeros"), (np.arange(C),))]
    store = ParamStore(specs, make_backend("cpu", "float32"), seed=2)
    store.zero_grad()
    lin = DenseLinear(store, "l")
    lin.backward(dy.reshape(1, n, C), lin.forward(xhat.reshape(1, n, C))[1])
    assert np.abs(store.grad["l.bias"] - want_sum).max() / np.abs(want_sum).max() < 1e-6

    gamma = np.ones(C, np.float32)
    dgamma, dbeta = np.zeros(C, np.float32), np.zeros(C, np.float32)
    ops.layernorm_backward(dy.reshape(1, n, C), (xhat.reshape(1, n, C), np.ones((1, n, 1), np.float32)),
                           gamma, dgamma, dbeta, C)
    assert np.abs(dbeta - want_sum).max() / np.abs(want_sum).max() < 1e-6
    assert np.abs(dgamma - want_dot).max() / np.abs(want_dot).max() < 1e-6
