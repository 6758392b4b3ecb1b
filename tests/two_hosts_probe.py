"""What mpicube sees of its node, on every rank (run by tests/test_two_hosts.py).

Each rank takes its thread share (``threads.configure``), its node-local
rank (``backend.node_local``, an MPI_COMM_TYPE_SHARED split) and a GPU the
way ``--device gpu`` does (``make_backend``, here on the CuPy stand-in of
tests/fake_gpu with MPICUBE_FAKE_GPU_COUNT devices); rank 0 prints one JSON
list, one entry per rank.
"""

import json
import socket

from mpi4py import MPI

from mpicube.device import threads
from mpicube.device.backend import make_backend, node_local

world = MPI.COMM_WORLD
share = threads.configure(world)
local_rank, local_size = node_local(world)
make_backend("gpu", "float32", world)

import cupy  # noqa: E402 (the stand-in, after make_backend has chosen the device)

mine = {"rank": world.Get_rank(), "host": socket.gethostname(), "node_local": [local_rank, local_size],
        "gpu": cupy.cuda.runtime.getDevice(), "threads": share.to_dict()}
every = world.gather(mine, root=0)
if world.Get_rank() == 0:
    print(json.dumps(every), flush=True)
