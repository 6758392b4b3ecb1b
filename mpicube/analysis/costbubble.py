"""The cost model's bubble of one run: the schedule simulated with the
run's own work per stage and phase and its own transfers, where the
formula (``schedules.bubble_fraction``) assumes equal work per layer, a
fixed B/W split and free messages.

* Work: ``costflops.chunk_phase_flops`` of every chunk a stage holds: F,
  B (input gradient: the linears' dX, attention's backward, the head's
  products, a --recompute blocks rerun) and W (the linears' dW), with the
  embeddings' lookup on chunk 0 and ln_f, the head and the loss on the
  last (the head's GEMMs are the FLOPs; a lookup and a softmax have
  none). A whole backward is B + W. Seconds are FLOPs over ``flop_rate``.
* Transfers: each send of the schedule moves ``costpipe.boundary_elems``
  in the working format; its message arrives ``latency + bytes /
  bandwidth`` after the send starts (the executor's sends are nonblocking,
  so the sender goes on; the receiver waits if it gets there first).

Only the ratio of the two rates matters to the bubble. The defaults are
stated, not measured: ``DEFAULT_FLOP_RATE`` 1e11 FLOP/s per rank (one
core's float32 GEMMs, about what the development VM's single-thread BLAS
reaches) and ``DEFAULT_BANDWIDTH`` 5e9 B/s with ``DEFAULT_LATENCY`` 5 us
(an MPI message between two cores of one node, through shared memory).

What it still leaves out, so that a measured bubble sits above it: the
memory-bound work FLOPs do not see (norms, activations, softmax, dropout,
the cross-entropy; it lands mostly in F and B, so the real W is a
smaller share of the backward than its FLOPs say, which leaves the
zero-bubble schedules fewer Ws to fill with), the interpreter's time
between the actions, and a loaded machine's uneven time slices (each
stretch of one rank is idle time on the others). ``tools/bubble_table.py``
measures the runs, replays their profiled phase times through the same
simulator, and prints the gap of each.
"""

from __future__ import annotations

from fractions import Fraction

from ..parallel.schedules import model_chunk, simulate
from .costbase import Problem
from .costflops import chunk_phase_flops
from .costpipe import boundary_elems, schedule_of, stage_problem

DEFAULT_FLOP_RATE = 1e11      # FLOP/s per rank
DEFAULT_BANDWIDTH = 5e9       # B/s between two stages
DEFAULT_LATENCY = 5e-6        # s a message


def phase_seconds(p: Problem, flop_rate: float = DEFAULT_FLOP_RATE) -> dict:
    """{(model chunk, op): seconds} of one micro-batch's F, B, W and whole
    backward on every model chunk of the run."""
    out = {}
    for k in range(p.pp * p.virtual_stages):
        f = chunk_phase_flops(p, k)
        f["backward"] = f["backward_input"] + f["backward_weight"]
        for op, flops in f.items():
            out[k, op] = float(flops) / flop_rate
    return out


def transfer_seconds(p: Problem, bandwidth: float = DEFAULT_BANDWIDTH, latency: float = DEFAULT_LATENCY) -> float:
    """Seconds one stage-boundary message takes to arrive."""
    return latency + float(boundary_elems(p) * p.widths.act) / bandwidth


def modelled_run(p: Problem, flop_rate: float = DEFAULT_FLOP_RATE, bandwidth: float = DEFAULT_BANDWIDTH,
                 latency: float = DEFAULT_LATENCY) -> dict:
    """``schedules.simulate`` of the run's action lists at its own phase
    times and transfers (module docstring): "bubble", "time", "busy"..."""
    seconds = phase_seconds(p, flop_rate)
    delay = transfer_seconds(p, bandwidth, latency)
    P = p.pp

    def times(stage, a):
        return seconds[model_chunk(p.pp_schedule, stage, a.chunk, P), a.op]

    return simulate([list(acts) for acts in schedule_of(p)], name=p.pp_schedule, times=times,
                    transfer=lambda stage, a: delay)


def modelled_bubble(p: Problem, flop_rate: float = DEFAULT_FLOP_RATE, bandwidth: float = DEFAULT_BANDWIDTH,
                    latency: float = DEFAULT_LATENCY) -> float:
    """The idle share of the run's step by the cost model (0 without a pipeline)."""
    return modelled_run(p, flop_rate, bandwidth, latency)["bubble"] if p.pp > 1 else 0.0


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
