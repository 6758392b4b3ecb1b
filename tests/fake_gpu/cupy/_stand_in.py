"""Bookkeeping of the stand-in: transfer counters and the switch that makes
arrays look like device memory to a CUDA-aware MPI.

The counters exist so tests can check mpicube's promise that nothing leaves
the device inside a step except the loss and the gradient norm: every copy
between "host" (NumPy) and "device" (stand-in) memory, and every implicit
synchronisation that CuPy performs to learn a data-dependent size (boolean
masks, nonzero, unique), is counted here. Ranks launched by mpiexec cannot be
asked directly, so with ``MPICUBE_FAKE_GPU_REPORT=<path>`` each process writes
its counters to ``<path>.<pid>`` as JSON when it exits.

Stream order: real work on a GPU is queued and finishes later, and mpi4py
hands a CUDA-aware MPI the raw pointer of a device array without waiting
for it. So the stand-in remembers, per array, whether queued work has
written it since the last synchronisation (``stamp`` / ``pending``; a
synchronisation or a blocking device-to-host copy ``retire``s the queue),
and an array still pending that is handed to MPI raises, naming the call
site (``check_handoff``). ``empty`` allocates without queuing anything; a
host-to-device copy from pageable memory is synchronous in CuPy; every
other array a call creates or writes is queued work.

Kernel launches (only where ``MPICUBE_FAKE_GPU_KERNELS=1`` gives the
stand-in a RawModule, see _kernels.py) are counted by kernel name apart
from the transfers: ``launches()``, and ``"launches"`` in the report.
"""

from __future__ import annotations

import atexit
import json
import os

_counts = {"h2d": 0, "d2h": 0, "h2d_bytes": 0, "d2h_bytes": 0, "syncs": 0}


def transfers() -> dict:
    """A copy of the counters: h2d / d2h (number of copies), h2d_bytes /
    d2h_bytes, syncs (explicit stream or device synchronisations)."""
    return dict(_counts)


def reset_transfers() -> None:
    for key in _counts:
        _counts[key] = 0


def count_h2d(nbytes: int) -> None:
    _counts["h2d"] += 1
    _counts["h2d_bytes"] += int(nbytes)


def count_d2h(nbytes: int) -> None:
    """A blocking device-to-host copy: it waits for the stream, so it also
    retires the queue."""
    _counts["d2h"] += 1
    _counts["d2h_bytes"] += int(nbytes)
    retire()


def count_sync() -> None:
    _counts["syncs"] += 1
    retire()


# --- stream order -------------------------------------------------------------
_epoch = [0]        # bumped by every synchronisation: work queued before it has finished


def retire() -> None:
    """Everything queued so far has finished (a synchronisation, or a
    blocking device-to-host copy, which waits for the stream)."""
    _epoch[0] += 1


def stamp() -> int:
    """The mark of an array queued work writes now (pending until the next
    ``retire``)."""
    return _epoch[0]


def pending(mark) -> bool:
    return mark == _epoch[0]


def check_handoff(mark) -> None:
    """Refuse to give MPI memory that queued work may still be writing."""
    if not pending(mark):
        return
    import traceback

    here = os.path.dirname(os.path.abspath(__file__))
    site = "?"
    for frame in reversed(traceback.extract_stack()[:-1]):
        path = os.path.abspath(frame.filename)
        if not path.startswith(here) and "mpi4py" not in path:
            site = f"{frame.filename}:{frame.lineno} in {frame.name}"
            break
    message = (f"stand-in stream order: {site} hands MPI a device buffer that work queued since the "
               "last synchronisation writes (mpi4py does not synchronise; a CUDA-aware MPI could read "
               "it before the kernel ends): synchronise after building the buffer, right before the call")
    # mpi4py looks the interface up as Cython's hasattr does, which swallows
    # any exception and then reports "expecting buffer": say it here first.
    import sys

    print(message, file=sys.stderr, flush=True)
    raise RuntimeError(message)


_launches = {}          # kernel name -> launches through cupy.RawModule


def launches() -> dict:
    """A copy of the launch counts, {kernel name: launches}."""
    return dict(_launches)


def count_launch(name: str) -> None:
    _launches[name] = _launches.get(name, 0) + 1


def cuda_aware() -> bool:
    """Whether arrays expose ``__cuda_array_interface__``; read on every
    access so a test can flip it inside one process."""
    return os.environ.get("MPICUBE_CUDA_AWARE", "0") == "1"


def _write_report(path: str) -> None:
    with open(f"{path}.{os.getpid()}", "w") as f:
        json.dump({**transfers(), "launches": launches()}, f)


_REPORT = os.environ.get("MPICUBE_FAKE_GPU_REPORT")
if _REPORT:
    atexit.register(_write_report, _REPORT)
