"""Each rank's thread pools get its share of the node's cores (mpicube.device.threads):
the decision itself, and real ranks under mpiexec whose BLAS and numba pools
are checked from inside, with OMP_NUM_THREADS unset and the node's core count
pretended through MPICUBE_NODE_CORES."""

import json
import os
import subprocess
import sys

import pytest
from mpirun import MPIEXEC, ROOT, job_env

from mpicube.core.errors import UserError
from mpicube.device.threads import decide

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("env, ranks, node, mine, threads, source", [
    ({}, 8, 2, 2, 1, "node cores"),                         # oversubscribed: one thread each
    ({}, 4, 64, 64, 16, "node cores"),                      # unbound ranks share the node
    ({}, 4, 32, 8, 8, "node cores"),                        # each rank bound to its own 8 cores
    ({}, 3, 64, 4, 4, "node cores"),                        # never more than the rank's own mask
    ({"MPICUBE_NODE_CORES": "16"}, 4, 2, 16, 4, "node cores"),
    ({"MPICUBE_NODE_CORES": "16", "OMP_NUM_THREADS": "3"}, 4, 2, 2, 3, "OMP_NUM_THREADS"),
    ({"OMP_NUM_THREADS": "2,1"}, 1, 8, 8, 2, "OMP_NUM_THREADS"),         # nested list: the first level
    ({"OMP_NUM_THREADS": "0"}, 2, 8, 8, 4, "node cores"),                # not a thread count: ignored
])
def test_share(env, ranks, node, mine, threads, source):
    share = decide(ranks, node, mine, env)
    assert (share.threads, share.source) == (threads, source)


def test_bad_node_cores_is_a_user_error():
    with pytest.raises(UserError, match="MPICUBE_NODE_CORES='many'"):
        decide(1, 2, 2, {"MPICUBE_NODE_CORES": "many"})


PROBE = """
import json
from mpi4py import MPI
from threadpoolctl import threadpool_info
from mpicube.device import fused, threads
from mpicube.device.backend import make_backend
make_backend("cpu", "float32", MPI.COMM_WORLD)
info = {"blas": [lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"],
        "numba": fused.numba.get_num_threads() if fused.numba else None,
        "numba_max": fused.numba.config.NUMBA_NUM_THREADS if fused.numba else None,
        "share": threads.current().to_dict()}
ranks = MPI.COMM_WORLD.gather(info)
if ranks is not None:
    print(json.dumps(ranks), flush=True)
"""


def probe(n, node_cores):
    """Every rank's thread pools after make_backend, on n ranks of a node
    said to have ``node_cores`` cores, OMP_NUM_THREADS unset."""
    env = job_env({"MPICUBE_NODE_CORES": str(node_cores)}, timeout=60)
    env.pop("OMP_NUM_THREADS", None)
    p = subprocess.run([str(MPIEXEC), "-n", str(n), sys.executable, "-c", PROBE], env=env, cwd=str(ROOT),
                       capture_output=True, text=True, timeout=90)
    assert p.returncode == 0, p.stdout + p.stderr
    ranks = json.loads(p.stdout.strip().splitlines()[-1])
    assert len(ranks) == n, p.stdout
    return ranks


@pytest.mark.parametrize("n, node_cores", [(4, 4), (2, 16)])
def test_ranks_limit_blas_and_numba_to_their_share(n, node_cores):
    mine = len(os.sched_getaffinity(0))
    want = max(1, min(mine, node_cores // n))
    for rank in probe(n, node_cores):
        assert rank["share"]["threads"] == want and rank["share"]["ranks_on_node"] == n, rank
        assert rank["blas"] and all(t == 1 for t in rank["blas"]), rank     # the BLAS never splits a GEMM
        assert rank["share"]["pools"]["gemm panels"] == want, rank
        if rank["numba"] is not None:
            assert rank["numba"] == min(want, rank["numba_max"]), rank


# --- the pools follow the free cores (mpicube.device.core_load) -------------------------------------
from mpicube.device import core_load  # noqa: E402
from mpicube.device.threads import adapts  # noqa: E402

STAT = """cpu  300 0 60 500 10 0 0 0 0 0
cpu0 {u0} 0 {s0} {i0} 5 0 0 0 0 0
cpu1 {u1} 0 {s1} {i1} 5 1 1 0 0 0
intr 1 2 3
"""


@pytest.mark.parametrize("text, cores", [("max 100000", None), ("150000 100000", 2), ("200000 100000", 2),
                                         ("50000 100000", 1), ("", None), ("x 100000", None)])
def test_cgroup_cpu_max(text, cores):
    assert core_load.parse_cpu_max(text) == cores


def test_cgroup_quota_caps_the_share():
    assert decide(1, 8, 8, {}, cgroup_cores=2).threads == 2
    assert decide(2, 8, 8, {}, cgroup_cores=3).threads == 1
    assert decide(1, 8, 8, {"OMP_NUM_THREADS": "4"}, cgroup_cores=2).threads == 4     # the user decided


def test_busy_ticks_counts_the_rank_cpus_only():
    text = STAT.format(u0=100, s0=20, i0=300, u1=7, s1=3, i1=50)
    assert core_load.busy_ticks(text, [0]) == 120
    assert core_load.busy_ticks(text, [1]) == 12                  # irq and softirq count as busy
    assert core_load.busy_ticks(text, [0, 1]) == 132
    assert core_load.busy_ticks(text, [0, 2]) is None             # a CPU without a line: no figure


@pytest.mark.parametrize("cores, others, share, want", [(2, 0.0, 2, 2), (2, 0.3, 2, 2), (2, 0.45, 2, 1), (2, 0.67, 2, 1),
                                                       (2, 1.0, 2, 1), (2, 3.0, 2, 1), (8, 2.2, 8, 6),
                                                       (8, 0.0, 4, 4)])
def test_free_cores(cores, others, share, want):
    assert core_load.free_cores(cores, others, share) == want


def test_adapts_only_an_undecided_share():
    share = decide(1, 2, 2, {})
    assert adapts(share, {}) and not adapts(share, {"MPICUBE_ADAPT_THREADS": "0"})
    assert not adapts(share, {"MPICUBE_NODE_CORES": "2"})
    assert not adapts(decide(1, 2, 2, {"OMP_NUM_THREADS": "2"}), {})
    assert not adapts(decide(2, 2, 2, {}), {})                     # one thread: nothing to give back


def test_load_watch_gives_up_a_thread_only_when_it_waits(tmp_path, monkeypatch):
    stat, tasks, calls = tmp_path / "stat", tmp_path / "task", []
    (tasks / "7").mkdir(parents=True)

    def machine(busy0, busy1, idle, waited_s):
        stat.write_text(STAT.format(u0=busy0, s0=0, i0=idle, u1=busy1, s1=0, i1=idle))
        (tasks / "7" / "schedstat").write_text(f"123 {int(waited_s * 1e9)} 4\n")

    machine(0, 0, 0, 0)
    clock = iter(range(0, 1000, 10))             # each clock read 10 s on: looks at the load 20 s apart
    monkeypatch.setattr(core_load.time, "monotonic", lambda: float(next(clock)))
    monkeypatch.setattr(core_load, "PROBE_S", 1e9)              # no probing for the whole share here
    watch = core_load.LoadWatch([0, 1], 2, calls.append, stat_path=str(stat), task_dir=str(tasks), period=1.0)
    hz = watch.hz
    machine(20 * hz, 0, 20 * hz, 0)              # another process busy a whole core, but it yields: no wait
    watch.tick()
    assert calls == [] and watch.threads == 2
    machine(20 * hz, 0, 40 * hz, 10)             # our own threads waited for each other, nobody else busy
    watch.tick()
    assert calls == [] and watch.threads == 2
    machine(40 * hz, 0, 60 * hz, 20)             # a spinner: our threads waited half a core
    watch.tick()
    assert calls == [1]
    machine(60 * hz, 0, 80 * hz, 20)             # still there: stay on one thread
    watch.tick()
    assert calls == [1]
    machine(60 * hz, 0, 120 * hz, 20)            # gone: the whole share again
    watch.tick()
    assert calls == [1, 2]


def test_waited_ns_sums_the_threads(tmp_path):
    for tid, wait in (("1", 5), ("2", 7)):
        (tmp_path / tid).mkdir()
        (tmp_path / tid / "schedstat").write_text(f"100 {wait} 3\n")
    (tmp_path / "3").mkdir()                     # a thread that ended: no file
    assert core_load.waited_ns(str(tmp_path)) == 12
    assert core_load.waited_ns(str(tmp_path / "none")) is None


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_thread_count_does_not_change_a_gemm(dtype):
    """mpicube's GEMM (fixed panels on a one-thread BLAS) gives the same bits
    on one thread and two, on whatever kernel OpenBLAS picked here; shapes
    include those where OpenBLAS's own two-thread split differs under its
    Haswell kernels (issue 49). tests/test_reproducible.py forces those."""
    import numpy as np
    from threadpoolctl import threadpool_limits

    from mpicube.device import precision
    from mpicube.device import threads as thread_share

    rng = np.random.default_rng(0)
    before = thread_share.active()
    try:
        with threadpool_limits(1, user_api="blas"):
            for m, k, n in [(512, 144, 576), (144, 512, 576), (256, 768, 1024), (2048, 768, 768), (100, 77, 300)]:
                a, b = rng.standard_normal((m, k)).astype(dtype), rng.standard_normal((k, n)).astype(dtype)
                products = []
                for count in (1, 2, 3):
                    thread_share.set_pool_threads(count)
                    products.append(precision.matmul(a, b))
                assert all(np.array_equal(products[0], p) for p in products[1:]), (m, k, n)
                np.testing.assert_allclose(products[0], a.astype(np.float64) @ b, rtol=1e-3, atol=1e-3)
    finally:
        thread_share.set_pool_threads(before)


def test_panels_depend_on_the_shape_alone():
    """The cut of a product is a pure function of (m, k, n), covers it once,
    and splits only products big enough to repay a panel."""
    from mpicube.device.gemm_threads import PANEL_MIN_MACS, panel_cuts

    assert panel_cuts(64, 64, 64) == (0, (0, 64))                          # 262K MACs: one call
    axis, cuts = panel_cuts(512, 144, 576)
    assert axis == 1 and cuts[0] == 0 and cuts[-1] == 576 and len(cuts) - 1 == 8
    assert all(hi - lo >= 64 for lo, hi in zip(cuts, cuts[1:]))
    axis, cuts = panel_cuts(8192, 768, 2304)
    assert axis == 0 and len(cuts) - 1 == 64 and cuts[-1] == 8192
    assert all((hi - lo) * 768 * 2304 >= PANEL_MIN_MACS for lo, hi in zip(cuts, cuts[1:]))


def test_threaded_and_one_thread_builds_compute_the_same_bits():
    """A kernel's build is chosen by the share (fused._Kernel), so a run at
    OMP_NUM_THREADS=1 takes the one-thread builds where a run on two threads
    takes the threaded ones: the two must give the same bits, every kernel,
    both formats, rows and sizes that leave SIMD remainders."""
    import numpy as np

    from mpicube.device import fused

    if fused.numba is None:
        pytest.skip("needs numba")

    def run(variant, dtype, n, C):
        g = np.random.default_rng(5)
        x = g.standard_normal((n, C)).astype(dtype)                      # (n, C)
        v = x.reshape(-1).copy()                                         # (n C,)
        t = np.tanh(v)
        s = g.standard_normal((3, 37, 37)).astype(dtype)                 # (M, T, T) scores
        gamma, beta = np.full(C, 1.3, dtype), np.full(C, 0.2, dtype)     # (C,)
        out = {}
        with fused.forced_build(variant):
            out["gelu_tanh_argument"] = np.empty_like(v)
            fused.gelu_tanh_argument(v, out["gelu_tanh_argument"])
            out["gelu_from_tanh"] = np.empty_like(v)
            fused.gelu_from_tanh(v, t, out["gelu_from_tanh"])
            out["gelu_backward"] = np.empty_like(v)
            fused.gelu_backward(v, v, t, out["gelu_backward"])
            out["softmax_causal"] = s.copy()
            fused.softmax_causal(out["softmax_causal"])
            out["softmax_causal_backward"] = s.copy()
            fused.softmax_causal_backward(out["softmax_causal_backward"], out["softmax_causal"])
            out["row_sums"] = np.empty(n, dtype)
            fused.row_sums(x, out["row_sums"])
            out["center_rows"], out["sumsq"] = np.empty_like(x), np.empty(n, dtype)
            fused.center_rows(x, out["row_sums"] / C, out["center_rows"], out["sumsq"])
            out["xhat"], out["normalize_rows"] = out["center_rows"].copy(), np.empty_like(x)
            fused.normalize_rows(out["xhat"], out["sumsq"], gamma, beta, out["normalize_rows"])
            out["layernorm_grad_sums"] = np.empty((n, 2), dtype)
            fused.layernorm_grad_sums(x, gamma, out["xhat"], out["layernorm_grad_sums"])
            out["layernorm_grad_input"] = np.empty_like(x)
            fused.layernorm_grad_input(x, gamma, out["xhat"], out["sumsq"], out["layernorm_grad_sums"],
                                       out["layernorm_grad_input"])
            out["adamw_p"], out["adamw_m"], out["adamw_v"] = v.copy(), v * 0.1, np.abs(v) * 0.01
            fused.adamw(out["adamw_p"], v[::-1].copy(), out["adamw_m"], out["adamw_v"], 0.9, 0.95, 1e-3, 1e-8,
                        0.99, 0.5)
        return out

    for dtype in (np.float32, np.float64):
        for n, C in [(333, 144), (2000, 768), (7, 5)]:
            threaded, one = run("threaded", dtype, n, C), run("one_thread", dtype, n, C)
            assert len(threaded) == 15
            for name in threaded:
                assert np.array_equal(threaded[name], one[name]), (name, dtype, n, C)


def test_cycle_watch_moves_the_count_at_every_gemm():
    """MPICUBE_ADAPT_THREADS=cycle: 1, 2, 3, 1, ... on a share of 3."""
    seen = []
    watch = core_load.CycleWatch(3, seen.append)
    for _ in range(5):
        watch.tick()
    assert seen == [1, 2, 3, 1, 2] and watch.changes == 5


def test_worker_count_does_not_change_a_threaded_kernel():
    """Nor does the number of numba workers: a threaded kernel runs the same
    code per row whatever the split (the build is chosen by the share)."""
    import numpy as np

    from mpicube.device import fused

    if fused.numba is None or fused.numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("needs numba and two threads")
    rng = np.random.default_rng(1)
    x = rng.standard_normal((333, 144), np.float32)
    results = []
    saved = fused.numba.get_num_threads()
    try:
        for n in (1, 2):
            fused.numba.set_num_threads(n)
            xc, sumsq, mean = np.empty_like(x), np.empty(333, np.float32), x.mean(1)
            with fused.forced_build("threaded"):
                fused.center_rows(x, mean, xc, sumsq)
            results.append((xc, sumsq))
    finally:
        fused.numba.set_num_threads(saved)
    assert all(np.array_equal(a, b) for a, b in zip(*results))
