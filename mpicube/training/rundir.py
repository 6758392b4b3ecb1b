"""Rank 0's hold on a run directory: the lock, config.json's launch history,
metrics.jsonl.

Why a lock: the job scripts always pass ``--resume``, so a job resubmitted
by hand while its requeued twin is running, or two scripts given the same
``RUN_DIR``, would write one run: interleaved metrics, each pruning the
other's checkpoints. Rank 0 holds ``RUN/mpicube.lock`` (created with
O_EXCL, holding its host, pid, process start time and job id) from setup
to exit. A lock left by a dead process on this host is taken over with a
message; a lock held by a live process, or by any process on another host
(which this host cannot see), is refused, unless ``--force-unlock`` says
that the other job is gone.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from ..core.errors import UserError

LOCK_FILE = "mpicube.lock"
CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"


def _process_start(pid: int):
    """The start time of process ``pid`` in clock ticks since boot (Linux), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _alive(pid: int, start) -> bool:
    """Whether ``pid`` runs and is the process that took the lock (not a
    later one that was given the same pid)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:       # someone else's process: alive
        return True
    now = _process_start(pid)
    return start is None or now is None or now == start


def _job_id() -> str:
    for var in ("SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID", "FLUX_JOB_ID"):
        if os.environ.get(var):
            return f"{var}={os.environ[var]}"
    return ""


@dataclass
class Lock:
    """The run directory's lock while this process holds it."""

    path: Path
    token: str             # letters and digits: names this job's temporary checkpoint dirs

    def release(self) -> None:
        """Remove the lock file if it is still ours (a forced takeover may have replaced it)."""
        try:
            if json.loads(self.path.read_text()).get("token") == self.token:
                self.path.unlink()
        except (OSError, ValueError):
            pass


def describe_owner(owner: dict) -> str:
    since = owner.get("since")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since)) if isinstance(since, (int, float)) else "?"
    job = f", {owner['job']}" if owner.get("job") else ""
    return f"pid {owner.get('pid', '?')} on host {owner.get('host', '?')}{job} (since {when})"


def acquire(run_dir: Path, force: bool = False, notes: list | None = None) -> Lock:
    """Take the run directory's lock, or raise UserError naming its holder."""
    path = Path(run_dir) / LOCK_FILE
    host, pid = socket.gethostname(), os.getpid()
    me = {"host": host, "pid": pid, "start": _process_start(pid), "since": time.time(), "job": _job_id(),
          "token": secrets.token_hex(6)}
    for _ in range(10):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            pass
        else:
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(me) + "\n")
            return Lock(path, me["token"])
        try:
            owner = json.loads(path.read_text())
            if not isinstance(owner, dict):
                raise ValueError
        except FileNotFoundError:
            continue                                   # released meanwhile: try again
        except (OSError, ValueError):
            owner = {}                                 # torn or foreign: nobody can be holding it properly
        if owner:
            same_host = owner.get("host") == host
            if same_host and isinstance(owner.get("pid"), int) and _alive(owner["pid"], owner.get("start")):
                raise UserError(f"{run_dir} is in use by {describe_owner(owner)}: two jobs cannot write "
                                f"one run; wait for it to end or choose another --out")
            if not same_host and not force:
                raise UserError(f"{run_dir} is locked by {describe_owner(owner)}, which this host cannot "
                                f"check: if that job has ended, pass --force-unlock")
        stale = path.with_name(f".{LOCK_FILE}.stale.{me['token']}")
        try:
            os.rename(path, stale)                     # one taker wins; the others retry
        except FileNotFoundError:
            continue
        stale.unlink(missing_ok=True)
        if notes is not None:
            what = describe_owner(owner) if owner else "an unreadable lock"
            why = "--force-unlock" if owner and owner.get("host") != host else "no longer running"
            notes.append(f"note: took over the lock of {run_dir} from {what} ({why})")
    raise UserError(f"{path}: could not take the lock (it keeps changing hands)")


# --------------------------------------------------------------------------- config.json


def record_launch(run_dir: Path, doc: dict, launch: dict) -> None:
    """Write config.json: ``doc`` (the run as this launch sees it) and the
    history of launches, this one appended. Replaced atomically."""
    path = Path(run_dir) / CONFIG_FILE
    launches = []
    try:
        old = json.loads(path.read_text())
        if isinstance(old, dict) and isinstance(old.get("launches"), list):
            launches = old["launches"]
        elif isinstance(old, dict):                   # written before launches were recorded
            launches = [{"train": old.get("train"), "world_size": old.get("world_size"),
                         "mpicube_version": old.get("mpicube_version")}]
    except (OSError, ValueError):
        pass
    out = {**doc, "launches": launches + [launch]}
    tmp = path.with_name(f".{CONFIG_FILE}.tmp")
    tmp.write_text(json.dumps(out, indent=2) + "\n")
    os.replace(tmp, path)


def environment() -> dict:
    """The settings a launch ran with: MPICUBE_*, thread and MPI variables."""
    prefixes = ("MPICUBE_", "OMP_", "OPENBLAS_", "MKL_", "NUMBA_", "CUDA_VISIBLE", "CUPY_", "MPIR_CVAR_")
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(prefixes)}


def versions() -> dict:
    """Python, mpicube's dependencies and the MPI library, as this process has them."""
    import sys

    import h5py
    import numpy

    from .. import __version__

    out = {"mpicube": __version__, "python": sys.version.split()[0], "numpy": numpy.__version__,
           "h5py": h5py.version.version, "hdf5": h5py.version.hdf5_version}
    try:
        import mpi4py
        from mpi4py import MPI

        out["mpi4py"] = mpi4py.__version__
        out["mpi"] = MPI.Get_library_version().splitlines()[0].strip()
    except ImportError:  # pragma: no cover - mpi4py is a core dependency
        pass
    for name in ("numba", "threadpoolctl", "cupy"):
        module = __import__("sys").modules.get(name)
        if module is not None:
            out[name] = getattr(module, "__version__", "?")
    return out


# --------------------------------------------------------------------------- metrics.jsonl


def open_metrics(run_dir: Path, start_step: int):
    """metrics.jsonl opened for appending, its records from ``start_step``
    on (which this launch repeats) cut off first.

    The file is never rewritten, only truncated at the first record to
    drop, so a job killed at any moment loses no record before it. A torn
    last line (a job killed mid-write) is cut off too."""
    path = Path(run_dir) / METRICS_FILE
    f = open(path, "a+b")
    try:
        f.seek(0)
        offset = 0
        for line in f:
            try:
                rec = json.loads(line)
            except ValueError:
                break
            if not line.endswith(b"\n") or (isinstance(rec, dict) and rec.get("step", -math.inf) >= start_step):
                break
            offset += len(line)
        f.truncate(offset)
        f.flush()
    except BaseException:
        f.close()
        raise
    f.close()
    return open(path, "a")
