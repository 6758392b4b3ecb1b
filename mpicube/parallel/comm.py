"""The only module that calls MPI collectives on array data: ``Comm``, the
communicator wrapper, with its collectives and the buffer helpers that
the function-shaped ones (``comm_start``, ``comm_p2p``, ``comm_wire``,
``comm_alltoall``) share. What a call is counted in (``Counters``,
``Pending``) lives in ``comm_counters``; the uncounted agreement on host
objects (``on_root``, ``agree_max``) in ``comm_agree``. ``Counters``,
``Pending`` and ``on_root`` can still be imported from here, where most
callers find them (every ``comm_*`` helper takes ``Comm`` and ``Pending``
from here).

``Comm`` wraps one mpi4py communicator playing one named role (an *axis* of
the processor grid, such as ``"j"`` of the 3-D cube or ``"dp"``). Every call
is counted with the ring-algorithm conventions of docs/design.md section 4, per
rank:

=================  ===========================  =============
collective         elements moved               messages
=================  ===========================  =============
all-gather         (g-1)/g * gathered size      g-1
reduce-scatter     (g-1)/g * input size         g-1
all-reduce         2 (g-1)/g * size             2 (g-1)
broadcast, reduce  size                         g-1
=================  ===========================  =============

A group of one rank moves nothing and makes no MPI call. Counts are exact
``Fraction``s so the analytic cost model can be compared with ``==``; bytes
are the elements times the width of what MPI really moved.

MPI has no 16-bit floating-point types. Gathers and broadcasts of float16
or bfloat16 arrays move them as raw 2-byte words (no arithmetic touches
them). A sum names its *wire format* at the call site (``wire=``): the
layouts pass the activation format for sums of activations, activation
gradients and weight-gradient partials, so under mixed precision those
travel as 16-bit words and are added in float32 at the receiver
(``mpicube.parallel.comm_wire``: all-to-all, then a gather of the sums). Without a
16-bit ``wire`` a reduction is MPI's own SUM/MAX in the compute format
(16-bit arrays are upcast to float32 and the result rounded back), as for
the small float32 statistics (LayerNorm, cross-entropy, the gradient norm
and the loss) and, except under bfloat16 (``precision.gradient_wire``),
the gradient sums of replicated parameters and of data parallelism; in
float32 and float64 runs ``wire`` equals the data's format and every call
is the plain MPI reduction. (A user-defined 16-bit MPI operation would run a
Python callback per message and round every partial sum to 16 bits.)

On a GPU every call first builds its buffers (the copies, casts and packing
that make a send buffer are kernels queued on the stream), then waits for
the device's queued work, and only then starts its clock and calls MPI
(``_start``, immediately before each MPI call): MPI must not read a buffer
a kernel is still writing, and mpi4py hands a device pointer to MPI without
synchronising anything. GPU compute is so never billed to communication. A
CUDA-aware MPI (``MPICUBE_CUDA_AWARE=1``) gets the device buffers; any other
MPI gets pinned host buffers from a ``Staging`` pool, reused step after step.

Every collective is started nonblocking and completed by
``waiting.complete``, which polls and then sleeps, so a rank that waits
long for the others does not spin on a core; each call also records in
``waiting.WAITS`` what this rank waits in (kind, axis, since when) for the
watchdog (``mpicube.parallel.watchdog``, ``--collective-timeout``).

Under ``--profile`` (``mpicube.parallel.profiler``) a ``Comm`` is built
with a recorder (``Comm(..., recorder=)``), which every communicator split
from it (``split``, ``derive``) inherits; ``_count`` and ``Pending.wait``
hand each call and wait to it while it is on (``Recorder.start``/``stop``,
the profiled steps). A ``Comm`` without one (the default) pays one ``is
None`` check per call; there is no process-wide profiling state.
"""

from __future__ import annotations

import time
from fractions import Fraction

import numpy as np
from mpi4py import MPI

from . import comm_wire
from .comm_agree import on_root  # noqa: F401  (re-exported: many callers import it from here)
from .comm_counters import Counters, Pending
from .waiting import WAITS, complete
from ..device import precision
from ..device.backend import Backend, cuda_aware_mpi
from ..device.staging import Staging

_OPS = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}


def _on_wire(wire) -> bool:
    """True when a sum is to travel in a 16-bit wire format."""
    return wire is not None and precision.is_half(wire)


class Comm:
    """One axis of the processor grid: an mpi4py communicator, its role name,
    the array backend, the shared counters and, under ``--profile``, the
    span recorder (``profiler.Recorder``; None: nothing is recorded)."""

    def __init__(self, mpi_comm, axis: str, backend: Backend, counters: Counters, staging: Staging = None,
                 recorder=None):
        self.mpi = mpi_comm
        self.axis = axis
        self.backend = backend
        self.counters = counters
        self.staging = staging if staging is not None else backend.staging
        self.recorder = recorder
        self.size = mpi_comm.Get_size()
        self.rank = mpi_comm.Get_rank()

    def __repr__(self):
        return f"Comm({self.axis!r}, rank {self.rank} of {self.size})"

    def derive(self, mpi_comm, axis: str) -> "Comm":
        """A Comm on ``mpi_comm`` (a subgroup of this one's) playing role
        ``axis``, sharing this one's backend, counters, staging and recorder."""
        return Comm(mpi_comm, axis, self.backend, self.counters, self.staging, self.recorder)

    def split(self, axis: str, color: int, key: int) -> "Comm":
        """``MPI_Comm_split`` of this communicator as a derived Comm
        (``derive``): collective over this one's ranks."""
        return self.derive(self.mpi.Split(color=color, key=key), axis)

    # --- staging between the backend and MPI -------------------------------
    @property
    def _staged(self) -> bool:
        """Device arrays go through pinned host buffers (GPU, MPI not CUDA-aware)."""
        return self.backend.is_gpu and not cuda_aware_mpi()

    def _start(self, kind: str) -> float:
        """Wait for queued device work, then start the clock and note that
        this rank now waits in collective ``kind`` over this axis. Called
        after the buffers are built and right before the MPI call, so the
        last kernel that writes a send buffer has finished when MPI reads it."""
        self.backend.synchronize()
        return WAITS.enter(kind, self.axis)

    def _to_mpi(self, x):
        """A contiguous buffer MPI may read holding ``x``: a pinned host copy
        when staged (MPI may also write it), else ``x`` itself or a
        contiguous copy."""
        if self._staged:
            buf = self.staging.take(x.shape, x.dtype)
            self.backend.xp.ascontiguousarray(x).get(out=buf)
            return buf
        return self.backend.xp.ascontiguousarray(x)

    def _private(self, x):
        """Like _to_mpi, but always a buffer of our own (in-place reductions
        must not write into the caller's array)."""
        return self._to_mpi(x) if self._staged else x.copy()

    def _empty(self, shape, dtype):
        if self._staged:
            return self.staging.take(shape, dtype)
        return self.backend.xp.empty(shape, dtype=dtype)

    def _from_mpi(self, buf):
        """The device array of a received buffer; a staged buffer goes back to the pool."""
        if not self._staged:
            return buf
        out = self.backend.xp.asarray(buf)
        self.backend.synchronize()          # the copy has finished reading buf
        self.staging.give(buf)
        return out

    def _done(self, buf) -> None:
        """A send buffer MPI has finished with."""
        if self._staged:
            self.staging.give(buf)

    def _count(self, elems, msgs, t0, width: int):
        """Count a call started at ``t0``, which has finished (or, nonblocking, started)."""
        t1 = time.perf_counter()
        self.counters.add(self.axis, elems, msgs, t1 - t0, width)
        rec = self.recorder
        if rec is not None and rec.on:          # --profile: the kind is the one _start named
            rec.comm(self, (WAITS.current or ("call",))[0], t0, t1, Fraction(elems) * width)
        WAITS.leave(t1)

    # --- 16-bit formats ----------------------------------------------------
    def _words(self, x):
        """A 16-bit float array as raw 2-byte words MPI can move (uint16, no
        copy when contiguous); any other array as it is."""
        if not precision.is_half(x.dtype):
            return x
        return self.backend.xp.ascontiguousarray(x).view(self.backend.xp.uint16)

    @staticmethod
    def _wide(x):
        """What a reduction of ``x`` works on: float32 for 16-bit formats."""
        return precision.up(x)

    # --- collectives ------------------------------------------------------
    def allreduce(self, x, op: str = "sum", wire=None):
        """Elementwise reduction over the group; returns a new array (in
        ``x``'s format; 16-bit arrays are reduced in float32). A 16-bit
        ``wire`` sends the sum in that format (``comm_wire.allreduce``: every
        rank gets the same sums, rounded to it)."""
        if self.size == 1:
            return x.copy()
        if _on_wire(wire):
            if op != "sum":
                raise ValueError(f"a 16-bit wire format applies to sums, not {op}")
            return comm_wire.allreduce(self, x, np.dtype(wire))
        wide = self._wide(x)
        buf = self._private(wide) if wide is x else self._to_mpi(wide)   # MPI reduces in place: never into x
        t0 = self._start("allreduce")
        complete(self.mpi.Iallreduce(MPI.IN_PLACE, buf, op=_OPS[op]))
        g = self.size
        self._count(Fraction(2 * (g - 1), g) * buf.size, 2 * (g - 1), t0, buf.itemsize)
        return precision.narrow(self._from_mpi(buf), x.dtype)

    def allgather(self, x, axis: int = 0):
        """Concatenate every rank's ``x`` along ``axis`` in rank order."""
        if self.size == 1:
            return x
        send, recv = self._gather_buffers(x)
        t0 = self._start("allgather")
        complete(self.mpi.Iallgather(send, recv))
        self._count((self.size - 1) * send.size, self.size - 1, t0, send.itemsize)
        self._done(send)
        return self._gathered(recv, x, axis)

    def reduce_scatter(self, x, axis: int = 0, wire=None):
        """Sum over the group, then keep this rank's block along ``axis``
        (16-bit arrays are summed in float32 and returned in their format).
        A 16-bit ``wire`` sends the blocks in that format and adds them in
        float32 at the receiver (``comm_wire.reduce_scatter``)."""
        if self.size == 1:
            return x
        if _on_wire(wire):
            return comm_wire.reduce_scatter(self, x, axis, np.dtype(wire))
        send, recv = self._scatter_buffers(self._wide(x), axis)
        t0 = self._start("reduce_scatter")
        complete(self.mpi.Ireduce_scatter_block(send, recv, op=MPI.SUM))
        self._count(Fraction(self.size - 1, self.size) * send.size, self.size - 1, t0, send.itemsize)
        self._done(send)
        return precision.narrow(self._from_mpi(recv), x.dtype)

    def _gather_buffers(self, x):
        """(send, recv) for gathering ``x`` (as raw words if 16-bit); recv is (g, *x.shape)."""
        words = self._words(x)
        return self._to_mpi(words), self._empty((self.size,) + tuple(x.shape), words.dtype)

    def _gathered(self, recv, x, axis):
        """The (g, *x.shape) receive buffer as ``x`` concatenated along ``axis``."""
        out = self._from_mpi(recv)
        if out.dtype != x.dtype:
            out = out.view(x.dtype)                 # raw 16-bit words back to their format
        if axis % x.ndim == 0:
            return out.reshape((self.size * x.shape[0],) + tuple(x.shape[1:]))
        return self.backend.xp.concatenate(list(out), axis=axis)

    def _scatter_buffers(self, x, axis):
        """(send, recv) for reduce-scattering ``x`` along ``axis``: the send
        buffer holds the g blocks one after another."""
        g, xp = self.size, self.backend.xp
        if axis % x.ndim == 0:
            block_shape = (x.shape[0] // g,) + tuple(x.shape[1:])
        else:
            x = xp.stack(xp.split(x, g, axis=axis))          # (g, *block)
            block_shape = tuple(x.shape[1:])
        return self._to_mpi(x), self._empty(block_shape, x.dtype)

    def bcast(self, x, root: int):
        """Broadcast the root's ``x``; every rank passes an array of the right
        shape and dtype (ignored on non-roots) and gets the root's values
        (16-bit arrays travel as raw words)."""
        if self.size == 1:
            return x
        words = self._words(x)
        if self.rank != root:
            buf = self._empty(x.shape, words.dtype)
            t0 = self._start("bcast")
            complete(self.mpi.Ibcast(buf, root=root))
            self._count(buf.size, self.size - 1, t0, buf.itemsize)
            out = self._from_mpi(buf)
            return out if out.dtype == x.dtype else out.view(x.dtype)
        buf = self._to_mpi(words)
        t0 = self._start("bcast")
        complete(self.mpi.Ibcast(buf, root=root))
        self._count(buf.size, self.size - 1, t0, buf.itemsize)
        self._done(buf)
        if self._staged:
            return x                            # the root keeps its own device array
        return buf if buf.dtype == x.dtype else buf.view(x.dtype)

    def reduce(self, x, root: int, wire=None):
        """Sum onto ``root``; returns the sum there (in ``x``'s format, summed
        in float32 if that is 16-bit) and None elsewhere. A 16-bit ``wire``
        sends the data in that format, sums in float32 where they arrive and
        gathers the sums, rounded to it, onto the root (``comm_wire.reduce``)."""
        if self.size == 1:
            return x
        if _on_wire(wire):
            return comm_wire.reduce(self, x, root, np.dtype(wire))
        send = self._to_mpi(self._wide(x))
        recv = self._empty(x.shape, send.dtype) if self.rank == root else None
        t0 = self._start("reduce")
        complete(self.mpi.Ireduce(send, recv, op=MPI.SUM, root=root))
        self._count(send.size, self.size - 1, t0, send.itemsize)
        self._done(send)
        return precision.narrow(self._from_mpi(recv), x.dtype) if self.rank == root else None

    # --- nonblocking variants, to overlap communication with computation ---
    def iallgather(self, x, axis: int = 0, out=None) -> "Pending":
        """Start ``allgather``; ``.wait()`` returns what it would have. With
        ``out`` (contiguous, g x.size elements of x's format; axis 0) the
        result is written there, received in place unless staged, and
        ``out`` is returned (--zero 3 gathers a layer into a fixed buffer)."""
        if self.size == 1:
            if out is not None:
                out.reshape(-1)[...] = x.reshape(-1)
                return Pending(lambda: out)
            return Pending(lambda: x)
        if out is not None and not self._staged:                 # MPI writes into out itself
            send, recv = self._to_mpi(self._words(x)), self._words(out).reshape((self.size,) + tuple(x.shape))
        else:
            send, recv = self._gather_buffers(x)                 # recv (g, *x.shape)
        t0 = self._start("iallgather")
        request = self.mpi.Iallgather(send, recv)
        self._count((self.size - 1) * send.size, self.size - 1, t0, send.itemsize)

        def finish():
            complete(request)
            self._done(send)
            if out is not None:
                if self._staged:
                    out.reshape(-1)[...] = self._gathered(recv, x, 0).reshape(-1)
                return out
            return self._gathered(recv, x, axis)

        return Pending(finish, self, send, "iallgather")

    def ireduce_scatter(self, x, axis: int = 0, wire=None) -> "Pending":
        """Start ``reduce_scatter``; ``.wait()`` returns this rank's block."""
        if self.size == 1:
            return Pending(lambda: x)
        if _on_wire(wire):
            return comm_wire.ireduce_scatter(self, x, axis, np.dtype(wire), Pending)
        send, recv = self._scatter_buffers(self._wide(x), axis)
        t0 = self._start("ireduce_scatter")
        request = self.mpi.Ireduce_scatter_block(send, recv, op=MPI.SUM)
        self._count(Fraction(self.size - 1, self.size) * send.size, self.size - 1, t0, send.itemsize)

        def finish():
            complete(request)
            self._done(send)
            return precision.narrow(self._from_mpi(recv), x.dtype)

        return Pending(finish, self, send, "ireduce_scatter")

    # --- small host-side helpers (not counted: metadata, not model data) ----
    def barrier(self):
        WAITS.enter("barrier", self.axis)
        complete(self.mpi.Ibarrier())
        WAITS.leave()

    def bcast_object(self, obj, root: int = 0):
        return self.mpi.bcast(obj, root=root)
