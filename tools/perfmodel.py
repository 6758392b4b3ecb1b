"""Shared pieces of the analysis tools (tools/scaling.py, tools/project.py).

Nothing here measures anything: it builds ``mpicube.analysis.costmodel.Problem``s for
the sizes a sweep visits, counts FLOPs, maps every communication axis of a
layout onto world ranks (the placement of ``mpicube.parallel.grid`` and
``mpicube.parallel.layouts``), and prices the cost model's per-axis traffic with an
alpha-beta model of a GPU cluster.

Run the tools from the repository root with ``PYTHONPATH=.`` (or with
mpicube installed); this module is imported from the tools' own folder.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import asdict, dataclass, replace

from mpicube.core.config import ModelConfig
from mpicube.analysis.costmodel import Problem, step_traffic
from mpicube.analysis.costmemory import step_memory, step_memory_bytes
from mpicube.core.errors import ConfigError
from mpicube.parallel.grid import integer_root, plan
from mpicube.parallel.gridspec import GridSpec

LAYOUTS = ("1d", "2d", "2.5d", "3d")


# --------------------------------------------------------------------------- sizes


def grid_sizes(layout: str, max_p: int) -> list:
    """[(p, depth)] a layout can run on, 2 <= p <= max_p: 1d p = 2^k,
    2d p = q^2, 2.5d p = d q^2 with d = q (so p = q^3), 3d p = q^3.
    (p = 1 is the serial layout: see ``serial_point``.)"""
    out = []
    if layout == "1d":
        p = 2
        while p <= max_p:
            out.append((p, 1))
            p *= 2
    elif layout == "2d":
        out = [(q * q, 1) for q in range(2, math.isqrt(max_p) + 1)]
    elif layout in ("2.5d", "3d"):
        q = 2
        while q ** 3 <= max_p:
            out.append((q ** 3, q if layout == "2.5d" else 1))
            q += 1
    else:
        raise ValueError(f"unknown layout {layout!r}")
    return out


def side(layout: str, tp: int, depth: int = 1) -> int:
    """q of the layout's grid (p itself for 1d and serial)."""
    if layout in ("1d", "serial"):
        return tp
    if layout in ("2d", "2.5d"):
        return integer_root(tp // depth, 2)
    return integer_root(tp, 3)


def make_problem(layout: str, cfg: ModelConfig, batch: int, tp: int, depth: int = 1, dp: int = 1):
    """A validated ``Problem`` (world = dp * tp), or the ConfigError message
    that mpicube itself would print for these sizes."""
    try:
        _, resolved, _ = plan(GridSpec(layout, dp=dp, depth=depth), cfg, batch, tp * dp)
    except ConfigError as err:
        return str(err)
    return Problem(cfg, resolved, tp, dp, depth if resolved == "2.5d" else 1, batch, cfg.n_ctx)


# --------------------------------------------------------------------------- FLOPs


def flops_per_rank(p: Problem) -> float:
    """Matrix-multiply FLOPs of one training step (forward + backward) on
    one rank, counted from the model:

        6 N P_ne  +  6 N V h  +  12 L N T h,   divided by tp

    N = tokens of the rank's data-parallel replica (B/dp * T), P_ne the
    non-embedding parameters (weights, biases, LayerNorms), V h the tied LM
    head (forward 2NVh, backward 4NVh), 12 L N T h the attention score and
    value products (forward 4NTh per layer, no causal saving, x3 for
    backward). No activation recomputation. Every layout divides this work
    evenly over its tp ranks (1-D's replicated LayerNorms and residuals are
    O(N h) and left out)."""
    cfg = p.cfg
    n_tok = p.local_batch * p.seq_len
    h, L, V = cfg.n_embd, cfg.n_layer, cfg.vocab_size
    non_embedding = cfg.n_params() - (cfg.vocab_size + cfg.n_ctx) * h
    total = 6 * n_tok * non_embedding + 6 * n_tok * V * h + 12 * L * n_tok * p.seq_len * h
    return total / p.tp


# --------------------------------------------------------------------------- placement


def _coords(layout: str, tp: int, depth: int, t: int) -> dict:
    """The grid coordinates of tensor-parallel rank t, as the layouts'
    constructors compute them."""
    if layout == "3d":
        q = integer_root(tp, 3)
        i, rest = divmod(t, q * q)
        j, k = divmod(rest, q)
        return {"i": i, "j": j, "k": k}
    if layout in ("2d", "2.5d"):
        q = integer_root(tp // depth, 2)
        l, rest = divmod(t, q * q)
        r, c = divmod(rest, q)
        return {"l": l, "r": r, "c": c}
    return {}


# axis -> coordinates that stay fixed inside one communicator of that axis
# (the ``color`` of the layouts' Comm.Split calls)
_FIXED = {
    "3d": {"i": ("j", "k"), "j": ("i", "k"), "k": ("i", "j"), "ij": ("k",), "ik": ("j",)},
    "2d": {"row": ("l", "r"), "col": ("l", "c"), "depth": ("r", "c"), "col_depth": ("c",)},
}
_FIXED["2.5d"] = _FIXED["2d"]


def axis_groups(layout: str, tp: int, depth: int = 1, dp: int = 1) -> dict:
    """{axis: [sorted world ranks of each communicator]} for every axis the
    cost model names. World rank = replica * tp + tp_rank (grid.py)."""
    groups = {}
    fixed = _FIXED.get(layout, {})
    for axis, keep in fixed.items():
        buckets = defaultdict(list)
        for d in range(dp):
            for t in range(tp):
                c = _coords(layout, tp, depth, t)
                buckets[(d,) + tuple(c[n] for n in keep)].append(d * tp + t)
        groups[axis] = sorted(buckets.values())
    groups["tp"] = [list(range(d * tp, (d + 1) * tp)) for d in range(dp)]
    groups["dp"] = [list(range(t, dp * tp, tp)) for t in range(tp)]
    groups["world"] = [list(range(dp * tp))]
    return groups


@dataclass(frozen=True)
class Span:
    """How one axis's communicators sit on the nodes."""

    size: int            # ranks per communicator
    nodes: int           # nodes one communicator touches
    per_node: int        # its members on one node (ring edges that stay inside)
    flows: int           # communicators of this axis leaving one node at once

    @property
    def inter(self) -> bool:
        return self.nodes > 1


def axis_span(groups: list, gpus_per_node: int) -> Span:
    """Placement of one axis: consecutive world ranks share a node. A ring
    over a communicator whose members are contiguous per node leaves each
    node on one edge, so ``flows`` (the communicators of this axis with
    members on a node, when they span nodes) share that node's NIC."""
    g = groups[0]
    nodes = {r // gpus_per_node for r in g}
    per_node = len(g) // len(nodes)
    if len(nodes) == 1:
        return Span(len(g), 1, per_node, 0)
    on_node0 = sum(1 for grp in groups if any(r // gpus_per_node == 0 for r in grp))
    return Span(len(g), len(nodes), per_node, on_node0)


# --------------------------------------------------------------------------- the cluster


@dataclass(frozen=True)
class Cluster:
    """Alpha-beta parameters of a GPU cluster; defaults describe 64 V100
    SXM2 GPUs, 4 per node, NVLink 2.0 inside a node and one EDR InfiniBand
    port per node (docs/performance.md gives the sources)."""

    name: str = "V100 cluster"
    gpus_per_node: int = 4
    flops: float = 39e12          # sustained FLOP/s per GPU (Megatron-LM: 30% of 125 TFLOP/s fp16 peak)
    intra_bw: float = 50e9        # B/s per direction on one ring edge inside a node (2 NVLink 2.0 bricks)
    nic_bw: float = 12.5e9        # B/s per direction per node: one EDR port, 100 Gb/s
    alpha_intra: float = 3e-6     # s per message (ring step) inside a node
    alpha_inter: float = 6e-6     # s per message between nodes
    bytes_per_elem: int = 2       # fp16
    nic_sharing: str = "ring"     # "ring": only rings leaving the node share it; "all": every GPU gets nic_bw/gpus_per_node

    def with_(self, **kw) -> "Cluster":
        return replace(self, **kw)

    def link(self, span: Span):
        """(alpha, bandwidth in B/s, label) an axis with this span runs at."""
        if not span.inter:
            return self.alpha_intra, self.intra_bw, "intra"
        flows = span.flows if self.nic_sharing == "ring" else self.gpus_per_node
        bw = min(self.intra_bw, self.nic_bw / max(flows, 1))
        return self.alpha_inter, bw, "inter"

    def describe(self) -> dict:
        return asdict(self)


# bytes_per_elem -> the storage format whose real widths the cost model counts
# (2: float16 mixed precision, whose reductions, gradients and scalars are wider)
FORMAT_OF_WIDTH = {2: "float16", 4: "float32", 8: "float64"}


def in_format(problem: Problem, cluster: Cluster) -> Problem:
    """``problem`` in the storage format of ``cluster.bytes_per_elem``."""
    return replace(problem, dtype=FORMAT_OF_WIDTH[cluster.bytes_per_elem])


def comm_time(problem: Problem, cluster: Cluster) -> dict:
    """{axis: dict(elems, bytes, msgs, span, link, bw, seconds)} for one step:
    seconds = msgs * alpha + bytes / bw, the bytes at the real width of
    each collective's data (mpicube.analysis.costmodel), collectives not overlapped
    with each other or with compute."""
    traffic = step_traffic(in_format(problem, cluster))
    groups = axis_groups(problem.layout, problem.tp, problem.depth, problem.dp)
    out = {}
    for axis in sorted(traffic.elems):
        elems, msgs = traffic.elems[axis], traffic.msgs[axis]
        span = axis_span(groups[axis], cluster.gpus_per_node)
        alpha, bw, label = cluster.link(span)
        seconds = msgs * alpha + float(traffic.bytes[axis]) / bw
        out[axis] = dict(elems=float(elems), bytes=float(traffic.bytes[axis]), msgs=msgs, ranks=span.size, nodes=span.nodes,
                         flows=span.flows, link=label, bw=bw, seconds=seconds)
    return out


def step_time(problem: Problem, cluster: Cluster) -> dict:
    """Projected seconds of one step: compute + every axis's communication."""
    comm = comm_time(problem, cluster)
    compute = flops_per_rank(problem) / cluster.flops
    comm_s = sum(a["seconds"] for a in comm.values())
    intra = sum(a["seconds"] for a in comm.values() if a["link"] == "intra")
    return dict(compute=compute, comm=comm_s, comm_intra=intra, comm_inter=comm_s - intra,
                total=compute + comm_s, axes=comm)


# --------------------------------------------------------------------------- small helpers


def memory(problem: Problem, cluster: Cluster = None) -> dict:
    """Elements per rank by category, and ``total_bytes`` at the real widths
    of ``cluster.bytes_per_elem``'s format (default: the problem's own)."""
    m = step_memory(problem)
    b = step_memory_bytes(in_format(problem, cluster) if cluster is not None else problem)
    return dict(params=m.params, grads=m.grads, optimizer=m.optimizer, activations=m.activations,
                total=m.total(), total_bytes=b.total())


def traffic_totals(problem: Problem) -> tuple:
    """(elements, messages, {axis: elements}) per rank per step."""
    t = step_traffic(problem)
    return t.total_elems(), t.total_msgs(), dict(t.elems)
