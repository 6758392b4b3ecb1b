"""Race the run-directory lock: in each trial 3 processes call
``rundir.acquire`` on one directory at once (a barrier starts them), and
every one that gets the lock holds it until all trials are done. Exactly one
must hold it in every trial.

The trials cycle through what the directory holds before the race: no lock;
the lock of a dead process; an unreadable (empty) lock, as a job killed
while writing one leaves it; a dead lock with the claim of a taker that died
taking it over. tests/test_rundir.py runs it; by hand, ``python
tests/lock_trials.py [TRIALS]`` prints the counts.
"""

from __future__ import annotations

import json
import multiprocessing
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mpicube.core.errors import UserError
from mpicube.training import rundir

CONTENDERS = 3
CASES = ("no lock", "dead lock", "unreadable lock", "dead lock and a dead taker's claim")


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def _prepare(run_dir: Path, case: str, dead: int) -> None:
    run_dir.mkdir()
    lock = run_dir / rundir.LOCK_FILE
    record = {"host": socket.gethostname(), "pid": dead, "since": time.time(), "token": run_dir.name}
    if case.startswith("dead lock"):
        lock.write_text(json.dumps(record) + "\n")
    elif case == "unreadable lock":
        lock.write_bytes(b"")
    if case.endswith("claim"):
        identity = rundir._look(lock)[0]
        claim = run_dir / f".{rundir.LOCK_FILE}.claim.{identity}"
        claim.write_text(json.dumps({**record, "token": "claimer"}) + "\n")


def _contender(k: int, root: str, trials: int, barrier, held, refused) -> None:
    locks = []                              # held to the end: the others race against a live holder
    for t in range(trials):
        barrier.wait()
        try:
            locks.append(rundir.acquire(Path(root) / f"trial{t}"))
            held[t * CONTENDERS + k] = True
        except UserError as exc:
            refused[t * CONTENDERS + k] = "in use by" in str(exc)
    barrier.wait()
    for lock in locks:
        lock.release()


def race(trials: int, root: Path) -> dict:
    """Run the trials in ``root``; {"double": trials with more than one
    holder, "none": with no holder, "odd": refusals that did not name the
    holder, "debris": trials that left a file behind (all released), "seconds":
    the time taken}."""
    dead = _dead_pid()
    for t in range(trials):
        _prepare(root / f"trial{t}", CASES[t % len(CASES)], dead)
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(CONTENDERS)
    held, refused = ctx.Array("b", CONTENDERS * trials), ctx.Array("b", CONTENDERS * trials)
    t0 = time.monotonic()
    procs = [ctx.Process(target=_contender, args=(k, str(root), trials, barrier, held, refused))
             for k in range(CONTENDERS)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode != 0 for p in procs):
        raise RuntimeError(f"a contender failed: exit codes {[p.exitcode for p in procs]}")
    debris = sum(1 for t in range(trials) if any((root / f"trial{t}").iterdir()))
    holders = [sum(held[t * CONTENDERS:(t + 1) * CONTENDERS]) for t in range(trials)]
    odd = sum(1 for i in range(CONTENDERS * trials) if not held[i] and not refused[i])
    return {"double": sum(n > 1 for n in holders), "none": sum(n == 0 for n in holders), "odd": odd,
            "debris": debris, "seconds": time.monotonic() - t0}


if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
    with tempfile.TemporaryDirectory() as tmp:
        print(f"{n} trials of {CONTENDERS} contenders: {race(n, Path(tmp))}")
