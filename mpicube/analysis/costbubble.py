"""The cost model's bubble of one run: the schedule simulated with the
run's own work per stage and phase, the executor's time between actions
and its own transfers, where the formula (``schedules.bubble_fraction``)
assumes equal work per layer, a fixed B/W split, free actions and free
messages. Priced as an alpha-beta model prices a message: a fixed cost
per action, and each phase's work at the rates of its two kinds.

* Work: ``costflops.chunk_phase_flops`` of every chunk a stage holds: F,
  B (input gradient: the linears' dX, attention's backward, the head's
  products, a --recompute blocks rerun) and W (the linears' dW), with the
  embeddings' lookup on chunk 0 and ln_f, the head and the loss on the
  last, at ``flop_rate``; plus ``costpasses.chunk_phase_bytes``, the
  elementwise passes between the GEMMs (norms, activation, softmax,
  dropout, residuals, biases, the cross-entropy over the vocabulary:
  nearly all of it in F and B, in W the bias sums and the adding of
  each dW into the step's gradient), at
  ``memory_rate``.
* Actions: before every action the executor runs (compute, send and
  receive) its own time ``action_time`` passes, idle as a profile counts
  it (the interpreter between the phases, and a profiled run's
  recording). The V schedules run the most actions for their work.
* Transfers: each send of the schedule moves ``costpipe.boundary_elems``
  in the working format; its message arrives ``latency + bytes /
  bandwidth`` after the send starts (the executor's sends are nonblocking,
  so the sender goes on; the receiver waits if it gets there first).

The default rates (``Rates()``, what ``info`` prints with) are stated,
not measured: 1e11 FLOP/s per rank (one core's float32 GEMMs, about what
the development VM's single-thread BLAS reaches), 1e10 B/s of elementwise
passes (about what one of its cores reaches on a LayerNorm and a GELU of
the sizes below), 2e-4 s an action (the executor's Python and a profile's
recording between two actions, of the order its profiles show), 5e9 B/s and 5 us a
message (an MPI message between two cores of one node, through shared
memory). ``tools/bubble_table.py`` measures the four on the machine
before its runs and prices them with those.

Measured rates may give each phase's GEMMs their own (``dgrad_rate``,
``wgrad_rate``): the same sizes run at different rates as X W, dY W^T and
X^T dY. What the model still leaves out, so that a measured bubble can sit
above it: a loaded machine's uneven time slices (each stretch of one rank
is idle time on the others), attention's small batched products at
the linears' rates, and the passes the counting leaves out
(``costpasses``).
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from ..parallel.schedules import model_chunk, simulate
from .costbase import Problem
from .costflops import chunk_phase_flops
from .costpasses import chunk_phase_bytes
from .costpipe import boundary_elems, schedule_of, stage_problem


@dataclass(frozen=True)
class Rates:
    """The machine's rates the model prices a run at (inputs, like a
    message's latency and bandwidth; the defaults are stated, module
    docstring)."""

    flop_rate: float = 1e11        # FLOP/s per rank, F's GEMMs (X W)
    memory_rate: float = 1e10      # B/s per rank, the elementwise passes
    action_time: float = 2e-4      # s the executor spends on each action
    bandwidth: float = 5e9         # B/s between two stages
    latency: float = 5e-6          # s a message
    dgrad_rate: float = None       # FLOP/s of B's GEMMs (dY W^T); None: flop_rate
    wgrad_rate: float = None       # FLOP/s of W's GEMMs (X^T dY); None: flop_rate

    def phase_rate(self, op: str) -> float:
        """The GEMM rate of a phase's FLOPs: a BLAS runs X W, dY W^T and
        X^T dY of the same sizes at different rates (the transposed
        operands' packing), so a measured machine gives each its own."""
        rate = {"backward_input": self.dgrad_rate, "backward_weight": self.wgrad_rate}.get(op)
        return self.flop_rate if rate is None else rate

    def describe(self) -> str:
        """The rates as ``info``'s modelled-bubble line states them."""
        gemms = f"{self.flop_rate / 1e9:g} GFLOP/s"
        if (self.dgrad_rate, self.wgrad_rate) != (None, None):
            gemms = "/".join(f"{self.phase_rate(op) / 1e9:g}" for op in ("forward", "backward_input",
                                                                         "backward_weight")) + " GFLOP/s (F/B/W)"
        return (f"{gemms} and {self.memory_rate / 1e9:g} GB/s a rank, "
                f"{self.action_time * 1e6:g} us an action; messages at {self.bandwidth / 1e9:g} GB/s + "
                f"{self.latency * 1e6:g} us")


DEFAULT_RATES = Rates()


def phase_seconds(p: Problem, rates: Rates = DEFAULT_RATES, dropout: float = 0.0) -> dict:
    """{(model chunk, op): seconds} of one micro-batch's F, B, W and whole
    backward on every model chunk of the run: FLOPs at the phase's GEMM
    rate plus the elementwise passes' bytes at the memory rate."""
    out = {}
    for k in range(p.pp * p.virtual_stages):
        f, m = chunk_phase_flops(p, k), chunk_phase_bytes(p, k, dropout)
        for op in list(f):
            out[k, op] = float(f[op]) / rates.phase_rate(op) + float(m[op]) / rates.memory_rate
        out[k, "backward"] = out[k, "backward_input"] + out[k, "backward_weight"]
    return out


def transfer_seconds(p: Problem, rates: Rates = DEFAULT_RATES) -> float:
    """Seconds one stage-boundary message takes to arrive."""
    return rates.latency + float(boundary_elems(p) * p.widths.act) / rates.bandwidth


def modelled_run(p: Problem, rates: Rates = DEFAULT_RATES, dropout: float = 0.0) -> dict:
    """``schedules.simulate`` of the run's action lists at its own phase
    times, action time and transfers (module docstring): "bubble", "time",
    "busy"..."""
    seconds = phase_seconds(p, rates, dropout)
    delay = transfer_seconds(p, rates)
    P = p.pp

    def times(stage, a):
        return seconds[model_chunk(p.pp_schedule, stage, a.chunk, P), a.op]

    return simulate([list(acts) for acts in schedule_of(p)], name=p.pp_schedule, times=times,
                    transfer=lambda stage, a: delay, overhead=lambda stage, a: rates.action_time)


def modelled_bubble(p: Problem, rates: Rates = DEFAULT_RATES, dropout: float = 0.0) -> float:
    """The idle share of the run's step by the cost model (0 without a pipeline)."""
    return modelled_run(p, rates, dropout)["bubble"] if p.pp > 1 else 0.0


def stage_work(p: Problem) -> list:
    """Per stage, FLOPs of one step's F, B and W (the imbalance ``info`` can show)."""
    out = []
    for s in range(p.pp):
        total = {"forward": Fraction(0), "backward_input": Fraction(0), "backward_weight": Fraction(0)}
        for k in stage_problem(p, s).stage_chunks:
            for op, f in chunk_phase_flops(p, k).items():
                total[op] += f * p.grad_accum
        out.append(total)
    return out
