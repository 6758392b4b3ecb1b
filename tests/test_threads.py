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
        assert rank["blas"] and all(t == want for t in rank["blas"]), rank
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


def test_thread_count_does_not_change_a_float32_gemm():
    """The load watch changes BLAS's threads mid-run: OpenBLAS splits rows
    and columns, not the sums, so a step's numbers stay the same."""
    import numpy as np
    from threadpoolctl import threadpool_limits

    rng = np.random.default_rng(0)
    for m, k, n in [(512, 144, 576), (144, 512, 576), (256, 768, 1024)]:
        a, b = rng.standard_normal((m, k), np.float32), rng.standard_normal((k, n), np.float32)
        with threadpool_limits(1):
            one = a @ b
        with threadpool_limits(2):
            two = a @ b
        assert np.array_equal(one, two)


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
