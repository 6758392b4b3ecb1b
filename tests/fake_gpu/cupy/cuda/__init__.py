"""``cupy.cuda`` of the stand-in: devices, streams and events without a GPU.

Work on the stand-in finishes when the call returns, so synchronising waits
for nothing; it is counted (``syncs``) so tests can see where mpicube waits
for the device before handing buffers to MPI.
"""

from __future__ import annotations

import os
import time

from .. import _stand_in
from .._memory import MemoryPointer
from . import runtime


def is_available() -> bool:
    try:
        return runtime.getDeviceCount() > 0
    except runtime.CUDARuntimeError:
        return False


class Device:
    """A device ordinal; ``use()`` makes it current, ``with`` switches for a block."""

    def __init__(self, device=None):
        self.id = runtime.getDevice() if device is None else int(device)
        self._previous = []

    def __int__(self):
        return self.id

    def __repr__(self):
        return f"<CUDA Device {self.id}>"

    def __eq__(self, other):
        return isinstance(other, Device) and self.id == other.id

    def __hash__(self):
        return hash(self.id)

    def use(self):
        runtime.setDevice(self.id)
        return self

    def __enter__(self):
        self._previous.append(runtime.getDevice())
        runtime.setDevice(self.id)
        return self

    def __exit__(self, *exc):
        runtime.setDevice(self._previous.pop())

    def synchronize(self):
        _stand_in.count_sync()

    @property
    def mem_info(self) -> tuple:
        """(free, total) bytes, as CuPy's; the stand-in's device memory is the host's."""
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page


class Event:
    """Records the host clock; ``get_elapsed_time`` gives milliseconds."""

    def __init__(self, block=False, disable_timing=False, interprocess=False):
        self._time = None
        self.disable_timing = disable_timing

    def record(self, stream=None):
        self._time = time.perf_counter()

    @property
    def done(self) -> bool:
        return True

    def synchronize(self):
        _stand_in.count_sync()


def get_elapsed_time(start_event: Event, end_event: Event) -> float:
    if start_event._time is None or end_event._time is None:
        raise RuntimeError("stand-in: both events must be recorded")
    return (end_event._time - start_event._time) * 1000.0


class Stream:
    """A CUDA stream; the null stream is ``Stream.null`` and is current by default."""

    null = None  # set below

    def __init__(self, null=False, non_blocking=False, ptr=None):
        self.ptr = 0 if null else id(self)
        self._previous = []

    def synchronize(self):
        _stand_in.count_sync()

    def record(self, event=None):
        event = event or Event()
        event.record(self)
        return event

    def wait_event(self, event):
        pass

    @property
    def done(self) -> bool:
        return True

    def use(self):
        global _current_stream
        _current_stream = self
        return self

    def __enter__(self):
        self._previous.append(_current_stream)
        return self.use()

    def __exit__(self, *exc):
        self._previous.pop().use()


Stream.null = Stream(null=True)
_current_stream = Stream.null


def get_current_stream(device_id=-1) -> Stream:
    return _current_stream


__all__ = ["Device", "Event", "MemoryPointer", "Stream", "get_current_stream", "get_elapsed_time",
           "is_available", "runtime"]
