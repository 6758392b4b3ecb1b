"""The fused numba kernels (mpicube.device.fused) against the NumPy code they stand
in for, through the public ops, optimizer and ParamStore: every op, AdamW and
a whole training step agree up to rounding, NaN still propagates, and
deferred gradient zeroing neither leaves stale sums nor loses accumulation."""

from contextlib import contextmanager

import numpy as np
import pytest
from mpi4py import MPI

from conftest import paired

from mpicube.device import fused, gemm_threads
from mpicube.device import threads as thread_share
from mpicube import ops
from mpicube.device.backend import make_backend
from mpicube.core.config import ModelConfig
from mpicube.core.errors import UserError
from mpicube.model.gpt import gpt_params
from mpicube.training.optim import AdamW
from mpicube.parallel.params import ParamStore
from mpicube.parallel.planning import resolve
from mpicube.training.parts import Numerics
from mpicube.training.train import build_parts

pytest.importorskip("numba")        # mpicube.device.fused imports without it, but then has nothing to test

DTYPES = [np.float64, np.float32]
TOL = {np.float64: (1e-12, 1e-12), np.float32: (1e-5, 1e-5)}        # (rtol, atol per unit of scale)
CFG = ModelConfig(vocab_size=61, n_ctx=16, n_layer=2, n_head=4, n_embd=32)
rng = np.random.default_rng(0)


@contextmanager
def kernels(on: bool, check: bool = True, variant: str | None = None):
    """fused.use(on) inside the block, the previous setting after it. On, the
    kernels (and the batch split of attention's GEMMs) apply at every size
    (no minimum work, at least 2 threads) and, if
    ``check``, every fused.active call inside must say True (else the
    comparison would be NumPy against NumPy); off, every one False.
    ``variant`` ("threaded" or "one_thread") forces that compilation of
    every kernel (fused._Kernel), which otherwise the size decides."""
    numba, real_active, answers = fused.numba, fused.active, []
    if on and numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("the fused kernels need at least 2 numba threads")
    threads, min_elems, min_macs = numba.get_num_threads(), fused.PARALLEL_MIN_ELEMS, gemm_threads.SPLIT_MIN_MACS
    active = thread_share.active()
    previous = fused.use(on)
    fused.active = lambda *arrays: answers.append(real_active(*arrays)) or answers[-1]
    if on:
        thread_share.set_pool_threads(max(2, threads))      # numba's workers and the GEMM panels' threads
        fused.PARALLEL_MIN_ELEMS = gemm_threads.SPLIT_MIN_MACS = 0
    try:
        with fused.forced_build(variant if on else None):
            yield
    finally:
        fused.active = real_active
        fused.use(previous)
        thread_share.set_pool_threads(active)
        numba.set_num_threads(threads)
        fused.PARALLEL_MIN_ELEMS, gemm_threads.SPLIT_MIN_MACS = min_elems, min_macs
    if check:                                     # on: fused everywhere; off: nowhere
        assert (answers and all(answers)) if on else not any(answers), f"active() said {answers}"


def both(f):
    """(f() with the fused kernels, f() with NumPy)."""
    with kernels(True):
        on = f()
    with kernels(False):
        return on, f()


def assert_same(on, off, dtype):
    """Elementwise to rtol, and to atol times the array's scale (float32 sums
    of many terms cancel to small results that carry the terms' rounding)."""
    rtol, atol = TOL[dtype]
    for a, b in zip(on, off):
        np.testing.assert_allclose(a, b, rtol=rtol, atol=atol * max(1.0, float(np.abs(b).max(initial=0))))


def normal(shape, dtype=np.float64, loc=0.0, scale=1.0):
    return rng.normal(loc, scale, shape).astype(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1, 1), (1, 1, 5), (2, 5, 7), (4, 256, 192)])
def test_layernorm(shape, dtype):
    """Forward (y, xhat, rstd) and backward (dx; dgamma, dbeta added onto what
    they held) agree, from one column to a size worth threads."""
    C = shape[-1]
    x, dy, gamma, beta = normal(shape, dtype, 1, 2), normal(shape, dtype), normal(C, dtype, 1), normal(C, dtype)

    def run():
        y, (xhat, rstd) = ops.layernorm_forward(x.copy(), gamma, beta, C)
        dgamma, dbeta = np.ones(C, dtype), np.full(C, 2.0, dtype)
        dx = ops.layernorm_backward(dy, (xhat, rstd), gamma, dgamma, dbeta, C)
        return y, xhat, rstd, dx, dgamma, dbeta

    on, off = both(run)
    assert [a.shape for a in on] == [b.shape for b in off]
    assert_same(on, off, dtype)


def test_layernorm_split_hidden_allsum():
    """A rank holding half the hidden columns, whose allsum adds the other
    half's partial sums, reproduces those columns of the full LayerNorm: both
    paths must send all three row reductions through allsum, in order."""
    B, T, C, h = 2, 3, 8, 4
    x, dy, gamma, beta = normal((B, T, C), loc=0.5, scale=2), normal((B, T, C)), normal(C), normal(C)
    with kernels(False):
        y, (xhat, rstd) = ops.layernorm_forward(x.copy(), gamma, beta, C)
        dx = ops.layernorm_backward(dy, (xhat, rstd), gamma, np.zeros(C), np.zeros(C), C)
    xo, go = x[..., h:], dy[..., h:] * gamma[h:]                  # the other rank's columns
    partials = [xo.sum(-1), ((xo - x.mean(-1, keepdims=True)) ** 2).sum(-1),
                np.stack([go.sum(-1), (go * xhat[..., h:]).sum(-1)], -1)]

    def run():
        pending = list(partials)
        allsum = lambda s: s + pending.pop(0).reshape(s.shape)    # noqa: E731
        mine = lambda a: np.ascontiguousarray(a[..., :h])         # noqa: E731
        y_h, cache = ops.layernorm_forward(mine(x), mine(gamma), mine(beta), C, allsum=allsum)
        dx_h = ops.layernorm_backward(mine(dy), cache, mine(gamma), np.zeros(h), np.zeros(h), C, allsum=allsum)
        assert not pending, "allsum called fewer than three times"
        return y_h, cache[1], dx_h

    for got in both(run):
        assert_same(got, (y[..., :h], rstd, dx[..., :h]), np.float64)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1, 1), (2, 5, 12), (4, 128, 2048)])
def test_gelu(shape, dtype):
    """GELU's forward (y and the cached tanh) and backward agree."""
    x, dy = normal(shape, dtype, 0, 2), normal(shape, dtype)

    def run():
        y, cache = ops.gelu_forward(x)
        return y, cache[1], ops.gelu_backward(dy, cache)

    assert_same(*both(run), dtype)


@pytest.mark.parametrize("dropout", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,nh,T,hd", [(1, 1, 1, 4), (1, 3, 5, 4), (2, 3, 5, 4), (3, 8, 256, 8)])
def test_attention(B, nh, T, hd, dtype, dropout):
    """Attention forward (y) and backward (dqkv) agree with and without a
    dropout mask; the last shape has 1<<20 scores."""
    qkv, dy = normal((B, T, 3 * nh * hd), dtype), normal((B, T, nh * hd), dtype)
    keep = (rng.random((B, nh, T, T)) < 0.8).astype(dtype) if dropout else None

    def run():
        y, cache = ops.attention_forward(qkv, nh, keep, 0.8)
        return y, ops.attention_backward(dy, cache)

    assert_same(*both(run), dtype)


def test_softmax_nan_and_causal_zeros():
    """Fused causal softmax: a NaN score on or below the diagonal makes its
    row NaN (divergence is never hidden), other rows are untouched, and the
    upper triangle is exactly zero and never read (an inf there is ignored)."""
    s, d = normal((3, 6, 6)), normal((3, 6, 6))
    nans = [(0, 0, 0), (1, 4, 2), (2, 5, 5)]
    for m, i, j in nans:
        s[m, i, j] = np.nan
    s[0, 2, 4] = np.inf                                           # above the diagonal
    ref, p = s.copy(), s.copy()
    ref[0, 2, 4] = 0.0
    with kernels(False):
        ops.causal_softmax(ref)
    with kernels(True):
        ops.causal_softmax(p)
        ops.causal_softmax_backward(d, p)
    upper = np.triu(np.ones((6, 6), bool), 1)
    assert np.all(p[:, upper] == 0) and np.all(d[:, upper] == 0)
    bad = np.zeros(p.shape, bool)
    for m, i, _ in nans:
        bad[m, i, : i + 1] = True
        assert np.isnan(p[m, i, : i + 1]).all() and np.isnan(d[m, i, : i + 1]).all()
    good = ~bad & ~upper
    np.testing.assert_allclose(p[good], ref[good], rtol=1e-12)
    assert np.isfinite(d[good]).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,T,V,C,start", [(1, 1, 3, 2, 0), (3, 16, 5, 8, 4), (8, 256, 50, 64, 100)])
def test_embedding_backward(B, T, V, C, start, dtype):
    """Embedding backward adds every position into its row, repeated ids
    summed, ids outside the block [start, start+V) dropped."""
    ids = rng.integers(max(0, start - 3), start + V + 3, (B, T))
    ids[0, 0] = start
    weight, dy = normal((V, C), dtype), normal((B, T, C), dtype)
    _, cache = ops.embedding_forward(ids, weight, start)
    expected = np.ones((V, C))
    for (b, t), i in np.ndenumerate(ids):
        if start <= i < start + V:
            expected[i - start] += dy[b, t]
    on, off = both(lambda: [ops.embedding_backward(dy, cache, dw) or dw for dw in [np.ones((V, C), dtype)]])
    assert_same(on, off, dtype)
    assert_same(on, [expected], dtype)


def tiny_parts(dropout=0.0, dtype="float64"):
    return build_parts(resolve("serial", CFG, 3, 1), MPI.COMM_SELF, Numerics(dtype), seed=5, dropout=dropout)


def step_grads(parts, x, y, step=1):
    loss = parts.model.forward(x, y, step=step)
    parts.model.backward()
    return loss


@pytest.mark.parametrize("dtype", DTYPES)
def test_adamw(dtype):
    """Three AdamW steps with weight decay and grad_scale != 1 leave the same
    params and moments with either kernel set, and the gradients unchanged
    (in float32 both compute in float32)."""
    name = np.dtype(dtype).name
    runs, grads = {}, [rng.normal(size=tiny_parts().store.flat.size).astype(dtype) for _ in range(3)]
    for on in (True, False):
        store = tiny_parts(dtype=name).store
        assert store.flat.dtype == dtype
        opt = AdamW(store, weight_decay=0.1)
        with kernels(on):
            for k, g in enumerate(grads):
                store.flat_grad[:] = g
                opt.step(1e-2 * (k + 1), grad_scale=0.5 if k != 1 else 1.0)
        np.testing.assert_array_equal(store.flat_grad, grads[-1])
        runs[on] = (store.flat, opt.m, opt.v)
    assert_same(runs[True], runs[False], dtype)


def test_adamw_keeps_no_scratch_buffer_when_its_kernel_runs():
    """The array path's scratch (one block at most) is made only when that
    path runs: with the fused kernel the step allocates nothing beyond the
    moments (on a GPU the block, and so the scratch, is capped too:
    AdamW.DEVICE_BLOCK, not the whole buffer)."""
    for on, scratch in ((True, None), (False, min(AdamW.BLOCK, tiny_parts().store.flat.size))):
        store = tiny_parts().store
        opt = AdamW(store, weight_decay=0.1)
        with kernels(on):
            opt.step(1e-2)
        assert (None if opt._work is None else opt._work.size) == scratch, on
    assert AdamW.DEVICE_BLOCK < 1 << 30


@pytest.mark.parametrize("on", [True, False])
def test_adamw_decays_only_decayed(on):
    """With zero gradients the update is pure decay: decayed matrices shrink
    by 1 - lr wd, everything else (biases, LayerNorm, embeddings) is kept."""
    store = tiny_parts().store
    before = store.flat.copy()
    with kernels(on):
        AdamW(store, weight_decay=0.1).step(0.5)
    assert 0 < sum(s.decl.decay for s in store.specs) < len(store.specs)
    for spec in store.specs:
        lo, hi = store.offsets[spec.name]
        keep = 1 - 0.5 * 0.1 if spec.decl.decay else 1.0
        np.testing.assert_allclose(store.flat[lo:hi], before[lo:hi] * keep, rtol=1e-15, atol=0)


@pytest.mark.parametrize("on", [True, False])
def test_zero_grad_between_steps(on):
    """zero_grad then forward/backward gives the first step's gradients even
    over a NaN-filled buffer (deferred grads are overwritten whole); without
    zero_grad a second pass doubles them (accumulation still works)."""
    parts = tiny_parts(dropout=0.1)
    store, (x, y) = parts.store, rng.integers(0, CFG.vocab_size, (2, 3, CFG.n_ctx))
    with kernels(on):
        store.zero_grad()
        step_grads(parts, x, y)
        first = store.flat_grad.copy()
        store.flat_grad[:] = np.nan
        store.zero_grad()
        step_grads(parts, x, y)
        np.testing.assert_allclose(store.flat_grad, first, rtol=1e-13, atol=0)
        step_grads(parts, x, y)
        np.testing.assert_allclose(store.flat_grad, 2 * first, rtol=1e-13, atol=1e-300)
    for spec in store.specs:
        assert np.any(store.grad[spec.name] != 0), spec.name


@pytest.mark.parametrize("on", [True, False])
def test_deferred_grad_rules(on):
    """settle zeroes a deferred grad nothing wrote; grad_for_add zeroes an
    unwritten one before handing it out; add_grad and add_matmul overwrite
    first, then accumulate; a plain grad is zeroed by zero_grad."""
    parts = tiny_parts()
    store = ParamStore([parts.layout.shard(d) for d in gpt_params(CFG)], parts.backend, seed=0)
    names = ["h.0.mlp.c_fc.weight", "h.1.mlp.c_fc.weight", "wte", "h.0.attn.c_proj.weight"]
    for name in names:
        store.defer_zero(name)
    store.flat_grad[:] = 5.0
    a, b, c, d = (store.grad[n] for n in names)
    u, w, val = normal((a.shape[0], 4)), normal((4, a.shape[1])), normal(d.shape)
    with kernels(on):
        store.zero_grad()
        assert np.all(store.grad["ln_f.weight"] == 0) and np.all(store.grad["h.1.attn.c_attn.bias"] == 0)
        store.add_matmul(names[0], u, w)
        np.testing.assert_allclose(a, u @ w, rtol=1e-14)
        store.add_matmul(names[0], u, w)
        np.testing.assert_allclose(a, 2 * (u @ w), rtol=1e-14)
        assert np.all(store.grad_for_add("wte") == 0)
        store.grad_for_add("wte")[0] += 1.0                      # written now: not zeroed again
        assert np.all(store.grad_for_add("wte")[0] == 1.0)
        store.add_grad(names[3], val)
        store.add_grad(names[3], val)
        np.testing.assert_array_equal(d, 2 * val)
        assert np.all(b == 5.0)                                  # untouched until settle
        store.settle()
    assert np.all(b == 0) and np.all(c[1:] == 0) and np.all(c[0] == 1.0)
    np.testing.assert_allclose(a, 2 * (u @ w), rtol=1e-14)


@pytest.mark.parametrize("variant", ["threaded", "one_thread"])
def test_training_step_fused_vs_numpy(variant):
    """Two serial training steps with dropout: loss, every gradient, and the
    params and moments after each AdamW step agree between the two paths,
    with every kernel threaded and with every kernel on the calling thread
    (blockwise attention's kernels included)."""
    batches, runs = rng.integers(0, CFG.vocab_size, (2, 2, 3, CFG.n_ctx)), {}
    for on in (True, False):
        parts = tiny_parts(dropout=0.1)
        opt, record = AdamW(parts.store, weight_decay=0.1), []
        with kernels(on, variant=variant if on else None):
            for s, (x, y) in enumerate(batches, start=1):
                parts.store.zero_grad()
                record.append(([step_grads(parts, x, y, step=s)], parts.store.flat_grad.copy()))
                opt.step(1e-3, grad_scale=0.8)
                record.append((parts.store.flat.copy(), opt.m.copy(), opt.v.copy()))
        runs[on] = (parts.store, record)
    store = runs[True][0]
    for got, want in paired(runs[True][1], runs[False][1]):
        for g, w in zip(got, want):                 # atol: some gradients are rounding noise (the key bias's)
            for spec in store.specs if len(w) == store.flat.size else [None]:          # every parameter
                lo, hi = store.offsets[spec.name] if spec else (0, len(w))
                np.testing.assert_allclose(g[lo:hi], w[lo:hi], rtol=1e-10, atol=1e-12 * np.abs(w).max(),
                                           err_msg=spec and spec.name)


@pytest.mark.parametrize("n", [0, 1, 7, (1 << 21) + 3])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fill_zero(n, dtype):
    """fill_zero clears exactly the slice it is given (even NaN), not its
    neighbours in the buffer, at any size."""
    buf = np.full(n + 2, np.nan, dtype)
    buf[0] = buf[-1] = 3.0
    fused.fill_zero(buf[1:-1])
    assert np.all(buf[1:-1] == 0) and buf[0] == 3.0 and buf[-1] == 3.0


def test_use_and_active():
    """use returns the previous setting; active needs the kernels on and
    C-contiguous NumPy arrays."""
    a = np.zeros((4, 6))
    with kernels(True, check=False):
        assert fused.active(a, a[1:]) and not fused.active(a, a[:, 1:]) and not fused.active(a.T)
        assert fused.use(False) is True and not fused.active(a)
        assert fused.use(True) is False


def test_check_choice(monkeypatch):
    """MPICUBE_KERNELS: auto/numba/numpy pass; anything else (checked when a
    CPU backend is made), or numba without numba installed, is a UserError."""
    for good in ("auto", "numba", "numpy"):
        monkeypatch.setenv("MPICUBE_KERNELS", good)
        fused.check_choice()
    monkeypatch.setenv("MPICUBE_KERNELS", "bogus")
    with pytest.raises(UserError, match="bogus"):
        fused.check_choice()
    with pytest.raises(UserError, match="MPICUBE_KERNELS"):
        make_backend("cpu", "float64")
    monkeypatch.setenv("MPICUBE_KERNELS", "numba")
    monkeypatch.setattr(fused, "numba", None)
    with pytest.raises(UserError, match="not installed"):
        fused.check_choice()


@pytest.mark.parametrize("B,nh", [(1, 5), (2, 1), (3, 4), (5, 3)])
def test_batched_matmul_split(B, nh):
    """The batch split (along B, or heads when B is 1) equals one matmul on
    strided and transposed operands, with and without out=, and leaves the
    BLAS thread count as it found it."""
    from threadpoolctl import threadpool_info

    qkv = normal((B, 7, 3, nh, 6), np.float64).transpose(2, 0, 3, 1, 4)      # (3, B, nh, T, hd) views
    q, k = qkv[0], qkv[1]
    before = [lib["num_threads"] for lib in threadpool_info()]
    with kernels(True, check=False):
        assert gemm_threads.splits_batch(q, k.swapaxes(-1, -2)) == (B * nh > 1)
        got = ops.batched_matmul(q, k.swapaxes(-1, -2))                       # (B, nh, T, T)
        out = np.full((B, nh, 7, 6), np.nan)
        ops.batched_matmul(got, k, out=out)
    np.testing.assert_allclose(got, np.matmul(q, k.swapaxes(-1, -2)), rtol=1e-13)
    np.testing.assert_allclose(out, np.matmul(got, k), rtol=1e-13)
    assert [lib["num_threads"] for lib in threadpool_info()] == before


def test_readers_of_the_whole_buffer_settle_deferred_gradients():
    """zero_grad with no backward after it: the gradient norm, the
    synchronisation and AdamW see zeros, not last step's deferred values."""
    from mpicube.parallel.comm import Comm, Counters
    from mpicube.parallel.gradients import global_grad_norm, sync_gradients

    parts = build_parts(resolve("serial", ModelConfig(vocab_size=11, n_ctx=4, n_layer=1, n_head=2, n_embd=8), 2, 1),
                        MPI.COMM_SELF, Numerics("float64"))
    store = parts.store
    store.flat_grad[...] = 1.0                      # stale values, as if from a previous step
    store.zero_grad()
    assert store._unwritten                         # the linears' weights were deferred
    assert global_grad_norm(store, parts.layout.axes.tp) == 0.0
    assert not store.flat_grad.any()
    store.flat_grad[...] = 1.0
    store.zero_grad()
    sync_gradients(store, Comm(MPI.COMM_SELF, "dp", store.backend, Counters()))
    assert not store.flat_grad.any()
