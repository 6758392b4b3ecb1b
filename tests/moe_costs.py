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


def measured_rows(ledger, runs: list) -> tuple:
    """A micro-batch's routing as the cost model reads it (costexperts.Rows
    per MoE layer): the rows this rank sent to and received from each ep
    rank (the ledger's routes), and the rows of every batch its local
    experts' linears ran on (``runs``: per layer, what ``record_runs``
    saw in this forward)."""
    out = []
    for k, sizes in zip(sorted(ledger.routes), runs):
        sent, received = ledger.routes[k]
        out.append(Rows(tuple(int(v) for v in sent), tuple(int(v) for v in received), tuple(sizes)))
    return tuple(out)


def mixtures(blocks) -> list:
    """The MoE layers (``model.moe.MoE``) of ``blocks`` in order, the dense
    blocks' MLPs (DeepSeek-V3's first ``first_k_dense``) left out."""
    mlps = [getattr(b, "block", b).mlp for b in blocks]
    return [m for m in mlps if hasattr(m, "local_experts")]


def record_runs(model) -> list:
    """Wrap each MoE layer's ``LocalExperts._run`` on its instance (the
    step where an expert's linears run on one batch of rows,
    model/moe_experts.py) to record the rows of every run, per layer:
    returns a list whose entry i is the list of layer i's runs since it
    was last cleared (``take_runs``), the dense blocks (DeepSeek-V3's
    first ``first_k_dense``) left out, so entry i is the i-th MoE layer's
    as the ledger's routes list them (an MTP depth's block after the
    main ones, as its layer number follows theirs). A trace observes the router the same
    way (analysis/trace_collect.py)."""
    moe = mixtures(model.model.blocks)
    log = [[] for _ in moe]
    for i, layer in enumerate(moe):
        experts = layer.local_experts
        run = experts._run

        def recorded(rows, index, sizes=None, every=False, _run=run, _i=i):
            y, runs = _run(rows, index, sizes, every)
            log[_i].append(tuple(r[1] for r in runs if r is not None))
            return y, runs

        experts._run = recorded
    return log


def take_runs(log: list) -> list:
    """Each layer's runs of the last forward (a layer runs one batch per
    expert, or two: its own rows and the others', model/moe_experts.py),
    the log then emptied."""
    out = [tuple(size for batch in runs for size in batch) for runs in log]
    for runs in log:
        runs.clear()
    return out


class StageRuns:
    """A pipeline stage's routing as the cost model reads it: per
    micro-batch, one ``Rows`` per layer of the stage, in layer order (the
    chunks' layers in turn). Wraps each MoE layer's ``LocalExperts.forward``
    on the stage's chunk models to keep the rows of every batch of the
    layer's last forward (``forward``'s saved runs: one or two batches a
    local expert, as ``record_runs`` sees them); ``after_forward(m)`` files
    the chunk that just ran (``pipe.current``) under micro-batch m, so
    the reruns of --recompute blocks in between are never filed."""

    def __init__(self, pipe):
        self.pipe, self.last, self.runs = pipe, {}, {}
        for v in range(pipe.V):
            for moe in mixtures(pipe.chunk_model(v).blocks):
                experts = moe.local_experts
                forward = experts.forward

                def recorded(route, rows, _forward=forward, _layer=moe.layer):
                    y, saved, pad = _forward(route, rows)
                    self.last[_layer] = tuple(r[1] for runs in saved for r in runs if r is not None)
                    return y, saved, pad

                experts.forward = recorded

    def after_forward(self, m: int) -> None:
        for moe in mixtures(self.pipe.current[0].blocks):
            self.runs.setdefault(m, {})[moe.layer] = self.last[moe.layer]

    def take(self, ledgers: list) -> tuple:
        """The step's routing from its ledgers (one per micro-batch, in
        order: the stage's routes); the runs then forgotten."""
        out = tuple(measured_rows(led, [self.runs[m][k] for k in sorted(led.routes)])
                    for m, led in enumerate(ledgers))
        assert all(sorted(led.routes) == sorted(self.runs[m]) for m, led in enumerate(ledgers))
        self.runs = {}
        return out
