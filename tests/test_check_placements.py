"""Placements in sharded traces (check/placements.py, format version 3):
each block's placement on each mesh axis - replicated, split along a
dimension, a pending sum - inferred from the indices where a writer does
not declare it, pending sums added before the comparison, and the
placements that cannot be right named by tensor and rank: a pending sum
consumed as replicated (the copies differ, or agree and are each one
part), ranks that disagree on a placement, a parameter that is a pending
sum, a sum with a part missing. numpy and h5py only; mpicube's own
placements are checked through the planted catalogue
(tests/test_planted_bugs.py, ``dp-partial``).
"""

import numpy as np
import pytest
from test_check import run  # noqa: F401 - the good-trace fixtures below
from test_check import good, variant  # noqa: F401

from mpicube.check import placements, shards
from mpicube.check.shards import Shard, Sharded

MESH = (("dp", "tp"), (2, 2))
COORDS = {0: (0, 0), 1: (0, 1), 2: (1, 0), 3: (1, 1)}        # rank -> (dp, tp)


def placed(name, make):
    """An edit replacing dataset ``name`` by ``make(values)`` -> Sharded
    whose placements ``infer`` completes, under the 2 x 2 mesh."""
    def edit(f):
        values = f[name][()]
        dtype = values.dtype
        del f[name]
        f.attrs["mesh"] = placements.mesh_attr(*MESH)
        shards.write(f, name, placements.infer(make(values), MESH[1]), dtype)
    return edit


def tp_columns(w):
    """Columns split over tp, replicated over dp: S(1) on tp, R on dp."""
    n = w.shape[1] // 2
    return Sharded(w.shape, [Shard(r, (slice(None), slice(n * c[1], n * (c[1] + 1))), w[:, n * c[1]:n * (c[1] + 1)],
                                   coords=c) for r, c in COORDS.items()])


def tp_pending(w, parts=(0.25, 0.75), ranks=COORDS):
    """Every rank's part of a sum over tp (declared P), replicated over dp."""
    return Sharded(np.shape(w), [Shard(r, tuple(slice(None) for _ in np.shape(w)), w * parts[c[1]],
                                       placement=(None, placements.PARTIAL), coords=c)
                                 for r, c in COORDS.items() if r in ranks])


def tp_copies(w, parts=(1.0, 1.0)):
    """Copies on every rank, tp coordinate c scaled by parts[c] (inferred R)."""
    return Sharded(np.shape(w), [Shard(r, tuple(slice(None) for _ in np.shape(w)), w * parts[c[1]], coords=c)
                                 for r, c in COORDS.items()])


def test_placements_are_inferred_from_the_indices_and_declared_sums_kept():
    w = np.arange(12.0).reshape(3, 4)
    cols = placements.infer(tp_columns(w), MESH[1])
    assert {s.placement for s in cols.shards} == {("R", "S(1)")}
    pending = placements.infer(tp_pending(w), MESH[1])
    assert {s.placement for s in pending.shards} == {("R", "P")}
    one_stage = Sharded(w.shape, [Shard(0, (slice(None), slice(None)), w, coords=(0, 0)),
                                  Shard(1, (slice(None), slice(None)), w, coords=(0, 1))])
    assert {s.placement for s in placements.infer(one_stage, MESH[1]).shards} == {("-", "R")}


def test_placed_tensors_and_pending_sums_put_together_agree(good, variant, capsys):
    b = variant(lambda f: [placed("step_1/grad/h.0.attn.c_attn.weight", tp_columns)(f),
                           placed("step_1/grad/h.1.mlp.c_fc.weight", tp_pending)(f),
                           placed("step_1/act/h.0", tp_pending)(f)])
    import h5py
    with h5py.File(b, "r") as f:
        assert f.attrs["mesh"] and f["step_1/act/h.0/rank3"].attrs["placement"] == "R,P"
        assert list(f["step_1/act/h.0/rank3"].attrs["coords"]) == [1, 1]
    status, out, _, _ = run(capsys, good, b)
    assert status == 0 and "all tensors agree" in out, out


@pytest.mark.parametrize("parts,note,over", [
    ((0.25, 0.75), "B: replicas part: ranks 0 and 1 differ", "tp"),     # the parts differ: the copies part
    ((0.5, 0.5), "", "dp or tp"),             # identical parts: every copy agrees, each wrong; either axis fits
], ids=["parts-differ", "identical-inputs"])
def test_a_pending_sum_consumed_as_replicated_is_named_with_its_axis_and_ranks(good, variant, capsys, parts, note,
                                                                               over):
    name = "step_1/grad/h.1.mlp.c_fc.weight"
    status, out, _, summary = run(capsys, good, variant(placed(name, lambda w: tp_copies(w, parts))))
    assert status == 1 and summary["first_divergence"] == name, out
    row = next(line for line in out.splitlines() if line.startswith(name))
    assert note in row and (f"B: a pending sum over {over} consumed as replicated: ranks 0, 1, 2, 3 hold parts whose "
                            f"sum over {over} is the other trace's tensor") in row, row


def test_a_wrong_tensor_that_is_no_missing_sum_gets_no_such_note(good, variant, capsys):
    name = "step_1/grad/h.1.mlp.c_fc.weight"
    status, out, _, summary = run(capsys, good, variant(placed(name, lambda w: tp_copies(w, (1.1, 1.1)))))
    assert status == 1 and summary["first_divergence"] == name
    assert "pending sum" not in out


def test_placements_that_cannot_be_right_are_divergences_named_by_rank(good, variant, capsys):
    def disagree(w):                   # rank 1 declares the pending sum, ranks 0, 2, 3 treat it as replicated
        t = tp_pending(w, parts=(0.5, 0.5))
        t.shards[0].placement = t.shards[2].placement = t.shards[3].placement = ("R", "R")
        return t

    cases = [("step_1/act/h.1", disagree,
              "placements disagree on tp: rank 0 holds R, rank 1 P (a pending sum consumed as replicated)"),
             ("step_1/param/ln_f.weight", tp_pending,
              "rank 0 holds a pending sum over tp, which this tensor cannot be"),
             ("step_1/act/h.1", lambda w: tp_pending(w, ranks=(0, 2)),
              "a pending sum over tp with 1 of its 2 parts (ranks 0)")]
    for name, make, note in cases:
        status, out, _, summary = run(capsys, good, variant(placed(name, make)))
        assert status == 1 and summary["first_divergence"] == name, out
        assert note in out, out


def test_a_placement_that_does_not_fit_the_mesh_is_bad_input(good, variant, capsys):
    def bad(f):
        placed("step_1/act/h.1", tp_columns_acts)(f)
        f["step_1/act/h.1/rank1"].attrs["placement"] = "R,Q"
    status, _, err, _ = run(capsys, good, variant(bad))
    assert status == 2 and "step_1/act/h.1/rank1: placement 'R,Q' is not one of R, S(d), P, -" in err


def tp_columns_acts(a):
    n = a.shape[2] // 2
    return Sharded(a.shape, [Shard(r, (slice(None), slice(None), slice(n * c[1], n * (c[1] + 1))),
                                   a[:, :, n * c[1]:n * (c[1] + 1)], coords=c) for r, c in COORDS.items()])
