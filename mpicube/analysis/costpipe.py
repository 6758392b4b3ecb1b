"""What a pipeline costs, per rank per step: the point-to-point traffic
between stages, the bubble, and the peak of the activations a stage holds.

Over ``costmodel``'s ``Problem`` with ``pp`` > 1 (``pp_schedule``,
``virtual_stages``, and ``stage``, the stage the rank runs). The counts come
from the schedule itself (``mpicube.parallel.schedules``): the same action
lists the executor runs, so the model counts what the code sends.

* Traffic (axis "pp", elements and messages *sent* by the rank, as every
  other axis counts them): every model-chunk boundary moves one activation
  shard of the layout's canonical activation per micro-batch forward, and
  its gradient back, each in the working (storage) format: 2-byte words
  under 16-bit. A stage boundary needs no re-layout because every stage
  runs the same tensor-parallel layout: tp rank t of stage p sends to tp
  rank t of stage p+1 (at the same cp rank: a shard of T/cp positions,
  of T/tp under --sequence-parallel). Interleaved runs V chunks per stage, so V times the
  boundaries (all but the model's two ends).
* Bubble: idle share of the step with equal work per layer and free
  communication, (P-1)/(N+P-1) for GPipe and 1F1B, (P-1)/(V N + P-1) under
  interleaved (bubble over ideal time (P-1)/(V N): 1F1B's divided by V);
  ``measured_bubble`` simulates the schedule and tests hold the two equal.
  The bubble of a run, at its own work per stage and phase and its own
  transfers, is ``costbubble.modelled_bubble`` (``info``'s last line).
* Peak saved activations of a stage (``costmemory.pipeline_peak_activations``
  over ``peak_over_schedule`` here): walk its action list; after every
  forward the live (micro-batch, chunk) pairs each hold one micro-batch's
  saved activations of that chunk's layers (the lookup's on chunk 0, the
  head's on the last); during a backward under --recompute blocks one
  rerun block on top; the wte panel and its gradient once per stage.
"""

from __future__ import annotations

import dataclasses
from functools import lru_cache

from ..parallel.schedules import bubble_fraction, build_schedule, in_flight, simulate
from .costbase import Problem, Traffic


def stage_problem(p: Problem, stage: int) -> Problem:
    """The same run as seen from a rank of ``stage``."""
    return dataclasses.replace(p, stage=stage)


def schedule_of(p: Problem) -> list:
    """Every stage's action list for this run (built once per shape: info
    weighs hundreds of runs, each stage asking for the same lists)."""
    return _schedule(p.pp_schedule, p.pp, p.grad_accum, p.virtual_stages)


@lru_cache(maxsize=256)
def _schedule(name: str, stages: int, micro_batches: int, virtual: int) -> tuple:
    return tuple(tuple(acts) for acts in build_schedule(name, stages, micro_batches, virtual))


@lru_cache(maxsize=1024)
def _in_flight(name: str, stages: int, micro_batches: int, virtual: int, stage: int) -> tuple:
    return tuple(in_flight(list(_schedule(name, stages, micro_batches, virtual)[stage])))


def live_pairs(p: Problem, stage: int) -> tuple:
    """``schedules.in_flight`` of ``stage``'s list: the live (micro, chunk) pairs after each action."""
    return _in_flight(p.pp_schedule, p.pp, p.grad_accum, p.virtual_stages, stage)


def boundary_elems(p: Problem) -> int:
    """Elements of one activation shard at a stage boundary, per rank and
    micro-batch: the canonical block output (B, T, h) as this layout keeps
    it, replicated in 1-D (each tp rank sends the whole), (B/(dq), T, h/q)
    in 2-D/2.5-D, (B/q^2, T, h/q) in 3-D; T is this rank's positions, so
    --cp sends T/cp of each sequence and 1-D --sequence-parallel T/tp (both:
    T/(cp tp)), the rows the step driver cut for the rank."""
    h, T, B = p.cfg.n_embd, p.local_seq, p.local_batch
    if p.layout in ("serial", "1d"):
        return B * (T // p.tp if p.sequence_parallel else T) * h
    if p.layout in ("2d", "2.5d"):
        q = round((p.tp // p.depth) ** 0.5)
        return B // (p.depth * q) * T * (h // q)
    q = round(p.tp ** (1 / 3))
    return B // (q * q) * T * (h // q)


def pipeline_traffic(p: Problem) -> Traffic:
    """Point-to-point elements, bytes and messages this rank (``p.stage``)
    sends per step, axis "pp": one message per send action of its schedule,
    each ``boundary_elems`` in the storage format. Empty without a pipeline."""
    t = Traffic()
    if p.pp == 1:
        return t
    sends = sum(a.op.startswith("send") for a in schedule_of(p)[p.stage])
    n = boundary_elems(p)
    t._add("pp", p.pp, n, 1, sends, p.widths.act)
    return t


def pipeline_received(p: Problem) -> dict:
    """{"elems", "msgs"} this rank receives per step (the counterpart of
    ``pipeline_traffic``; summed over stages the two are equal)."""
    if p.pp == 1:
        return {"elems": 0, "msgs": 0}
    recvs = sum(a.op.startswith("recv") for a in schedule_of(p)[p.stage])
    return {"elems": recvs * boundary_elems(p), "msgs": recvs}


def bubble(p: Problem) -> float:
    """The model's idle share of the step (``schedules.bubble_fraction``)."""
    return bubble_fraction(p.pp_schedule, p.pp, p.grad_accum, p.virtual_stages)


def measured_bubble(p: Problem, forward_time: float = 1.0, backward_time: float = 2.0) -> float:
    """The idle share measured by simulating the schedule with unit-time
    chunk forwards (and backwards ``backward_time``), free communication."""
    return simulate([list(acts) for acts in schedule_of(p)], forward_time, backward_time, p.pp_schedule)["bubble"]


def peak_over_schedule(p: Problem, stage: int, per_micro: dict, step: dict, rerun: dict, weigh,
                       weight_phase: dict = None) -> tuple:
    """(peak of ``weigh(terms)``, the terms there) over ``stage``'s schedule:
    after every forward, ``step`` plus ``per_micro[micro, chunk]`` for each
    live (micro-batch, chunk); at every backward, the pairs live before it
    plus ``rerun[micro, chunk]`` of the pair taken back under --recompute
    blocks (its rerun block's caches sit on top of what the micro-batch
    still holds). Under a zero-bubble schedule a ``backward_input`` lets
    its pair's tape go and files ``weight_phase[micro, chunk]``
    (``costwgrad``), which its ``backward_weight`` lets go: the peak is
    also taken after every B. Keyed by micro-batch too, as a mixture's
    measured routing differs between them. The terms themselves are
    ``costmemory``'s (``pipeline_peak_activations``)."""
    best, best_terms = -1, None
    live = dict(step)                                   # running sum over the live pairs, plus step

    def consider(terms):
        nonlocal best, best_terms
        value = weigh(terms)
        if value > best:
            best, best_terms = value, dict(terms)

    for a in schedule_of(p)[stage]:
        key = a.micro, a.chunk
        if a.op == "forward":
            live = {kind: live[kind] + per_micro[key][kind] for kind in live}
            consider(live)
        elif a.op in ("backward", "backward_input"):
            again = rerun[key] if p.recompute == "blocks" else {}
            consider({kind: live[kind] + again.get(kind, 0) for kind in live})
            live = {kind: live[kind] - per_micro[key][kind] for kind in live}
            if a.op == "backward_input":
                live = {kind: live[kind] + weight_phase[key][kind] for kind in live}
                consider(live)
        elif a.op == "backward_weight":
            live = {kind: live[kind] - weight_phase[key][kind] for kind in live}
    return best, best_terms


def peak_in_flight(p: Problem, stage: int = None) -> int:
    """Micro-batch chunks whose activations ``stage`` holds at once at most."""
    stage = p.stage if stage is None else stage
    return max(len(x) for x in live_pairs(p, stage))
