"""Launch real MPI jobs from tests: ``mpiexec -n N python ...``.

The mpiexec next to the test interpreter is used (the mpich wheel in the
venv), never a mock. Every launch has two time limits: MPIEXEC_TIMEOUT makes
mpiexec kill a hung job, and the subprocess timeout backs it up, so a
deadlock fails a test instead of eating CI's time.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MPIEXEC = Path(sys.executable).parent / "mpiexec"

# MPICH spins while it waits; with more ranks than cores that starves the
# rank that has work. Yielding instead makes oversubscribed runs faster.
OVERSUBSCRIBE_ENV = {"MPIR_CVAR_ENABLE_HEAVY_YIELD": "1"}


def job_env(extra: dict | None = None, timeout: int = 120) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    env["MPIEXEC_TIMEOUT"] = str(timeout)
    env.update(OVERSUBSCRIBE_ENV)
    env.update(extra or {})
    return env


def mpiexec(n: int, args: list, timeout: int = 120, env: dict | None = None, cwd=None, python_module=None):
    """Run ``python [args]`` on ``n`` ranks; returns the CompletedProcess
    (stdout and stderr as text). ``args`` starts with what follows python,
    e.g. ["-m", "mpi4py", "script.py", ...] or ["-m", "mpicube", "train", ...]."""
    if not MPIEXEC.exists():
        raise RuntimeError(f"no mpiexec next to {sys.executable}: install the venv with `make install`")
    cmd = [str(MPIEXEC), "-n", str(n), sys.executable] + [str(a) for a in args]
    return subprocess.run(cmd, env=job_env(env, timeout), cwd=str(cwd or ROOT), capture_output=True,
                          text=True, timeout=timeout + 30)


def descendants(pid: int) -> list:
    """Every process below ``pid`` (the ranks under an mpiexec), from /proc."""
    parent = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, todo = [], [pid]
    while todo:
        pid = todo.pop()
        kids = [child for child, p in parent.items() if p == pid]
        found += kids
        todo += kids
    return found


def rank_pid(launcher_pid: int, rank: int):
    """The pid of MPI rank ``rank`` under the launcher (PMI_RANK in its
    environment), or None while it has not started."""
    for pid in descendants(launcher_pid):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        if f"PMI_RANK={rank}".encode() in env:
            return pid
    return None
