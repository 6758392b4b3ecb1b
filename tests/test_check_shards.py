"""Sharded traces: each rank's block with its global index, put back
together by compare, replicas checked against each other.

A good trace is re-written with some tensors as shards - a column split,
a row split with non-contiguous indices (a context-parallel rank's two
chunks), replicated copies, a replicated scalar - and must still agree with
the original; a replica that drifts is named with its ranks, an element no
rank holds is a divergence, a block that does not fit is bad input.
"""

import h5py
import numpy as np
import pytest
from test_check import run  # noqa: F401 - the good-trace fixtures below
from test_check import good, variant  # noqa: F401

from mpicube.check import shards
from mpicube.check.shards import Shard, Sharded


def reshard(name, make):
    """An edit replacing dataset ``name`` by ``make(values)`` -> Sharded."""
    def edit(f):
        values = f[name][()]
        dtype = values.dtype
        del f[name]
        shards.write(f, name, make(values), dtype)
    return edit


def column_split(w):                                      # two ranks, each half of the columns
    n = w.shape[1] // 2
    return Sharded(w.shape, [Shard(0, (slice(None), slice(0, n)), w[:, :n]),
                             Shard(1, (slice(None), slice(n, None)), w[:, n:])])


def chunks(a):                                            # (B, T, h): rank 0 positions {0, 3}, rank 1 {1, 2}
    mine = {0: np.array([0, 3]), 1: np.array([1, 2])}
    return Sharded(a.shape, [Shard(r, (slice(None), ix, slice(None)), a[:, ix]) for r, ix in mine.items()])


def replicated(a, ranks=(0, 1, 2), drift=None):
    """Copies on ``ranks``; ``drift`` = (rank, factor) scales one copy."""
    copies = []
    for r in ranks:
        copy = np.array(a, dtype=np.float64) * (drift[1] if drift and drift[0] == r else 1.0)
        copies.append(Shard(r, tuple(slice(None) for _ in np.shape(a)), copy))
    return Sharded(np.shape(a), copies)


def combined(*edits):
    def edit(f):
        for e in edits:
            e(f)
    return edit


def test_sharded_tensors_put_together_agree_with_the_logical_ones(good, variant, capsys):
    b = variant(combined(reshard("step_1/grad/h.0.attn.c_attn.weight", column_split),
                         reshard("step_2/act/h.1", chunks),
                         reshard("step_1/grad/h.1.ln_1.weight", replicated),
                         reshard("step_1/loss", replicated)))
    with h5py.File(b, "r") as f:
        assert f["step_1/loss"].attrs["sharded"] == 1 and set(f["step_1/loss"]) == {"rank0", "rank1", "rank2"}
        assert list(f["step_2/act/h.1/rank0/index_1"][()]) == [0, 3]
    status, out, _, summary = run(capsys, good, b)
    assert status == 0 and "all tensors agree" in out, out
    assert summary["tensors"] == run(capsys, good, good)[3]["tensors"]


def test_a_replica_that_drifts_is_named_with_its_ranks(good, variant, capsys):
    b = variant(reshard("step_1/grad/h.0.ln_2.weight", lambda a: replicated(a, drift=(2, 1 + 1.4e-3))))
    status, out, _, summary = run(capsys, good, b)
    assert status == 1 and summary["first_divergence"] == "step_1/grad/h.0.ln_2.weight"
    assert "B: replicas part: ranks 0 and 2 differ by max rel" in out
    # the disagreement as a number in the row and the --json line (it was inf and null)
    assert summary["max_rel"] is not None and 1e-3 < summary["max_rel"] < 2e-3, summary
    [row] = [line for line in out.splitlines() if line.startswith("step_1/grad/h.0.ln_2.weight ")]
    assert " inf " not in row and f"{summary['max_rel']:.2e}" in row, row


def test_an_element_no_rank_holds_is_a_divergence(good, variant, capsys):
    def half(w):
        n = w.shape[1] // 2
        return Sharded(w.shape, [Shard(0, (slice(None), slice(0, n)), w[:, :n])])
    status, out, _, summary = run(capsys, good, variant(reshard("init/h.1.mlp.c_fc.weight", half)))
    assert status == 1 and summary["first_divergence"] == "init/h.1.mlp.c_fc.weight"
    assert "at least 128 elements held by no rank (256 declared, 128 stored" in out     # said before assembling


def test_a_block_that_does_not_fit_is_bad_input(good, variant, capsys):
    def misplaced(f):
        reshard("step_1/grad/wpe", column_split)(f)
        ix = f["step_1/grad/wpe/rank1/index_1"]
        ix[...] = ix[()] + 1                               # past the last column
    status, _, err, _ = run(capsys, good, variant(misplaced))
    assert status == 2 and len(err.strip().splitlines()) == 1
    assert "variant.h5: step_1/grad/wpe/rank1: index_1 does not fit" in err


def test_the_writer_refuses_an_index_of_the_wrong_length(tmp_path):
    from mpicube.core.errors import UserError

    with h5py.File(tmp_path / "x.h5", "w") as f, pytest.raises(UserError, match="index 0 has 3 entries for a block 2"):
        shards.write(f, "t", Sharded((4,), [Shard(0, (np.array([0, 1, 2]),), np.zeros(2))]), np.float64)


def test_mpicube_sharded_trace_matches_serial_and_keeps_every_replica(tmp_path, corpus_cache):
    """`trace --sharded` on 1-D x 2: each rank's blocks with their global
    indices, the replicated LayerNorm copies both kept; compare puts them
    together and agrees with the serial trace, and a drifted copy in one
    rank's block is then named with both ranks."""
    from conftest import MpiCube

    runner = MpiCube(tmp_path, corpus_cache)
    model = ["--n-layer", "1", "--n-head", "2", "--n-embd", "8", "--seq-len", "8", "--batch-size", "2",
             "--dtype", "float64", "--dropout", "0.1", "--steps", "1"]
    assert runner.run("trace", "--layout", "serial", *model, "--out", "serial.h5").returncode == 0
    r = runner.run("trace", "--layout", "1d", "--sharded", *model, "--out", "sharded.h5", n=2)
    assert r.returncode == 0, r
    r = runner.run("compare", "serial.h5", "sharded.h5")
    assert r.returncode == 0 and "all tensors agree" in r.stdout, r
    with h5py.File(tmp_path / "sharded.h5", "r+") as f:
        ln = f["step_1/grad/h.0.ln_2.bias"]
        assert set(ln) == {"rank0", "rank1"} and ln.attrs["sharded"] == 1        # replicated over tp
        assert not np.array_equal(f["init/h.0.attn.c_attn.weight/rank0/index_1"][()],
                                  f["init/h.0.attn.c_attn.weight/rank1/index_1"][()])   # split over tp
        ln["rank1/data"][0] *= 1.01
    r = runner.run("compare", "serial.h5", "sharded.h5")
    assert r.returncode == 1 and "first divergence: step_1/grad/h.0.ln_2.bias" in r.stdout, r
    assert "replicas part: ranks 0 and 1" in r.stdout


def test_shards_with_indices_out_of_order_are_placed_by_their_indices(good, variant, capsys):
    """A framework may list a block's global indices in any order (a
    permuted expert order, a context-parallel rank's chunks written last
    first): element k of the block belongs at index[k], not at the k-th
    smallest index. Two ranks hold the rows of a (V, h) tensor, rank 0 rows
    [5, 0, 3, ...] descending and interleaved, rank 1 the rest in a shuffled
    order; the columns of rank 1 are reversed too."""
    order = np.random.default_rng(48).permutation

    def scattered(w):                                     # (V, h) -> two blocks with non-monotone indices
        rows = order(w.shape[0])
        mine, theirs = rows[: w.shape[0] // 2], rows[w.shape[0] // 2:]
        cols = np.arange(w.shape[1])[::-1]
        assert (np.diff(mine) < 0).any() and (np.diff(mine) > 0).any()      # neither ascending nor descending
        return Sharded(w.shape, [Shard(0, (mine, slice(None)), w[mine]),
                                 Shard(1, (theirs, cols), w[np.ix_(theirs, cols)])])

    b = variant(reshard("step_1/grad/wte", scattered))
    with h5py.File(good, "r") as f, h5py.File(b, "r") as g:
        want = f["step_1/grad/wte"][()]                                   # (V, h)
        got, problem = shards.assemble(g["step_1/grad/wte"], b, 0.0, 0.0)
    assert problem == "" and np.array_equal(got, want)
    status, out, _, summary = run(capsys, good, b)
    assert status == 0 and "all tensors agree" in out, out
