"""MPI on stand-in arrays, run by tests/test_fake_gpu.py under ``mpiexec -n 2``.

Without MPICUBE_CUDA_AWARE=1 every collective must refuse a stand-in array
(it has no buffer protocol and no CUDA array interface); with it, mpi4py
reads and writes the arrays' memory directly and the results must be right.
Each check synchronises the stream after building its buffers and before
the MPI call, as the stand-in's stream-order check (and a CUDA-aware MPI)
requires. The only counted transfers are the checks' own reads of their results (one
``get`` per check that ran), which the test reads from the exit report. Rank 0 prints one JSON line: the outcome of
each collective ("ok", "refused: <error>" or "wrong: <detail>").
"""

import json
import os

import numpy as np
from mpi4py import MPI

import cupy

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()


def sync() -> None:
    """The buffers are built: wait for the queued work before MPI reads them."""
    cupy.cuda.get_current_stream().synchronize()


def expect(got: "cupy.ndarray", want: np.ndarray) -> str:
    host = got.get()
    return "ok" if host.dtype == want.dtype and np.array_equal(host, want) else f"wrong: {host!r} != {want!r}"


def allreduce():
    send = cupy.arange(6, dtype=cupy.float32) + rank  # (6,)
    recv = cupy.empty_like(send)
    sync()
    comm.Allreduce(send, recv, op=MPI.SUM)
    return expect(recv, sum(np.arange(6, dtype=np.float32) + r for r in range(size)))


def allreduce_in_place():
    buf = cupy.full((2, 3), rank + 1, dtype=cupy.float64)  # (2, 3)
    sync()
    comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.MAX)
    return expect(buf, np.full((2, 3), size, dtype=np.float64))


def allgather():
    send = cupy.full(3, rank, dtype=cupy.int32)  # (3,)
    recv = cupy.zeros((size, 3), dtype=cupy.int32)  # (size, 3)
    sync()
    comm.Allgather(send, recv)
    return expect(recv, np.repeat(np.arange(size, dtype=np.int32), 3).reshape(size, 3))


def bcast():
    buf = cupy.arange(4, dtype=cupy.float32) * 10 if rank == 0 else cupy.zeros(4, dtype=cupy.float32)
    sync()
    comm.Bcast(buf, root=0)
    return expect(buf, np.arange(4, dtype=np.float32) * 10)


def reduce_scatter_block():
    send = cupy.ones((size, 2), dtype=cupy.float32) * (rank + 1)  # (size, 2)
    recv = cupy.empty(2, dtype=cupy.float32)  # (2,)
    sync()
    comm.Reduce_scatter_block(send, recv, op=MPI.SUM)
    return expect(recv, np.full(2, size * (size + 1) / 2, dtype=np.float32))


def sendrecv_into_view():
    """A contiguous row of a larger array as the receive buffer."""
    buf = cupy.zeros((3, 4), dtype=cupy.float64)  # (3, 4)
    send = cupy.full(4, rank, dtype=cupy.float64)  # (4,)
    peer = (rank + 1) % size
    sync()
    comm.Sendrecv(send, dest=peer, recvbuf=buf[1], source=(rank - 1) % size)
    want = np.zeros((3, 4))
    want[1] = (rank - 1) % size
    return expect(buf, want)


def main():
    outcomes = {}
    for check in (allreduce, allreduce_in_place, allgather, bcast, reduce_scatter_block, sendrecv_into_view):
        try:
            outcomes[check.__name__] = check()
        except Exception as exc:  # the refusal the test expects without CUDA awareness
            outcomes[check.__name__] = f"refused: {type(exc).__name__}: {exc}"
    all_outcomes = comm.gather(outcomes, root=0)
    if rank == 0:
        print(json.dumps({"cuda_aware": os.environ.get("MPICUBE_CUDA_AWARE"), "ranks": all_outcomes}))


main()
