"""The CuPy stand-in of tests/fake_gpu: it refuses what CuPy refuses, computes
what NumPy computes, counts every host<->device copy, and lets MPI touch its
memory only when MPICUBE_CUDA_AWARE=1.

``import cupy`` must not resolve to the stand-in inside the pytest process
(other tests would see it), so the checks below (``@check`` functions) run in
one child process with tests/fake_gpu first on PYTHONPATH; each becomes one
pytest test that fails with the child's traceback. The MPI tests run
tests/fake_gpu/mpi_check.py on 2 real ranks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

import numpy as np
import pytest

from mpirun import mpiexec

ROOT = Path(__file__).resolve().parents[1]
FAKE_GPU = ROOT / "tests" / "fake_gpu"
CHECKS = {}


def check(func):
    CHECKS[func.__name__] = func
    return func


def raises(exc_type, func, *args, **kwargs) -> str:
    """The message of the ``exc_type`` that ``func`` must raise."""
    try:
        func(*args, **kwargs)
    except exc_type as exc:
        return str(exc)
    raise AssertionError(f"{getattr(func, '__name__', func)} did not raise {exc_type.__name__}")


def counted(func):
    """(result of ``func()``, the transfer counters it moved)."""
    import cupy

    cupy._stand_in.reset_transfers()
    result = func()
    return result, {k: v for k, v in cupy._stand_in.transfers().items() if v and not k.endswith("bytes")}


# --- checks run in the child ------------------------------------------------
@check
def numpy_refuses_device_arrays():
    import cupy

    x = cupy.arange(6, dtype=cupy.float32)
    host = np.ones(6, dtype=np.float32)
    assert "Implicit conversion" in raises(TypeError, np.asarray, x)
    raises(TypeError, np.array, x)
    raises(TypeError, np.asarray, [x, x])
    raises(TypeError, memoryview, x)
    raises(TypeError, np.exp, x)
    raises(TypeError, np.add, x, 1)
    raises(TypeError, np.add, host, x)
    raises(TypeError, lambda: host + x)
    raises(TypeError, lambda: host * x)
    raises(TypeError, np.concatenate, [x])
    raises(TypeError, np.sum, x)
    raises(TypeError, np.matmul, host, x)

    def host_setitem():
        host[:] = x
    raises(TypeError, host_setitem)

    def host_iadd():
        nonlocal host
        host += x
    raises(TypeError, host_iadd)


@check
def cupy_refuses_numpy_operands():
    import cupy

    x = cupy.ones((2, 3), dtype=cupy.float32)
    host = np.ones((2, 3), dtype=np.float32)
    assert "Unsupported type" in raises(TypeError, lambda: x + host)
    raises(TypeError, lambda: x @ host.T)
    raises(TypeError, lambda: x == host)
    raises(TypeError, lambda: x + np.float32(1).reshape(1))  # a 1-element NumPy array is an array
    raises(TypeError, lambda: x + [1.0, 2.0, 3.0])
    raises(TypeError, cupy.add, x, host)
    raises(TypeError, cupy.exp, host)
    raises(TypeError, cupy.matmul, x, host.T)
    raises(TypeError, cupy.dot, x, host.T)
    raises(TypeError, x.dot, host.T)
    raises(TypeError, cupy.where, x > 0, host, 0.0)
    raises(TypeError, cupy.clip, host, 0, 1)
    raises(TypeError, cupy.sum, host)
    raises(TypeError, cupy.concatenate, [x, host])
    raises(TypeError, cupy.stack, [host])
    raises(TypeError, cupy.ascontiguousarray, host)
    raises(TypeError, cupy.tensordot, x, host)
    raises(TypeError, cupy.maximum, x, 0, out=host)
    raises(TypeError, x.sum, 0, None, np.zeros(3, np.float32))

    def iadd():
        y = x.copy()
        y += host
    raises(TypeError, iadd)
    raises(TypeError, lambda: cupy.asarray([x, 1.0]))  # CuPy's NumPy fallback meets __array__


@check
def scalars_are_kernel_operands():
    import cupy

    host = np.linspace(-1, 1, 6, dtype=np.float32)
    x = cupy.asarray(host)
    for result, want in [(x + 1, host + 1), (x * np.float32(2), host * np.float32(2)),
                         (np.float32(2) * x, np.float32(2) * host), (2.5 - x, 2.5 - host),
                         (x + np.float64(1), host + np.float64(1)), (x ** 2, host ** 2),
                         (cupy.maximum(x, 0.0), np.maximum(host, 0.0)), (x < np.float32(0), host < 0)]:
        assert type(result) is cupy.ndarray
        assert result.dtype == want.dtype, (result.dtype, want.dtype)
        np.testing.assert_array_equal(result.get(), want)
    assert (x == None).get().sum() == 0 and (x != None).get().all()  # noqa: E711 - CuPy's rule for None


@check
def indexing_accepts_what_cupy_accepts():
    import cupy

    host = np.arange(12, dtype=np.float64).reshape(3, 4)
    x = cupy.asarray(host)
    rows = np.array([2, 0])
    for key in [1, (1, 2), (slice(None), slice(1, 3)), (Ellipsis, 0), None, (0, None, slice(None, None, -1))]:
        np.testing.assert_array_equal(x[key].get(), host[key])
    # host index arrays and lists are copied to the device, as CuPy does
    got, moved = counted(lambda: x[rows])
    np.testing.assert_array_equal(got.get(), host[rows])
    assert moved == {"h2d": 1}, moved
    np.testing.assert_array_equal(x[[0, 2], 1:].get(), host[[0, 2], 1:])
    np.testing.assert_array_equal(x[:, cupy.asarray([3, 1])].get(), host[:, [3, 1]])
    # a boolean mask: the result's size is read back to the host (one sync)
    mask = x > 4
    got, moved = counted(lambda: x[mask])
    np.testing.assert_array_equal(got.get(), host[host > 4])
    assert moved == {"d2h": 1}, moved
    assert "integer or boolean" in raises(IndexError, x.__getitem__, np.array([0.5]))
    assert "integer or boolean" in raises(IndexError, x.__getitem__, cupy.asarray([0.5]))


@check
def setitem_accepts_what_cupy_accepts():
    import cupy

    host = np.zeros((3, 4))
    x = cupy.asarray(host)

    def assign(key, value, device_key=None):
        x[key if device_key is None else device_key] = value
        host[key] = value.get() if isinstance(value, cupy.ndarray) else value
        np.testing.assert_array_equal(x.get(), host)

    # basic slices take scalars (CuPy fills) and device arrays
    for key, value in [(0, 1.5), ((slice(None), 1), np.float32(2)), (Ellipsis, np.array(3.0)),
                       ((1, slice(1, 3)), cupy.asarray([7.0, 8.0]))]:
        assign(key, value)
    # ...but not host arrays or lists: CuPy refuses those (its gh-2079)
    assert "non-scalar" in raises(ValueError, x.__setitem__, slice(0, 2), np.ones((2, 4)))
    raises(ValueError, x.__setitem__, 0, [1.0, 2.0, 3.0, 4.0])
    # advanced indices copy a host value to the device
    _, moved = counted(lambda: assign(np.array([0, 2]), np.full((2, 4), 5.0)))
    assert moved["h2d"] == 2, moved  # the index and the value
    assign(([0, 1], [3, 3]), [9.0, 10.0])
    assign(host > 8, -1.0, device_key=x > 8)
    assign(np.array([True, False, True]), cupy.asarray([4.0, 4.0, 4.0, 4.0]),
           device_key=cupy.asarray([True, False, True]))


@check
def results_match_numpy():
    import cupy

    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((2, 3, 4)).astype(np.float32)
    ints = rng.integers(0, 50, (3, 4)).astype(np.int32)
    idx, mask = np.array([2, 0, 2]), a > 0
    cases = {
        "add": lambda xp, a, b, i: xp.add(a, b), "subtract": lambda xp, a, b, i: xp.subtract(a, 1.5),
        "multiply": lambda xp, a, b, i: xp.multiply(a, b), "divide": lambda xp, a, b, i: xp.divide(a, 3),
        "true_divide": lambda xp, a, b, i: xp.true_divide(a, b), "negative": lambda xp, a, b, i: xp.negative(a),
        "exp": lambda xp, a, b, i: xp.exp(a), "log": lambda xp, a, b, i: xp.log(xp.abs(a) + 1),
        "log1p": lambda xp, a, b, i: xp.log1p(xp.absolute(a)), "sqrt": lambda xp, a, b, i: xp.sqrt(xp.square(a)),
        "tanh": lambda xp, a, b, i: xp.tanh(a), "cos": lambda xp, a, b, i: xp.cos(a),
        "sin": lambda xp, a, b, i: xp.sin(a), "power": lambda xp, a, b, i: xp.power(a, 2),
        "maximum": lambda xp, a, b, i: xp.maximum(a, b), "minimum": lambda xp, a, b, i: xp.minimum(a, 0.0),
        "sign": lambda xp, a, b, i: xp.sign(a), "isfinite": lambda xp, a, b, i: xp.isfinite(a / 0),
        "isnan": lambda xp, a, b, i: xp.isnan(xp.log(a)), "where": lambda xp, a, b, i: xp.where(a > 0, a, 0.0),
        "clip": lambda xp, a, b, i: xp.clip(a, -0.5, 0.5), "sum": lambda xp, a, b, i: xp.sum(a),
        "sum_axis": lambda xp, a, b, i: xp.sum(a, axis=1, keepdims=True),
        "sum_dtype": lambda xp, a, b, i: a.sum(axis=0, dtype=xp.float64),
        "max": lambda xp, a, b, i: xp.max(a, axis=0), "min": lambda xp, a, b, i: xp.min(a),
        "amax": lambda xp, a, b, i: xp.amax(a, axis=1), "amin": lambda xp, a, b, i: xp.amin(a, axis=0),
        "mean": lambda xp, a, b, i: xp.mean(a, axis=-1), "argmax": lambda xp, a, b, i: a.argmax(axis=1),
        "dot": lambda xp, a, b, i: xp.dot(a, b.T), "matmul": lambda xp, a, b, i: xp.matmul(a, b.T),
        "einsum": lambda xp, a, b, i: xp.einsum("ij,kj->ik", a, b),
        "tensordot": lambda xp, a, b, i: xp.tensordot(a, b, axes=([1], [1])),
        "outer": lambda xp, a, b, i: xp.outer(a[0], b[1]), "cumsum": lambda xp, a, b, i: xp.cumsum(a, axis=1),
        "argsort": lambda xp, a, b, i: xp.argsort(a, axis=1), "sort": lambda xp, a, b, i: xp.sort(a, axis=0),
        "unique": lambda xp, a, b, i: xp.unique(i), "concatenate": lambda xp, a, b, i: xp.concatenate([a, b], 1),
        "stack": lambda xp, a, b, i: xp.stack([a, b], axis=-1), "split": lambda xp, a, b, i: xp.split(a, 2, 1),
        "array_split": lambda xp, a, b, i: xp.array_split(a, 3, axis=1),
        "broadcast_to": lambda xp, a, b, i: xp.broadcast_to(a[0], (2, 3, 4)),
        "expand_dims": lambda xp, a, b, i: xp.expand_dims(a, 1), "nonzero": lambda xp, a, b, i: xp.nonzero(a > 0),
        "count_nonzero": lambda xp, a, b, i: xp.count_nonzero(a > 0), "all": lambda xp, a, b, i: xp.all(a > -9),
        "any": lambda xp, a, b, i: xp.any(a > 0, axis=0), "zeros_like": lambda xp, a, b, i: xp.zeros_like(a),
        "bitwise": lambda xp, a, b, i: xp.bitwise_xor(xp.bitwise_and(i, 6), xp.bitwise_or(i, 8)),
        "shifts": lambda xp, a, b, i: xp.right_shift(xp.left_shift(i, 3), 1),
        "operators": lambda xp, a, b, i: [a + b, a - 1, 2 * a, a / b, a // 1, a % 1, a ** 2, -a, abs(a), +a,
                                          a @ b.T, a < b, a <= 0, a > b, a >= 0, a == b, a != b],
        "int_operators": lambda xp, a, b, i: [i & 3, i | 8, i ^ 5, i << 1, i >> 1, ~i, 1 << i % 4, i // 3],
        "methods": lambda xp, a, b, i: [a.T, a.reshape(4, 3), a.reshape((2, 6)), a.transpose(1, 0),
                                        a.swapaxes(0, 1), a.ravel(), a.flatten(), a.astype(xp.float16),
                                        a.copy(), a.any(), a.all(axis=0), a.dot(b.T), a.mean(),
                                        a.max(axis=1, keepdims=True), a.min(), a.view(xp.int32)],
        "indexing": lambda xp, a, b, i: [a[1], a[1, 2], a[:, 1:3], a[..., 0], a[None], a[[0, 2]], a[:, [1, 3]],
                                         a[a > 0], a[xp.asarray(idx) if xp is not np else idx, 1:]],
        "creation": lambda xp, a, b, i: [xp.arange(5), xp.arange(1, 7, 2, dtype=xp.float32),
                                         xp.zeros((2, 3), xp.float32), xp.ones(3), xp.full((2, 2), 3.0),
                                         xp.eye(3), *xp.triu_indices(4, 1), xp.empty_like(a).shape],
    }
    dev = [cupy.asarray(v) for v in (a, b, ints)]
    for name, case in cases.items():
        want, got = case(np, a, b, ints), case(cupy, *dev)
        wants, gots = (want, got) if isinstance(want, (list, tuple)) else ([want], [got])
        assert len(wants) == len(gots), name
        for w, g in zip(wants, gots):
            if isinstance(w, tuple):  # a shape
                assert w == g, name
                continue
            assert type(g) is cupy.ndarray, (name, type(g))
            w = np.asarray(w)
            assert g.dtype == w.dtype and g.shape == w.shape, (name, g.dtype, w.dtype, g.shape, w.shape)
            np.testing.assert_array_equal(g.get(), w, err_msg=name)


@check
def outputs_and_zero_d_results():
    import cupy

    x = cupy.arange(6, dtype=cupy.float64).reshape(2, 3)
    out = cupy.empty((2, 3))
    assert cupy.add(x, 1, out=out) is out and out.get()[1, 2] == 6
    assert cupy.exp(x, out) is out
    total = cupy.empty(3)
    assert x.sum(axis=0, out=total) is total and total.get().tolist() == [3, 5, 7]
    for zero_d in (x.sum(), x[1, 2], cupy.max(x), x.mean(), x[1][2], cupy.count_nonzero(x), cupy.float64(2) * x[0, 0]):
        assert type(zero_d) is cupy.ndarray and zero_d.ndim == 0, type(zero_d)
    y = x.copy()
    alias = y
    y += 1
    y *= cupy.float64(2)
    assert y is alias and y.get()[0, 0] == 2
    y[0] += 10
    assert y.get()[0].tolist() == [12, 14, 16]


@check
def views_share_memory_and_name_their_base():
    import cupy

    x = cupy.zeros((4, 6), dtype=cupy.float32)
    assert x.base is None and x.flags.owndata and x.flags.c_contiguous
    for view in (x[1:], x[1:][1:], x.T, x.reshape(6, 4), x[:, ::2], x.ravel(), x[2, 3], x.view(),
                 cupy.expand_dims(x, 0), cupy.split(x, 2)[1], x.swapaxes(0, 1)):
        assert view.base is x, type(view.base)
    assert x.copy().base is None and x.flatten().base is None and x[[0, 1]].base is None
    assert x.astype(cupy.float32, copy=False) is x and x.astype(cupy.float64).base is None
    x[1:, ::2][0] = 5.0
    assert x.get()[1].tolist() == [5, 0, 5, 0, 5, 0]
    t = x.T
    assert not t.flags.c_contiguous and t.flags.f_contiguous and t.strides == (4, 24)
    assert x[1].data.ptr == x.data.ptr + 24
    pooled = cupy.ndarray((2, 3), cupy.float32, memptr=x.data + 4 * 6 * 2, strides=(24, 4))  # x[2:4, :3]
    pooled.fill(7)
    assert x.get()[2].tolist() == [7, 7, 7, 0, 0, 0] and x.get()[3].tolist() == [7, 7, 7, 0, 0, 0]
    assert (len(x), x.ndim, x.size, x.itemsize, x.nbytes) == (4, 2, 24, 4, 96)
    rows = list(x)
    assert len(rows) == 4 and all(type(r) is cupy.ndarray and r.base is x for r in rows)
    raises(TypeError, len, x[0, 0])
    raises(TypeError, iter, x[0, 0])
    assert "more than one element" in raises(ValueError, bool, x)


@check
def transfers_are_counted():
    import cupy

    host = np.arange(4, dtype=np.float64)
    x, moved = counted(lambda: cupy.asarray(host))
    assert moved == {"h2d": 1} and cupy._stand_in.transfers()["h2d_bytes"] == 32
    host[0] = 99  # the device copy does not alias host memory
    assert counted(lambda: cupy.asarray([1.0, 2.0]))[1] == {"h2d": 1}
    assert counted(lambda: cupy.array(host))[1] == {"h2d": 1}
    assert counted(lambda: cupy.asarray(x))[0] is x
    for device_only in (lambda: cupy.asarray(x), lambda: cupy.array(x), lambda: cupy.array([x, x]),
                        lambda: cupy.zeros(3) + cupy.arange(3), lambda: (x * 2).sum(), lambda: list(x),
                        lambda: x[1:], lambda: cupy.count_nonzero(x)):
        assert counted(device_only)[1] == {}, device_only
    for to_host in (lambda: cupy.asnumpy(x), lambda: x.get(), lambda: float(x[1]), lambda: int(x[1]),
                    lambda: bool(x[1]), lambda: complex(x[1]), lambda: x[1].item(), lambda: x.tolist(),
                    lambda: repr(x), lambda: str(x), lambda: f"{x[0]:.2f}", lambda: cupy.nonzero(x),
                    lambda: x[x > 1], lambda: cupy.unique(x), lambda: cupy.where(x > 1)):
        assert counted(to_host)[1] == {"d2h": 1}, to_host
    assert host[0] == 99 and x.get()[0] == 0
    pinned = cupyx_empty_pinned(4)
    assert counted(lambda: x.get(out=pinned))[0] is pinned and pinned.tolist() == [0, 1, 2, 3]
    assert "cannot be obtained" in raises(TypeError, x.get, out=np.empty(4, np.float32))
    raises(ValueError, x.get, out=np.empty(5))
    _, moved = counted(lambda: x.set(np.full(4, 3.0)))
    assert moved == {"h2d": 1} and x.get().tolist() == [3, 3, 3, 3]
    raises(TypeError, x.set, np.zeros(4, np.float32))
    raises(TypeError, x.set, [1.0, 2.0, 3.0, 4.0])
    raises(ValueError, x.set, np.zeros(3))
    for sync in (lambda: cupy.cuda.get_current_stream().synchronize(), lambda: cupy.cuda.Device().synchronize(),
                 lambda: cupy.cuda.runtime.deviceSynchronize(), lambda: cupy.cuda.Stream().synchronize()):
        assert counted(sync)[1] == {"syncs": 1}
    cupy._stand_in.reset_transfers()
    assert set(cupy._stand_in.transfers().values()) == {0}


def cupyx_empty_pinned(n):
    import cupyx

    pinned = cupyx.empty_pinned((n,), np.float64)
    assert type(pinned) is np.ndarray and type(cupyx.zeros_pinned((2, 2), np.float32)) is np.ndarray
    return pinned


@check
def stream_order_refuses_buffers_queued_work_still_writes():
    """What a CUDA-aware MPI may be handed: memory no queued work writes.
    Computing, writing in place or through a view, ``out=`` and scatter_add
    queue work; a stream or device synchronisation and a blocking copy to
    the host retire it; ``empty`` and a copy from pageable host memory queue
    nothing."""
    import cupy
    import cupyx

    os.environ["MPICUBE_CUDA_AWARE"] = "1"
    try:
        def refused(a) -> bool:
            try:
                a.__cuda_array_interface__
            except RuntimeError as exc:
                assert "stand-in stream order" in str(exc) and "test_fake_gpu.py" in str(exc), exc
                return True
            return False

        fresh = cupy.empty((4,), dtype=cupy.float32)
        host = cupy.asarray(np.arange(4, dtype=np.float32))
        assert not refused(fresh) and not refused(host)
        y = host * 2                                   # a kernel
        assert refused(y) and refused(y[1:]) and refused(y.view(cupy.int32))
        cupy.cuda.get_current_stream().synchronize()
        assert not refused(y) and not refused(y[1:])
        y[2:] += 1                                     # in place, through a view: the owner is written
        assert refused(y)
        cupy.cuda.Device().synchronize()
        cupy.multiply(host, 3, out=fresh)
        assert refused(fresh)
        fresh.get()                                    # a blocking copy waits for the stream
        assert not refused(fresh)
        cupyx.scatter_add(fresh, cupy.asarray(np.array([0, 0])), 1.0)
        assert refused(fresh)
        cupy.cuda.runtime.deviceSynchronize()
        fresh.fill(0)
        assert refused(fresh)
    finally:
        del os.environ["MPICUBE_CUDA_AWARE"]


@check
def cuda_array_interface_only_when_cuda_aware():
    import cupy

    x = cupy.arange(12, dtype=cupy.float32).reshape(3, 4)
    os.environ.pop("MPICUBE_CUDA_AWARE", None)
    assert not hasattr(x, "__cuda_array_interface__")
    assert not hasattr(x, "__dlpack__") and not hasattr(x, "__dlpack_device__")
    os.environ["MPICUBE_CUDA_AWARE"] = "1"  # read at access time
    try:
        with pytest.raises(RuntimeError, match="stand-in stream order: .*synchronise after building the buffer"):
            x.__cuda_array_interface__            # queued work (arange, reshape's owner) still writes it
        cupy.cuda.get_current_stream().synchronize()
        cai = x.__cuda_array_interface__
        assert cai["version"] == 3 and cai["shape"] == (3, 4) and cai["typestr"] == "<f4"
        assert cai["strides"] is None and cai["data"] == (x.data.ptr, False)
        assert x.T.__cuda_array_interface__["strides"] == (4, 16)
        assert x[1].__cuda_array_interface__["data"][0] == x.data.ptr + 16
        assert not hasattr(x, "__dlpack__")
    finally:
        del os.environ["MPICUBE_CUDA_AWARE"]
    assert not hasattr(x, "__cuda_array_interface__")
    from mpi4py import MPI

    raises(TypeError, MPI.COMM_SELF.Allreduce, MPI.IN_PLACE, x)  # no buffer protocol: MPI cannot read it


@check
def cuda_module():
    import cupy

    cuda = cupy.cuda
    assert cuda.is_available() and cuda.runtime.getDeviceCount() == 1
    dev = cuda.Device(0)
    assert dev.use() is dev and dev.id == 0 and cuda.Device().id == 0 and int(dev) == 0
    with cuda.Device(0) as inside:
        assert inside.id == cuda.runtime.getDevice() == 0
    assert "invalid device ordinal" in raises(cuda.runtime.CUDARuntimeError, cuda.Device(1).use)
    os.environ["MPICUBE_FAKE_GPU_COUNT"] = "4"
    try:
        with cuda.Device(3):
            assert cuda.runtime.getDevice() == 3
        assert cuda.runtime.getDevice() == 0
        os.environ["MPICUBE_FAKE_GPU_COUNT"] = "0"
        assert not cuda.is_available()
        assert "cudaErrorNoDevice" in raises(cuda.runtime.CUDARuntimeError, cuda.runtime.getDeviceCount)
    finally:
        del os.environ["MPICUBE_FAKE_GPU_COUNT"]
    stream = cuda.Stream(non_blocking=True)
    with stream:
        assert cuda.get_current_stream() is stream
    assert cuda.get_current_stream() is cuda.Stream.null
    start, end = cuda.Event(), cuda.Event()
    start.record()
    end.record()
    end.synchronize()
    assert cuda.get_elapsed_time(start, end) >= 0


@check
def cupyx_scatter_add():
    import cupy
    import cupyx

    host = np.zeros((4, 3))
    x = cupy.asarray(host)
    rows = np.array([0, 2, 0, 3])
    values = np.arange(12.0).reshape(4, 3)
    cupyx.scatter_add(x, cupy.asarray(rows), cupy.asarray(values))
    np.add.at(host, rows, values)
    np.testing.assert_array_equal(x.get(), host)  # repeated rows accumulate
    cupyx.scatter_add(x, rows, values)  # advanced index: host index and value are copied over
    np.add.at(host, rows, values)
    cupyx.scatter_add(x, (slice(1, 3), 0), 1.0)
    host[1:3, 0] += 1.0
    np.testing.assert_array_equal(x.get(), host)
    raises(TypeError, cupyx.scatter_add, x, slice(0, 2), np.ones((2, 3)))  # basic slice: a ufunc operand
    raises(TypeError, cupyx.scatter_add, host, rows, values)


@check
def only_cupy_api():
    import cupy
    import cupyx

    for absent in ("vecdot", "ElementwiseKernel", "ReductionKernel", "RawKernel", "RawModule", "fuse"):
        assert not hasattr(cupy, absent), absent
    assert cupy._mpicube_host_memory is True
    assert cupy.float32 is np.float32 and cupy.bool_ is np.bool_ and cupy.inf == np.inf and cupy.newaxis is None
    assert cupy.pi == np.pi and cupy.result_type(cupy.zeros(2, cupy.float32), 1.0) == np.float32
    assert cupy.get_array_module(cupy.zeros(1)) is cupy and cupy.get_array_module(np.zeros(1), 2) is np
    assert type(cupy.zeros(1)).__module__ == "cupy" and isinstance(cupy.asnumpy(np.ones(2)), np.ndarray)
    assert cupy.ndarray is type(cupy.zeros(1)) and callable(cupyx.scatter_add)
    raises(ValueError, cupy.asarray, np.array(["a"]))  # CuPy holds numbers only


def run_checks() -> dict:
    """Run every check here (in the child); None for a pass, else the traceback."""
    import cupy

    assert Path(cupy.__file__).resolve().is_relative_to(FAKE_GPU), cupy.__file__
    results = {}
    for name, func in CHECKS.items():
        cupy._stand_in.reset_transfers()
        try:
            func()
            results[name] = None
        except BaseException:  # reported to the parent, which fails that test
            results[name] = traceback.format_exc()
    return results


if __name__ == "__main__":
    print(json.dumps(run_checks()))
    sys.exit(0)


# --- the pytest side ----------------------------------------------------------
def stand_in_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MPICUBE_", "CUPY"))}
    env["PYTHONPATH"] = os.pathsep.join([str(FAKE_GPU), str(ROOT)])
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def child_results():
    proc = subprocess.run([sys.executable, __file__], env=stand_in_env(), capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", list(CHECKS))
def test_stand_in(name, child_results):
    assert child_results[name] is None, child_results[name]


def test_not_importable_without_the_path():
    """The stand-in never leaks into this process (other tests import mpicube)."""
    mod = sys.modules.get("cupy")
    assert mod is None or not Path(mod.__file__).resolve().is_relative_to(FAKE_GPU)


@pytest.mark.parametrize("cuda_aware", ["0", "1"])
def test_mpi_on_stand_in_arrays(cuda_aware, tmp_path):
    """2 real ranks: MPI refuses stand-in arrays, unless they expose the CUDA
    array interface, then results are right and nothing was staged."""
    report = tmp_path / "transfers"
    env = {"PYTHONPATH": stand_in_env()["PYTHONPATH"], "MPICUBE_CUDA_AWARE": cuda_aware,
           "MPICUBE_FAKE_GPU_REPORT": str(report)}
    proc = mpiexec(2, [FAKE_GPU / "mpi_check.py"], timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    ranks = json.loads(proc.stdout.strip().splitlines()[-1])["ranks"]
    assert len(ranks) == 2
    for outcomes in ranks:
        assert len(outcomes) == 6
        for name, outcome in outcomes.items():
            if cuda_aware == "1":
                assert outcome == "ok", (name, outcome)
            else:
                assert outcome.startswith("refused: TypeError"), (name, outcome)
    counters = [json.loads(p.read_text()) for p in tmp_path.glob("transfers.*")]
    assert len(counters) == 2
    for c in counters:  # only the checks' own result reads, nothing staged by MPI
        assert c["h2d"] == 0 and c["d2h"] == (6 if cuda_aware == "1" else 0), c
