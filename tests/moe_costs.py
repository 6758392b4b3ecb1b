"""A mixture of experts' checks for tests/parallel_check.py: each rank's
row of ``info --experts`` against its store, the routing a step recorded
(as the cost model reads it), and what one micro-batch's forward kept."""

import numpy as np
from mpi4py import MPI

from mpicube.analysis.costexperts import Rows
from mpicube.analysis.costmemory import kept_and_rerun_terms
from mpicube.analysis.costplace import placement_rows
from mpicube.parallel.experts import expert_of


def check_placement(run, store) -> None:
    """``info --experts``' row for this rank (analysis/costplace.placement_rows,
    drawn on paper from the layout's own constructor and shard) names
    exactly the experts, and the c_fc and c_proj index blocks of each,
    that this rank's store holds."""
    rank = MPI.COMM_WORLD.rank
    row = placement_rows(run)[rank]
    held = sorted({expert_of(s.name) for s in store.specs if s.expert})
    assert held == row["experts"], f"rank {rank}: holds experts {held}, the table says {row['experts']}"
    for e in held:
        for name in ("c_fc", "c_proj"):
            index = store.by_name[f"h.0.moe.experts.{e}.{name}.weight"].index
            assert all(np.array_equal(a, b) for a, b in zip(index, row[name])), f"rank {rank}: {name} of expert {e}"


def check_kept(problem, dropout: bool, kept, label: str) -> None:
    """What forward kept (elements, bytes) == the model's saved activations."""
    terms = kept_and_rerun_terms(problem, dropout)[0]
    w = problem.widths
    want = (sum(terms.values()), terms["act"] * w.act + terms["stat"] * w.stat + terms["grad"] * w.grad)
    assert tuple(kept) == want, f"rank {MPI.COMM_WORLD.rank}: {label} keeps {kept}, model predicts {want}"


def measured_rows(ledger, calls: list) -> tuple:
    """A micro-batch's routing as the cost model reads it (costexperts.Rows
    per MoE layer): the rows this rank sent to and received from each ep
    rank (the ledger's routes), and the rows each local expert ran on
    (``calls``: what the layout's ``expert_rows`` answered, layer by layer,
    in this forward)."""
    out = []
    for k, (held, sizes, every) in zip(sorted(ledger.routes), calls):
        sent, received = ledger.routes[k]
        assert int((sizes - held).sum()) == ledger.padded[k]
        out.append(Rows(tuple(int(v) for v in sent), tuple(int(v) for v in received),
                        tuple(int(v) for v in sizes), bool(every)))
    return tuple(out)


def record_expert_rows(layout) -> list:
    """Wrap ``layout.expert_rows`` on this instance (the seam where a
    MoE layer asks how many rows each expert runs on, model/moe.py) to
    record (held, sizes, every) of every call, in call order; a trace
    observes the router the same way (analysis/trace_collect.py)."""
    calls, ask = [], layout.expert_rows

    def expert_rows(held):
        sizes, every = ask(held)
        calls.append((np.asarray(layout.backend.to_host(held), dtype=np.int64),
                      np.asarray(layout.backend.to_host(sizes), dtype=np.int64), every))
        return sizes, every

    layout.expert_rows = expert_rows
    return calls
