"""Helper for tests/test_checkpoint.py: run as

    mpiexec -n 4 python -m mpi4py tests/ckpt_mpi_script.py MODE RUN_DIR

MODE "save":  saves steps 1, 2, 3 (keep=2), then saves step 3 again with new
              values (overwrite); every rank reads its own blocks back.
MODE "fault": overwriting step 3 with rank 0's rename failing must raise on
              every rank and keep the old step 3; then saving step 4 with an
              exception on rank 2 (env CKPT_FAULT_RANK) is left uncaught, so
              the job exits non-zero.
MODE "verify": every rank opens RUN_DIR's checkpoint with the communicator;
              rank 0 prints "VERIFY" and JSON of [files hashed, error] per rank.

The expected tensors are defined here (``expected``) and imported by the test.
"""
from __future__ import annotations

import os
import sys

import numpy as np

NRANKS = 4
A_NAME = "model/test.qkv"                  # (10, 12), columns [q | k | v]
R_NAME = "model/test.norm"                 # (12,), replicated, rank 0 writes
W_NAME = "model/wte"                      # (7, 4), vocabulary padded to 8
P_NAME = "optimizer/m/pad"                # (5,), padded to 8; rank 3 holds padding only
S_NAME = "state/tokens_seen"              # scalar, written by rank 1


def expected(step: int, version: int = 0) -> dict:
    off = 1000.0 * step + 100000.0 * version
    return {
        A_NAME: np.arange(120, dtype=np.float64).reshape(10, 12) + off,
        R_NAME: (np.arange(12, dtype=np.float32) * 0.5 + off).astype(np.float32),
        W_NAME: (np.arange(28, dtype=np.float32).reshape(7, 4) - off).astype(np.float32),
        P_NAME: np.arange(5, dtype=np.float64) + off + 0.25,
        S_NAME: np.array(step * 77 + version, dtype=np.int64),
    }


def a_index(r: int):
    """Rank r: rows block r % 2, columns block r // 2 of each of q, k, v."""
    rows = np.arange(5) + 5 * (r % 2)
    cols = np.concatenate([g * 4 + 2 * (r // 2) + np.arange(2) for g in range(3)])
    return rows, cols


def blocks_for(r: int, step: int, version: int = 0):
    from mpicube.files.checkpoint import Block
    ex = expected(step, version)
    out = []
    rows, cols = a_index(r)
    out.append(Block(A_NAME, ex[A_NAME][np.ix_(rows, cols)].copy(), (10, 12), (rows, cols), True))
    out.append(Block(R_NAME, ex[R_NAME].copy(), (12,), (np.arange(12),), r == 0))
    vrows = np.arange(2) + 2 * r                       # 8 padded rows, 2 per rank
    w = np.full((2, 4), -999.0, np.float32)            # padding rows hold garbage
    real = vrows < 7
    w[real] = ex[W_NAME][vrows[real]]
    out.append(Block(W_NAME, w, (7, 4), (vrows, np.arange(4)), True))
    prow = np.arange(2) + 2 * r
    p = np.full(2, 12345.0)
    p[prow < 5] = ex[P_NAME][prow[prow < 5]]
    out.append(Block(P_NAME, p, (5,), (prow,), True))
    out.append(Block(S_NAME, ex[S_NAME].copy(), (), (), r == 1))
    return out


def attrs_for(step: int):
    return {
        "config": {"vocab_size": 7, "n_ctx": 8, "n_layer": 1, "n_head": 2, "n_embd": 4},
        "train": '{"lr": 0.001, "batch_size": 4}',
        "layout": {"name": "test", "ranks": NRANKS},
        "note": "plain string",
        "loss": 3.25,
    }


def check_readback(comm, path, step, version):
    """Every rank loads its own blocks back, as a trainer resuming would."""
    from mpicube.files.checkpoint import open_checkpoint
    comm.Barrier()
    with open_checkpoint(path, verify=comm.Get_rank() == 0) as ck:
        assert ck.step == step, ck.step
        for b in blocks_for(comm.Get_rank(), step, version):
            got = ck.read(b.name, b.index)
            want = np.asarray(b.local).copy()
            if want.ndim:
                pad = np.zeros(want.shape, bool)
                for d, ix in enumerate(b.index):
                    sl = [None] * want.ndim
                    sl[d] = slice(None)
                    pad = pad | (np.asarray(ix) >= b.shape[d])[tuple(sl)]
                want[pad] = 0
            np.testing.assert_array_equal(got, want, err_msg=b.name)


def main(mode: str, run_dir: str) -> None:
    from mpi4py import MPI
    from mpicube.files import checkpoint as C
    from mpicube.files.checkpoint import write as checkpoint_write

    comm = MPI.COMM_WORLD
    r = comm.Get_rank()
    assert comm.Get_size() == NRANKS

    if mode == "save":
        for step in (1, 2, 3):
            p = C.save(run_dir, step, blocks_for(r, step), attrs_for(step), comm, keep=2)
            assert p.name == "step_%08d" % step
            assert comm.allgather(str(p)) == [str(p)] * NRANKS
            check_readback(comm, p, step, 0)
        # overwrite step 3 with new values (moves the old dir aside)
        p = C.save(run_dir, 3, blocks_for(r, 3, version=1), attrs_for(3), comm, keep=2)
        check_readback(comm, p, 3, 1)
        if r == 0:
            print("SAVE-OK", flush=True)
        return

    if mode == "fault":
        # 1) the rename on rank 0 fails while overwriting step 3
        real_replace = os.replace
        if r == 0:
            def bad_replace(src, dst, *a, **k):
                if os.path.basename(os.fspath(src)).startswith(".tmp_step_"):
                    raise OSError("injected rename failure")
                return real_replace(src, dst, *a, **k)
            os.replace = bad_replace       # os is one module: this reaches the checkpoint writer
        try:
            C.save(run_dir, 3, blocks_for(r, 3, version=2), attrs_for(3), comm)
        except C.CheckpointError as e:
            assert "injected rename failure" in str(e), str(e)
        else:
            raise AssertionError("save with a failing rename did not raise")
        finally:
            os.replace = real_replace
        check_readback(comm, os.path.join(run_dir, "ckpt", "step_00000003"), 3, 1)
        if r == 0:
            print("RENAME-FAULT-OK", flush=True)
        comm.Barrier()

        # 2) an exception on rank CKPT_FAULT_RANK after it wrote its shard,
        #    i.e. just before rank 0 would commit; left uncaught.
        if r == int(os.environ.get("CKPT_FAULT_RANK", "-1")):
            def boom(path):
                raise RuntimeError(f"injected fault on rank {r}")
            checkpoint_write._sha256_file = boom
        C.save(run_dir, 4, blocks_for(r, 4), attrs_for(4), comm, keep=2)
        print("UNREACHABLE: save with a faulty rank returned", flush=True)
        return

    if mode == "verify":
        import json
        from pathlib import Path

        from mpicube.files.checkpoint import read as checkpoint_read
        hashed = []
        real_sha = checkpoint_read._sha256_file

        def recording_sha(path):
            hashed.append("/".join(Path(path).parts[-2:]))
            return real_sha(path)
        checkpoint_read._sha256_file = recording_sha
        error = None
        try:
            C.open_checkpoint(run_dir, comm=comm).close()
        except C.CheckpointError as e:
            error = str(e)
        everyone = comm.gather([sorted(hashed), error])
        if r == 0:
            print("VERIFY " + json.dumps(everyone), flush=True)
        return

    raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
