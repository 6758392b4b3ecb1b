"""How many of the rank's cores other processes are using: cgroup CPU
limits read at start, and a watch on the machine's load while a run goes.

Why this module exists: a rank's share of the node (``threads``) counts the
cores it may run on, not the cores that are free. On a laptop with a
browser busy, a login node or a CI runner, another process holds one of
them, and a GEMM split over two threads waits for the half that runs on the
taken core: with one other process spinning on one of two cores, the
default two threads ran 2 to 35 times slower than ``OMP_NUM_THREADS=1``
(issue 36), because OpenBLAS's and numba's workers then share that core
with the other process at the scheduler's time slices.

So ``LoadWatch`` looks, every ``PERIOD_S`` seconds of the run, at two
figures:

* how long this process's threads waited, runnable, for a core
  (``/proc/self/task/*/schedstat``): a taken core shows here. Another
  process's CPU time alone does not say so: MPI ranks that yield the core
  while they wait (other jobs' tests on a CI runner, say) use a good part
  of a core yet give it up at once, and dropping a thread for them halved
  the speed of a run beside them;
* the other processes' load: how much CPU time the rank's cores spent
  busy (``/proc/stat``, per CPU) less the time this process used.

When the threads waited for ``DELAYED`` of a core or more *and* the
others' load leaves fewer free cores than the rank runs threads on, the
rank drops to the cores the others leave free (at least one). Both, because
each alone misleads: the others' CPU time, as said; and the waiting alone
counts the rank's own threads waiting for each other (OpenBLAS's workers
still spinning while numba's run a kernel, or the other way round), which
on an idle machine dropped a 768-wide serial run to one thread for most of
its GEMMs (140-187 against 250-270 GFLOP/s, a 1.25 s step against 0.92 s). It goes back to its whole share when the others' load frees the
cores, and otherwise tries it again every ``PROBE_S`` seconds for one period
(a spinning neighbour costs the probe a few percent; a polite one lets it
stay). The check is a clock read per GEMM, and a few reads of /proc a
few times a second.

Changing the thread count does not change the numbers a step computes:
the BLAS always runs on one thread and a GEMM's panels are fixed by its
shape (``gemm_threads``), numba's threaded kernels run the same code per
row whatever the number of workers, and the choice between a kernel's
threaded and one-thread builds stays with the share (``fused._Kernel``),
not with the current count (the two builds compute the same bits, checked
in tests/test_threads.py). ``CycleWatch`` (``MPICUBE_ADAPT_THREADS=cycle``)
changes the count at every GEMM, so a run can show it.
"""

from __future__ import annotations

import math
import os
import time

PERIOD_S = 0.25                # seconds between two looks at the load (the first one after configure)
DELAYED = 0.2                  # cores' worth of waiting for a core (per second) that makes the rank give one up
PROBE_S = 5.0                  # seconds on fewer threads before trying the whole share again
CGROUP_V2 = "/sys/fs/cgroup/cpu.max"
CGROUP_V1 = ("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", "/sys/fs/cgroup/cpu/cpu.cfs_period_us")


def parse_cpu_max(text: str) -> int | None:
    """Cores allowed by a cgroup v2 ``cpu.max`` ("QUOTA PERIOD" or "max PERIOD"),
    rounded up; None when unlimited or unreadable."""
    parts = text.split()
    if len(parts) != 2 or parts[0] == "max":
        return None
    try:
        quota, period = int(parts[0]), int(parts[1])
    except ValueError:
        return None
    return max(1, math.ceil(quota / period)) if quota > 0 and period > 0 else None


def cgroup_cores(v2: str = CGROUP_V2, v1: tuple = CGROUP_V1) -> int | None:
    """The cores this process's cgroup may use in CPU time (a container's
    ``--cpus``, a CI runner's quota), or None when it sets no limit. Only the
    cgroup at the mount point is read, which is the container's own."""
    try:
        with open(v2) as f:
            return parse_cpu_max(f.read())
    except OSError:
        pass
    try:
        with open(v1[0]) as fq, open(v1[1]) as fp:
            return parse_cpu_max(f"{fq.read().strip()} {fp.read().strip()}".replace("-1 ", "max "))
    except OSError:
        return None


def busy_ticks(stat_text: str, cpus) -> int | None:
    """Clock ticks the given CPUs spent not idle, from /proc/stat's per-CPU
    lines (user nice system idle iowait irq softirq steal ...: busy is all
    but idle and iowait). None when a CPU's line is missing."""
    want, busy, seen = {f"cpu{c}" for c in cpus}, 0, 0
    for line in stat_text.splitlines():
        name, _, rest = line.partition(" ")
        if name in want:
            fields = [int(v) for v in rest.split()]
            busy += sum(fields[:8]) - fields[3] - (fields[4] if len(fields) > 4 else 0)
            seen += 1
    return busy if seen == len(want) else None


# A core counts as taken once other processes use more than this much of it.
# Below half a core on purpose: beside two threads of ours a spinning process
# gets only half to two thirds of its core, and a GEMM split onto a core that
# another process uses a third of the time already waits for its slices.
TAKEN = 0.35


def free_cores(cores: int, others_load: float, share: int) -> int:
    """Threads to run: the cores not taken by other processes (``TAKEN``),
    between 1 and ``share``."""
    return max(1, min(share, int(math.floor(cores - others_load + TAKEN))))


def waited_ns(task_dir: str = "/proc/self/task") -> int | None:
    """Nanoseconds this process's threads have spent runnable but waiting
    for a CPU (the second field of each thread's schedstat); None where the
    kernel does not keep it."""
    total = 0
    try:
        tids = os.listdir(task_dir)
    except OSError:
        return None
    for tid in tids:
        try:
            with open(f"{task_dir}/{tid}/schedstat") as f:
                total += int(f.read().split()[1])
        except (OSError, IndexError, ValueError):
            continue                     # a thread that ended between the listing and the read
    return total


class LoadWatch:
    """Every ``period`` seconds, sets this rank's pools (``set_threads``) to
    what the cores allow (module docstring); ``tick`` is called before each
    float32 GEMM. ``cpus``: the CPUs the rank may run on; ``share``: its
    thread budget, never exceeded."""

    def __init__(self, cpus, share: int, set_threads, stat_path: str = "/proc/stat",
                 task_dir: str = "/proc/self/task", period: float = PERIOD_S):
        self.cpus, self.share, self.set_threads = sorted(cpus), share, set_threads
        self.stat_path, self.task_dir, self.period = stat_path, task_dir, period
        self.hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self.threads = share
        self.next = time.monotonic() + period
        self.changed = time.monotonic()
        self.last = self._sample()

    def _sample(self):
        try:
            with open(self.stat_path) as f:
                busy = busy_ticks(f.read(), self.cpus)
        except OSError:
            busy = None
        t = os.times()
        return time.monotonic(), busy, t.user + t.system, waited_ns(self.task_dir)

    def tick(self) -> None:
        now = time.monotonic()
        if now < self.next:
            return
        self.next = now + self.period
        sample = self._sample()
        (t0, busy0, own0, wait0), (t1, busy1, own1, wait1) = self.last, sample
        self.last = sample
        if busy0 is None or busy1 is None or wait0 is None or wait1 is None or t1 <= t0:
            return
        others = max(0.0, (busy1 - busy0) / self.hz - (own1 - own0)) / (t1 - t0)    # in cores
        waited = max(0, wait1 - wait0) / 1e9 / (t1 - t0)                            # in cores
        free = free_cores(len(self.cpus), others, self.share)
        want = self.threads
        if waited >= DELAYED and free < self.threads:      # waited, and others hold a core our threads need
            want = free
        elif self.threads < self.share and (free > self.threads or t1 - self.changed >= PROBE_S):
            want = self.share
        if want != self.threads:
            self.threads, self.changed = want, t1
            self.set_threads(want)


class CycleWatch:
    """``MPICUBE_ADAPT_THREADS=cycle``: at every ``tick`` (every GEMM) the
    pools take the next count of 1, 2, ..., share, 1, ... A diagnostic: a
    run under it must give the same numbers as at any fixed count
    (tests/test_threads.py runs one), and ``changes`` says it moved."""

    def __init__(self, share: int, set_threads):
        self.share, self.set_threads = share, set_threads
        self.threads, self.changes = share, 0

    def tick(self) -> None:
        self.threads = self.threads % self.share + 1
        self.changes += 1
        self.set_threads(self.threads)
