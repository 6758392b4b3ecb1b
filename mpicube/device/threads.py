"""One share of the node's cores per rank, for every thread pool a rank starts.

Why this module exists: ``mpirun -n P mpicube train`` starts P processes on
a node, and each of them would otherwise start one BLAS thread per core
(OpenBLAS does so when NumPy loads it), one numba worker per core and one
OpenMP thread per core: P-fold oversubscription. Measured on 8 ranks on a
2-core machine, that ran about ten times slower than the same job with
``OMP_NUM_THREADS=1``. So before the first GEMM every rank limits all of
its pools to its share:

* ``OMP_NUM_THREADS``, if set to a positive integer (the user, or a job
  script, has decided; the first entry of a nested list such as ``4,2``);
* else the node's cores divided among the ranks on the node (at least one),
  and never more than the cores this rank may run on. The node's cores are
  the union of the CPU affinity masks of its ranks (so a launcher that binds
  each rank to its own cores is respected), or ``MPICUBE_NODE_CORES`` if set
  (a site whose masks do not tell the truth; tests set it to pretend a
  larger node).

The pools: mpicube's GEMM panels (``gemm_threads``: every product cut in
panels fixed by its shape, the threads taking panels), numba's workers, and
any OpenMP runtime through threadpoolctl. The BLAS itself always runs on
ONE thread: its own split of a GEMM or a dot product changes the last bits
of the result with the thread count (OpenBLAS's Haswell sgemm, and its
threaded dot products, do), and a reference must give the same numbers at
any thread count and load. CuPy's host side runs on the same BLAS.

The node's cores are also capped by the cgroup's CPU quota (a container's
``--cpus``). And a share of more than one thread is watched while the run
goes (``core_load.LoadWatch``, started by ``configure``): when other
processes take some of the rank's cores, the pools shrink to the cores
left free, and grow back when those are free again. It never exceeds the
share, and is off with ``OMP_NUM_THREADS`` or ``MPICUBE_NODE_CORES`` set
(someone decided) or ``MPICUBE_ADAPT_THREADS=0``. What it changes is who
computes which fixed panel and row, never a number: docs/performance.md,
"Reproducibility", says what that rests on and how the tests hold it.
"""

from __future__ import annotations

import os
import socket
from dataclasses import asdict, dataclass, field

from ..core.errors import UserError
from . import core_load

NODE_CORES_VAR = "MPICUBE_NODE_CORES"
ADAPT_VAR = "MPICUBE_ADAPT_THREADS"


@dataclass
class Share:
    """This rank's thread budget and how it was decided (recorded in
    config.json and printed by ``bench``)."""

    threads: int                   # threads per rank for every pool
    source: str                    # "OMP_NUM_THREADS" or "node cores"
    node_cores: int                # cores of the node that were shared
    ranks_on_node: int
    rank_cpus: int                 # CPUs this rank may run on (its affinity mask)
    cgroup_cores: int | None = None  # the cgroup's CPU quota in cores (None: no limit)
    host: str = ""
    pools: dict = field(default_factory=dict)    # what each pool was set to: {"blas": 1, "numba": 1, ...}
    adapt: str = "fixed"           # how the count moves in the run: "load", "cycle" or "fixed" (adapt_mode)

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        pools = ", ".join(f"{k} {v}" for k, v in self.pools.items()) or "no thread pools found"
        if self.source == "OMP_NUM_THREADS":
            why = f"OMP_NUM_THREADS={self.threads}"
        else:
            why = f"{self.node_cores} cores / {self.ranks_on_node} rank(s) on {self.host or 'this node'}"
        return f"{self.threads} thread(s) per rank ({why}): {pools}"


def _omp_num_threads(environ) -> int | None:
    """OMP_NUM_THREADS as a positive integer, or None if unset or not one."""
    first = environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    return int(first) if first.isdigit() and int(first) > 0 else None


def node_cores_override(environ=os.environ) -> int | None:
    """MPICUBE_NODE_CORES as a positive integer, None if unset; UserError if malformed."""
    value = environ.get(NODE_CORES_VAR, "").strip()
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise UserError(f"{NODE_CORES_VAR}={value!r}: give the number of cores of a node (1 or more)")
    return int(value)


def decide(ranks_on_node: int, node_cpus: int, rank_cpus: int, environ=os.environ,
           cgroup_cores: int | None = None) -> Share:
    """The share of one rank (pure: the inputs are what the node looks like).

    ``node_cpus``: distinct CPUs in the affinity masks of the node's ranks;
    ``rank_cpus``: CPUs in this rank's own mask; ``cgroup_cores``: the CPU
    quota of the cgroup the ranks run in (None: none), which caps both."""
    omp = _omp_num_threads(environ)
    override = node_cores_override(environ)
    node = override if override is not None else node_cpus
    if cgroup_cores is not None and override is None:
        node, rank_cpus = min(node, cgroup_cores), min(rank_cpus, cgroup_cores)
    if omp is not None:
        return Share(omp, "OMP_NUM_THREADS", node, ranks_on_node, rank_cpus, cgroup_cores)
    n = max(1, min(rank_cpus, node // max(1, ranks_on_node)))
    return Share(n, "node cores", node, ranks_on_node, rank_cpus, cgroup_cores)


def adapts(share: Share, environ=os.environ) -> bool:
    """Whether the rank's pools follow the free cores (``core_load``): a
    share of several threads that nobody fixed by hand."""
    return (share.threads > 1 and share.source == "node cores" and node_cores_override(environ) is None
            and environ.get(ADAPT_VAR, "1").strip() != "0")


def adapt_mode(share: Share, environ=os.environ) -> str:
    """How the rank's thread count moves during the run: "cycle" (at every
    GEMM, ``MPICUBE_ADAPT_THREADS=cycle``: a check that the count changes no
    number), "load" (``core_load.LoadWatch``) or "fixed"."""
    if environ.get(ADAPT_VAR, "").strip() == "cycle" and share.threads > 1:
        return "cycle"
    return "load" if adapts(share, environ) else "fixed"


def _affinity() -> set:
    if hasattr(os, "sched_getaffinity"):
        return set(os.sched_getaffinity(0))
    return set(range(os.cpu_count() or 1))     # pragma: no cover - not Linux


_current: Share | None = None
_configured_for = None             # the communicator _current was decided on
_watch = None                      # core_load.LoadWatch while the pools adapt to the free cores
_openmp = []                       # threadpoolctl's controllers of the OpenMP runtimes, for set_pool_threads
_active = 1                        # threads the rank's GEMM panels and numba kernels use now (<= the share)


def configure(comm=None) -> Share:
    """Decide this rank's share and apply it to every pool. Collective over
    ``comm`` (an mpi4py communicator; None: a single process); calling it
    again with the same communicator only re-applies the limits."""
    global _current, _configured_for, _watch
    if _current is not None and _configured_for is comm:
        apply(_current)
        return _current
    mine = _affinity()
    if comm is None:
        cpus = [mine]
    else:
        from mpi4py import MPI

        local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
        try:
            cpus = local.allgather(sorted(mine))
        finally:
            local.Free()
    share = decide(len(cpus), len(set().union(*map(set, cpus))), len(mine), cgroup_cores=core_load.cgroup_cores())
    share.host = socket.gethostname()
    apply(share)
    _current, _configured_for = share, comm
    share.adapt = adapt_mode(share)
    _watch = {"cycle": lambda: core_load.CycleWatch(share.threads, set_pool_threads),
              "load": lambda: core_load.LoadWatch(mine, share.threads, set_pool_threads),
              "fixed": lambda: None}[share.adapt]()
    return share


def tick() -> None:
    """Called before each GEMM: lets the load watch look at the free cores
    when its period has passed (a clock read otherwise)."""
    if _watch is not None:
        _watch.tick()


def budget() -> int | None:
    """The rank's share of threads (None before ``configure``): what the
    fused kernels choose their build by, so that the numbers a step computes
    never depend on how many cores were free at the time."""
    return _current.threads if _current is not None else None


def active() -> int:
    """Threads the rank's GEMM panels and batched products use now: the
    share, or fewer while the load watch sees its cores taken (1 before
    ``configure``)."""
    return _active


def set_pool_threads(n: int) -> None:
    """Give the GEMM panels, numba and OpenMP n threads (the load watch
    calls it mid-run), without looking for new libraries. The BLAS stays
    on one thread."""
    global _active
    _active = max(1, n)
    for lib in _openmp:
        lib.set_num_threads(n)
    try:
        import numba
    except ImportError:
        return
    numba.set_num_threads(max(1, min(n, numba.config.NUMBA_NUM_THREADS)))


def apply(share: Share) -> None:
    """Set every pool this process has loaded to ``share.threads``, the BLAS to one."""
    global _openmp, _active
    pools = {}
    try:
        from threadpoolctl import ThreadpoolController
    except ImportError:   # pragma: no cover - a core dependency; only a broken install lacks it
        ThreadpoolController = None
    if ThreadpoolController is not None:
        controllers = ThreadpoolController().lib_controllers
        _openmp = [lib for lib in controllers if lib.user_api != "blas"]
        for lib in controllers:
            lib.set_num_threads(1 if lib.user_api == "blas" else share.threads)
            pools[lib.internal_api] = lib.num_threads
    _active = share.threads
    pools["gemm panels"] = share.threads
    try:
        import numba
    except ImportError:
        numba = None
    if numba is not None:
        numba.set_num_threads(max(1, min(share.threads, numba.config.NUMBA_NUM_THREADS)))
        pools["numba"] = numba.get_num_threads()
    share.pools = pools


def limit_new() -> None:
    """Re-apply the share (for libraries loaded after ``configure``, such as
    an OpenMP runtime that CuPy or h5py brings in later)."""
    if _current is not None:
        apply(_current)


def current() -> Share | None:
    """The share last applied in this process (None before ``configure``)."""
    return _current
