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

So ``LoadWatch`` looks, every ``PERIOD_S`` seconds of the run, at how much
CPU time the rank's cores spent busy (``/proc/stat``, per CPU) less the
time this process used (its own threads, spinning included): the other
processes' load in cores. The rank then runs on as many threads as there
are cores left free (rounded; at least one, at most its share), and back
on its whole share once they are free again. The check is a clock read per
GEMM and a read of ``/proc/stat`` a few times a second.

Changing the thread count does not change the numbers a step computes:
OpenBLAS splits a GEMM's rows and columns between threads, never its sums
(checked bit for bit in tests/test_threads.py), numba's threaded kernels
run the same code per row whatever the number of workers, and the choice
between a kernel's threaded and one-thread builds stays with the share
(``fused._Kernel``), not with the current count.
"""

from __future__ import annotations

import math
import os
import time

PERIOD_S = 0.25                # seconds between two looks at the load (the first one after configure)
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


def free_cores(cores: int, others_load: float, share: int) -> int:
    """Threads to run: the cores not used by other processes, rounded to the
    nearest whole core, between 1 and ``share``."""
    return max(1, min(share, int(math.floor(cores - others_load + 0.5))))


class LoadWatch:
    """Every PERIOD_S seconds, sets this rank's pools to the cores other
    processes leave free (``threads.set_pool_threads``); ``tick`` is called
    before each float32 GEMM. ``cpus``: the CPUs the rank may run on;
    ``share``: its thread budget, never exceeded."""

    def __init__(self, cpus, share: int, set_threads, stat_path: str = "/proc/stat", period: float = PERIOD_S):
        self.cpus, self.share, self.set_threads = sorted(cpus), share, set_threads
        self.stat_path, self.period = stat_path, period
        self.hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self.threads = share
        self.next = time.monotonic() + period
        self.last = self._sample()

    def _sample(self):
        try:
            with open(self.stat_path) as f:
                busy = busy_ticks(f.read(), self.cpus)
        except OSError:
            busy = None
        t = os.times()
        return time.monotonic(), busy, t.user + t.system

    def tick(self) -> None:
        now = time.monotonic()
        if now < self.next:
            return
        self.next = now + self.period
        sample = self._sample()
        (t0, busy0, own0), (t1, busy1, own1) = self.last, sample
        self.last = sample
        if busy0 is None or busy1 is None or t1 <= t0:
            return
        others = max(0.0, (busy1 - busy0) / self.hz - (own1 - own0)) / (t1 - t0)    # in cores
        want = free_cores(len(self.cpus), others, self.share)
        if want != self.threads:
            self.threads = want
            self.set_threads(want)
