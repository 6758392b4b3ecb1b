"""Rank 0's hold on a run directory: the lock, config.json's launch history,
metrics.jsonl.

Why a lock: the job scripts always pass ``--resume``, so a job resubmitted
by hand while its requeued twin is running, or two scripts given the same
``RUN_DIR``, would write one run: interleaved metrics, each pruning the
other's checkpoints. Rank 0 holds ``RUN/mpicube.lock`` (its host, pid,
process start time and job id) from setup to exit. A lock left by a dead
process on this host is taken over with a message; a lock held by a live
process, or by any process on another host (which this host cannot see), is
refused, unless ``--force-unlock`` says that the other job is gone.

How the lock is taken without a window: the record is written whole into a
file of its own, then ``os.link``-ed to the lock's name, which fails if the
name exists; so nobody ever reads a lock that is still being written (an
empty lock, read as unreadable and taken over, once let two jobs in). A dead
lock is replaced by whoever first claims that very lock (see
``_take_over``). It needs hard links, which the file systems of clusters
(Lustre, GPFS, NFS) have.

Every OSError on these files is a ``RunDirError``: one line naming the file,
exit status 74.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ..core.errors import RunDirError, UserError, io_reason

LOCK_FILE = "mpicube.lock"
CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"
LOCK_WAIT = 10.0        # seconds a contender keeps looking while another one takes a dead lock over


def _process_stat(pid: int) -> list:
    """The fields of /proc/PID/stat after the command name (Linux), or []."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def _process_start(pid: int):
    """The start time of process ``pid`` in clock ticks since boot (Linux), or None."""
    try:
        return int(_process_stat(pid)[19])
    except (IndexError, ValueError):
        return None


def _alive(pid: int, start) -> bool:
    """Whether ``pid`` runs and is the process that took the lock (not a
    later one that was given the same pid). A zombie has ended: a rank
    killed by its launcher's abort stays one until it is reaped, and where
    nothing reaps orphans (a container whose init does not) that is never."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:       # someone else's process: alive
        return True
    stat = _process_stat(pid)
    if stat[:1] == ["Z"]:
        return False
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


def _look(path: Path) -> Optional[tuple]:
    """(identity, record) of the file at ``path`` as it is now; None if there is none.

    The identity hashes the file's inode, modification time and bytes, so
    that a taker can tell whether the lock it judged dead is still the one
    in place (a live job's record holds a random token: no two are alike).
    The record is {} when the file holds none (a lock torn by an older
    mpicube, or foreign)."""
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            raw = f.read(1 << 16)
    except FileNotFoundError:
        return None
    identity = hashlib.sha256(f"{st.st_dev}:{st.st_ino}:{st.st_mtime_ns}:".encode() + raw).hexdigest()[:24]
    try:
        record = json.loads(raw)
    except ValueError:
        record = {}
    return identity, record if isinstance(record, dict) else {}


def _holding(record: dict, host: str, force: bool) -> Optional[str]:
    """Whether the job of ``record`` must be taken to hold what it locked:
    "running" (a live process of this host), "elsewhere" (another host's,
    which this host cannot check, unless ``force``), or None (gone)."""
    if not record:
        return None
    if record.get("host") == host:
        pid = record.get("pid")
        return "running" if isinstance(pid, int) and _alive(pid, record.get("start")) else None
    return None if force else "elsewhere"


def acquire(run_dir: Path, force: bool = False, notes: list | None = None) -> Lock:
    """Take the run directory's lock, or raise UserError naming its holder
    (RunDirError when the directory cannot be read or written)."""
    run_dir = Path(run_dir)
    path = run_dir / LOCK_FILE
    host, pid = socket.gethostname(), os.getpid()
    me = {"host": host, "pid": pid, "start": _process_start(pid), "since": time.time(), "job": _job_id(),
          "token": secrets.token_hex(6)}
    mine = run_dir / f".{LOCK_FILE}.{me['token']}"        # our record, whole before any name points to it
    try:
        try:
            mine.write_text(json.dumps(me) + "\n")
            previous = _take(path, mine, host, force)
        finally:
            with contextlib.suppress(OSError):
                mine.unlink()
    except OSError as exc:
        raise RunDirError(f"{path}: cannot take the run directory's lock ({io_reason(exc)})") from None
    if previous is not None and notes is not None:
        what = describe_owner(previous) if previous else "an unreadable lock"
        why = "--force-unlock" if previous and previous.get("host") != host else "no longer running"
        notes.append(f"note: took over the lock of {run_dir} from {what} ({why})")
    return Lock(path, me["token"])


def _take(path: Path, mine: Path, host: str, force: bool) -> Optional[dict]:
    """Point the lock's name at our record ``mine``. Returns None if there
    was no lock, else the record of the dead lock taken over ({} if it was
    unreadable)."""
    deadline = time.monotonic() + LOCK_WAIT
    while time.monotonic() < deadline:
        try:
            os.link(mine, path)             # one creator wins, and its lock is whole from the first moment
            return None
        except FileExistsError:
            pass
        seen = _look(path)
        if seen is None:
            continue                        # released meanwhile: try again
        identity, owner = seen
        why = _holding(owner, host, force)
        if why == "running":
            raise UserError(f"{path.parent} is in use by {describe_owner(owner)}: two jobs cannot write "
                            f"one run; wait for it to end or choose another --out")
        if why == "elsewhere":
            raise UserError(f"{path.parent} is locked by {describe_owner(owner)}, which this host cannot "
                            f"check: if that job has ended, pass --force-unlock")
        if _take_over(path, mine, identity, host, force):
            return owner
        time.sleep(0.002)                   # another job is taking it over: look again
    raise UserError(f"{path}: could not take the lock (it keeps changing hands)")


def _take_over(path: Path, mine: Path, identity: str, host: str, force: bool) -> bool:
    """Replace the dead lock at ``path`` (``identity`` as we judged it) by
    ours; False if another job took it, or is taking it, meanwhile.

    A taker first claims that very lock: it links its record to a name made
    of the lock's identity, which only one taker can create, then checks
    that the lock is still the one it judged. While the claim stands nobody
    else may change the lock (its owner is dead, new jobs find the name
    taken, other takers find the claim taken), so the check stays true up to
    the atomic replace that follows. A claim left by a taker that died is
    itself claimed the same way, so a death at any moment blocks nobody."""
    chain = [(path, identity)]          # the lock, then dead takers' claims on it, each as judged
    while True:
        claim = path.with_name(f".{LOCK_FILE}.claim.{chain[-1][1]}")
        try:
            os.link(mine, claim)
            break
        except FileExistsError:
            pass
        seen = _look(claim)
        if seen is None or _holding(seen[1], host, force):
            return False                    # that taker finished, or is at work
        chain.append((claim, seen[0]))
    if any((_look(p) or (None,))[0] != judged for p, judged in chain):
        claim.unlink()                      # the lock changed hands since we looked
        return False
    os.replace(claim, path)
    for dead_claim, _ in chain[1:]:
        dead_claim.unlink(missing_ok=True)
    return True


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
    except (FileNotFoundError, ValueError):
        pass                                          # a first launch, or a history nobody can read
    except OSError as exc:
        raise RunDirError(f"{path}: cannot read the run's configuration ({io_reason(exc)})") from None
    out = {**doc, "launches": launches + [launch]}
    tmp = path.with_name(f".{CONFIG_FILE}.tmp")
    try:
        tmp.write_text(json.dumps(out, indent=2) + "\n")
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise RunDirError(f"{path}: cannot write the run's configuration ({io_reason(exc)})") from None


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


def open_metrics(run_dir: Path, start_step: int, notes: list | None = None) -> "MetricsLog":
    """metrics.jsonl opened for appending, its records from ``start_step``
    on (which this launch repeats) cut off first.

    The file is never rewritten, only truncated at the first record to
    drop, so a job killed at any moment loses no record before it. A torn
    last line (a job killed mid-write) is cut off too, but a line that is
    not a record in the middle (edited by hand, a disk's garbage) is only
    passed over: the records after it are kept. Both are said in ``notes``."""
    path = Path(run_dir) / METRICS_FILE
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            with open(os.dup(fd), "rb") as f:
                cut, said = _resume_point(f, start_step)
            os.ftruncate(fd, cut)
        except BaseException:
            os.close(fd)
            raise
    except OSError as exc:
        raise RunDirError(f"{path}: cannot open the run's metrics ({io_reason(exc)})") from None
    if notes is not None:
        notes += [f"note: {path}: {line}" for line in said]
    return MetricsLog(path, fd)


def _resume_point(f, start_step: int) -> tuple:
    """(offset to cut metrics.jsonl at, what was passed over or cut, for the console)."""
    offset, bad, said = 0, [], []
    for number, line in enumerate(f, 1):
        if not line.endswith(b"\n"):
            said.append(f"cut a torn last line (line {number}, {len(line)} bytes: a job stopped mid-write)")
            break
        try:
            rec = json.loads(line) if line.strip() else None
        except ValueError:
            bad.append(number)
            rec = None
        step = rec.get("step") if isinstance(rec, dict) else None
        if isinstance(step, (int, float)) and not isinstance(step, bool) and step >= start_step:
            break
        offset += len(line)
    if bad:
        where = ", ".join(map(str, bad[:5])) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
        said.insert(0, f"passed over {len(bad)} line(s) that are not JSON (line{'s' * (len(bad) > 1)} "
                       f"{where}); kept them and the records after them")
    return offset, said


class MetricsLog:
    """metrics.jsonl, open for appending one record a line.

    Each record goes out in one write of its own; a write that fails (a full
    disk) is undone, so that no torn line stays behind, and raises a
    RunDirError naming the file."""

    def __init__(self, path: Path, fd: int):
        self.path = path
        self.fd = fd

    def write(self, rec: dict) -> None:
        data = memoryview((json.dumps(rec) + "\n").encode())
        size = None
        try:
            size = os.fstat(self.fd).st_size
            while data:
                data = data[os.write(self.fd, data):]
        except OSError as exc:
            if size is not None:
                with contextlib.suppress(OSError):
                    os.ftruncate(self.fd, size)
            raise RunDirError(f"{self.path}: cannot append a record ({io_reason(exc)})") from None

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
