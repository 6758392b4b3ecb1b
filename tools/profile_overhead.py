"""What ``--profile`` costs, per call and per step, measured in one process.

    .venv/bin/python tools/profile_overhead.py [--trace RUN_DIR/profile.json]

Prints the nanoseconds of
* the check every ``Comm`` call makes when no profile runs
  (``self.recorder is not None`` on a Comm built without a recorder): the
  whole cost of profiling when off;
* a module call through ``profiler.timed`` against the plain call (two
  clock reads, a try/finally and one list append);
* ``Recorder.comm``, what each counted call adds under a profile.
With ``--trace``, the spans per rank and step of that trace times those
costs, against its steps' wall time: the overhead a profile adds to them.
Each figure is the minimum of 40 repeats of ``timeit`` (the machine's other
load only adds to a repeat, so the minimum is the cost).
"""

from __future__ import annotations

import argparse
import json
import sys
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mpi4py import MPI  # noqa: E402

from mpicube.device.backend import make_backend  # noqa: E402
from mpicube.parallel import profiler  # noqa: E402
from mpicube.parallel.comm import Comm, Counters  # noqa: E402

N = 20_000


def ns(stmt) -> float:
    return min(timeit.repeat(stmt, number=N, repeat=40)) / N * 1e9


class Module:
    def forward(self, x):
        return x


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", help="a profile.json whose spans to price")
    args = parser.parse_args()
    rec = profiler.Recorder()
    comm = Comm(MPI.COMM_SELF, "tp", make_backend("cpu", "float32"), Counters())
    plain, wrapped = Module(), Module()
    profiler.timed(rec, wrapped, "forward", "m forward", {"module": "m"})

    def off_check():
        rec_ = comm.recorder                    # what Comm._count reads: None without --profile
        if rec_ is not None and rec_.on:
            pass

    def empty():
        pass

    check = ns(off_check) - ns(empty)
    call, timed = ns(lambda: plain.forward(1)), ns(lambda: wrapped.forward(1))
    rec.spans.clear()
    comm_ns = ns(lambda: rec.comm(comm, "allreduce", 0.0, 1.0, 1024))
    print(f"off: {check:.0f} ns per Comm call (the recorder check)")
    print(f"on: a module call {timed - call:.0f} ns more than plain ({call:.0f} ns -> {timed:.0f} ns); "
          f"a counted call {comm_ns:.0f} ns more")
    if args.trace:
        doc = json.loads(Path(args.trace).read_text())
        xs = [e for e in doc["traceEvents"] if e.get("ph") == "X"]
        steps = [e for e in xs if e.get("cat") == "step"]
        n_compute = sum(e.get("cat") == "compute" for e in xs) / len(steps)
        n_comm = sum(e.get("cat") == "comm" for e in xs) / len(steps)
        wall = sum(e["dur"] for e in steps) / len(steps) * 1e3
        added = n_compute * (timed - call) + n_comm * comm_ns
        print(f"{args.trace}: per rank and step {n_compute:.0f} compute and {n_comm:.0f} communication spans, "
              f"{added / 1e3:.0f} us added to a {wall / 1e6:.1f} ms step ({100 * added / wall:.2f}%)")


if __name__ == "__main__":
    main()
