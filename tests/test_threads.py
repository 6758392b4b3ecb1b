"""Each rank's thread pools get its share of the node's cores (mpicube.device.threads):
the decision itself, and real ranks under mpiexec whose BLAS and numba pools
are checked from inside, with OMP_NUM_THREADS unset and the node's core count
pretended through MPICUBE_NODE_CORES."""

import json
import os
import subprocess
import sys

import pytest
from mpirun import MPIEXEC, ROOT, job_env

from mpicube.core.errors import UserError
from mpicube.device.threads import decide

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("env, ranks, node, mine, threads, source", [
    ({}, 8, 2, 2, 1, "node cores"),                         # oversubscribed: one thread each
    ({}, 4, 64, 64, 16, "node cores"),                      # unbound ranks share the node
    ({}, 4, 32, 8, 8, "node cores"),                        # each rank bound to its own 8 cores
    ({}, 3, 64, 4, 4, "node cores"),                        # never more than the rank's own mask
    ({"MPICUBE_NODE_CORES": "16"}, 4, 2, 16, 4, "node cores"),
    ({"MPICUBE_NODE_CORES": "16", "OMP_NUM_THREADS": "3"}, 4, 2, 2, 3, "OMP_NUM_THREADS"),
    ({"OMP_NUM_THREADS": "2,1"}, 1, 8, 8, 2, "OMP_NUM_THREADS"),         # nested list: the first level
    ({"OMP_NUM_THREADS": "0"}, 2, 8, 8, 4, "node cores"),                # not a thread count: ignored
])
def test_share(env, ranks, node, mine, threads, source):
    share = decide(ranks, node, mine, env)
    assert (share.threads, share.source) == (threads, source)


def test_bad_node_cores_is_a_user_error():
    with pytest.raises(UserError, match="MPICUBE_NODE_CORES='many'"):
        decide(1, 2, 2, {"MPICUBE_NODE_CORES": "many"})


PROBE = """
import json
from mpi4py import MPI
from threadpoolctl import threadpool_info
from mpicube.device import fused, threads
from mpicube.device.backend import make_backend
make_backend("cpu", "float32", MPI.COMM_WORLD)
info = {"blas": [lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"],
        "numba": fused.numba.get_num_threads() if fused.numba else None,
        "numba_max": fused.numba.config.NUMBA_NUM_THREADS if fused.numba else None,
        "share": threads.current().to_dict()}
ranks = MPI.COMM_WORLD.gather(info)
if ranks is not None:
    print(json.dumps(ranks), flush=True)
"""


def probe(n, node_cores):
    """Every rank's thread pools after make_backend, on n ranks of a node
    said to have ``node_cores`` cores, OMP_NUM_THREADS unset."""
    env = job_env({"MPICUBE_NODE_CORES": str(node_cores)}, timeout=60)
    env.pop("OMP_NUM_THREADS", None)
    p = subprocess.run([str(MPIEXEC), "-n", str(n), sys.executable, "-c", PROBE], env=env, cwd=str(ROOT),
                       capture_output=True, text=True, timeout=90)
    assert p.returncode == 0, p.stdout + p.stderr
    ranks = json.loads(p.stdout.strip().splitlines()[-1])
    assert len(ranks) == n, p.stdout
    return ranks


@pytest.mark.parametrize("n, node_cores", [(4, 4), (2, 16)])
def test_ranks_limit_blas_and_numba_to_their_share(n, node_cores):
    mine = len(os.sched_getaffinity(0))
    want = max(1, min(mine, node_cores // n))
    for rank in probe(n, node_cores):
        assert rank["share"]["threads"] == want and rank["share"]["ranks_on_node"] == n, rank
        assert rank["blas"] and all(t == want for t in rank["blas"]), rank
        if rank["numba"] is not None:
            assert rank["numba"] == min(want, rank["numba_max"]), rank
