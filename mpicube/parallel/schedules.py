"""Pipeline schedules as data: every stage's ordered list of actions.

A schedule is a pure function of (name, P stages, N micro-batches, V
virtual chunks per stage) that returns, for each stage, the forwards,
backwards, sends and receives it performs in one optimizer step. The
zero-bubble schedules (``schedules_zb``: zb-h1, zbv, dualpipev) split a
backward into ``backward_input`` (B, dX) and ``backward_weight`` (W, the
linears' dW filed by ``parallel.wgrad``), and may mix whole backwards in. Why data
and not code: the same lists are run by the executor, checked for deadlock
freedom and dependency order without MPI (tests/test_schedules.py), measured
for their bubble and in-flight activations by the cost model, and drawn
(tools/pipeline_pictures.py); a schedule that is drawn is the schedule that
runs.

Model chunk k (0..P*V-1) holds a contiguous run of layers (``layer_split``);
chunk 0 also holds the embeddings, chunk P*V-1 the final LayerNorm and the
LM head. Stage p holds chunks p, P + p, ..., (V-1)*P + p: its local chunk v
is model chunk ``v * P + p``, except in a V (zbv, dualpipev: chunks p and
2P-1-p, ``model_chunk``). Activations of micro-batch m flow from chunk k
to k+1 (from the stage holding k to the one holding k+1; a V's turn, P-1
to P, stays on the last stage with no message), their gradients back.

A ``recv_*`` sits right before the compute that consumes it and a
``send_*`` right after the compute that produced it. The executor posts
receives early and nonblocking and sends nonblocking
(``mpicube.training.pipeline``), so a stage blocks only where a
receive it needs has not been sent yet: ``simulate`` models exactly that.

Also here, because the CLI, the planner and the cost model all need them
without MPI: ``layer_split`` and the validation of --pp, --pp-schedule,
--virtual-stages and --grad-accum against the model.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.errors import ConfigError
from .schedules_zb import VEE_SCHEDULES, ZB_SCHEDULES, chunk_place, model_chunk, zb_bubble_fraction, zb_order

SCHEDULES = ("gpipe", "1f1b", "interleaved")               # one backward action per chunk and micro-batch
ALL_SCHEDULES = SCHEDULES + ZB_SCHEDULES                    # and those that split it (schedules_zb.py)
DEFAULT_SCHEDULE = "1f1b"
COMPUTE = ("forward", "backward", "backward_input", "backward_weight")
OPS = COMPUTE + ("send_act", "recv_act", "send_grad", "recv_grad")


@dataclass(frozen=True)
class Action:
    """One step of one stage. ``chunk`` is the stage's local chunk
    (0..V-1), model chunk ``chunk * P + stage``; ``peer`` is the stage at
    the other end of a send or receive (-1 for compute)."""
    op: str
    micro: int
    chunk: int
    peer: int = -1


# ----------------------------------------------------------------- validation

def _divisors(n: int) -> list:
    return [d for d in range(1, n + 1) if n % d == 0]


def _nearest(values, target: int, count: int = 2) -> str:
    """The ``count`` values closest to ``target``, ascending, joined by "or"."""
    near = sorted(sorted(set(values), key=lambda v: (abs(v - target), v))[:count])
    return " or ".join(str(v) for v in near)


def check_pipeline(n_layer: int, pp: int, schedule: str = DEFAULT_SCHEDULE, virtual: int = 1,
                   grad_accum: int = 1):
    """Validate the pipeline options against the model; return a note for
    the user (a large bubble) or None. Raises ConfigError, one line naming
    the nearest valid values. Pure, so every rank refuses the same way
    before any communicator exists."""
    if schedule not in ALL_SCHEDULES:
        raise ConfigError(f"unknown --pp-schedule {schedule!r}; choose one of {', '.join(ALL_SCHEDULES)}")
    if pp < 1:
        raise ConfigError(f"--pp must be at least 1, got {pp}")
    if grad_accum < 1:
        raise ConfigError(f"--grad-accum must be at least 1, got {grad_accum}")
    if virtual < 1:
        raise ConfigError(f"--virtual-stages must be at least 1, got {virtual}")
    if pp > n_layer:
        raise ConfigError(f"--pp {pp} exceeds n_layer {n_layer} (every stage needs a layer): "
                          f"use --pp {n_layer} or less, or --n-layer {pp} or more")
    if schedule in ZB_SCHEDULES and pp < 2:
        raise ConfigError(f"--pp-schedule {schedule} needs --pp 2 or more (one stage has no bubble to fill): "
                          f"use --pp 2 or more, or --pp-schedule 1f1b")
    if schedule in VEE_SCHEDULES:
        if virtual != 2:
            raise ConfigError(f"--pp-schedule {schedule} runs two chunks a stage (a V): use --virtual-stages 2 "
                              f"(got {virtual})")
        if 2 * pp > n_layer:
            raise ConfigError(f"--pp {pp} x 2 chunks of --pp-schedule {schedule} exceeds n_layer {n_layer}: "
                              f"use --pp {max(1, n_layer // 2)} or less, or --n-layer {2 * pp} or more")
        if schedule == "dualpipev" and grad_accum < 2 * pp:
            raise ConfigError(f"--pp-schedule dualpipev needs at least 2 x --pp {pp} micro-batches: "
                              f"--grad-accum {grad_accum}: use --grad-accum {2 * pp} or more")
    elif virtual != 1 and schedule != "interleaved":
        raise ConfigError(f"--virtual-stages {virtual} applies to --pp-schedule interleaved only "
                          f"(schedule {schedule}): drop --virtual-stages, or use --pp-schedule interleaved")
    if schedule == "interleaved":
        if pp < 2:
            raise ConfigError("--pp-schedule interleaved needs --pp 2 or more (one stage has no pipeline "
                              "to interleave): use --pp 2, or --pp-schedule 1f1b")
        if n_layer % (pp * virtual):
            fits = [v for v in _divisors(n_layer) if n_layer // v >= 1 and v % pp == 0]
            vs = [f // pp for f in fits]
            layers = " or ".join(str(v) for v in (n_layer // (pp * virtual) * pp * virtual,
                                                   (n_layer // (pp * virtual) + 1) * pp * virtual) if v > 0)
            raise ConfigError(f"--pp {pp} x --virtual-stages {virtual} = {pp * virtual} chunks must divide "
                              f"n_layer {n_layer}: use --virtual-stages {_nearest(vs, virtual) if vs else 1}, "
                              f"or --n-layer {layers}")
        if grad_accum % pp:
            raise ConfigError(f"--pp-schedule interleaved runs micro-batches in groups of --pp {pp}: "
                              f"--grad-accum {grad_accum} must be a multiple of {pp}: use --grad-accum "
                              f"{' or '.join(str(v) for v in (grad_accum // pp * pp, grad_accum // pp * pp + pp) if v > 0)}")
    if pp > 1 and grad_accum < pp:
        return (f"note: --grad-accum {grad_accum} < --pp {pp}: at most {grad_accum} of {pp} stages work at once; "
                f"the bubble is {bubble_fraction(schedule, pp, grad_accum, virtual):.0%} of the step "
                f"(use --grad-accum {pp} or more for a smaller one)")
    return None


def check_pp_world(world_size: int, pp: int, dp: int = 1) -> int:
    """Tensor-parallel size of a world split as dp x pp x tp, or a
    ConfigError naming the --pp values that divide what dp leaves."""
    if pp < 1 or dp < 1 or world_size % (dp * pp):
        rest = world_size // dp if dp >= 1 and world_size % dp == 0 else world_size
        raise ConfigError(f"--pp {pp} must divide the world size {world_size} / --dp {dp}: "
                          f"use --pp {_nearest(_divisors(rest), pp)}")
    return world_size // (dp * pp)


def layer_split(n_layer: int, chunks: int) -> list:
    """The layers of each model chunk, as even as possible: every chunk gets
    n_layer // chunks, and the first n_layer % chunks chunks one more
    (earlier chunks take the remainder; the last also holds the LM head,
    the largest single matmul, so it is not the one to give more)."""
    if chunks < 1 or chunks > n_layer:
        raise ConfigError(f"cannot split {n_layer} layers into {chunks} chunks: use 1 to {n_layer} chunks")
    base, extra = divmod(n_layer, chunks)
    out, start = [], 0
    for k in range(chunks):
        size = base + (1 if k < extra else 0)
        out.append(range(start, start + size))
        start += size
    return out


def bubble_fraction(schedule: str, stages: int, micro_batches: int, virtual: int = 1) -> float:
    """Idle share of a step, with every forward and backward of equal length
    per layer and free communication: (P-1)/(N+P-1) for GPipe and 1F1B;
    interleaved shrinks the fill and drain to (P-1)/V stage-times, giving
    (P-1)/(V*N + P-1) - the bubble over the ideal time, (P-1)/(V*N), is
    1F1B's (P-1)/N divided by V. ``simulate`` measures the same number from
    the schedule itself (tests/test_schedules.py holds the two equal)."""
    if schedule in ZB_SCHEDULES:
        return zb_bubble_fraction(schedule, stages, micro_batches)
    p, n, v = stages, micro_batches, (virtual if schedule == "interleaved" else 1)
    return (p - 1) / (v * n + p - 1)


# ------------------------------------------------------------------ schedules

def _order(schedule: str, p: int, P: int, N: int, V: int) -> list:
    """Stage p's compute order: a list of ("forward"|"backward", micro, chunk)."""
    if schedule == "gpipe":
        return [("forward", m, 0) for m in range(N)] + [("backward", m, 0) for m in range(N)]
    if schedule == "1f1b" or V == 1:
        fwd = [(m, 0) for m in range(N)]
        bwd = [(m, 0) for m in range(N)]
        warm = min(P - 1 - p, N)
    else:
        # Micro-batches in groups of P: group g runs chunk 0 on micros gP..gP+P-1,
        # then chunk 1 on the same micros, ...; backwards take the chunks from the
        # top down. Megatron's warm-up: 2(P-1-p) to fill the stages below, plus
        # (V-1)P so that the first micro-batch reaches the last chunk.
        fwd = [(g * P + i % P, i // P) for g in range(N // P) for i in range(P * V)]
        bwd = [(g * P + i % P, V - 1 - i // P) for g in range(N // P) for i in range(P * V)]
        warm = min(2 * (P - 1 - p) + (V - 1) * P, N * V)
    total = len(fwd)
    order = [("forward",) + fwd[i] for i in range(warm)]
    for i in range(total - warm):
        order.append(("forward",) + fwd[warm + i])
        order.append(("backward",) + bwd[i])
    order += [("backward",) + bwd[i] for i in range(total - warm, total)]
    return order


def build_schedule(name: str, stages: int, micro_batches: int, virtual: int = 1) -> list:
    """Every stage's ordered actions; ``name`` in SCHEDULES. Interleaved
    needs N a multiple of P and P >= 2; V > 1 only under interleaved (with
    V = 1 interleaved is 1F1B)."""
    P, N, V = stages, micro_batches, virtual
    if name not in ALL_SCHEDULES:
        raise ConfigError(f"unknown --pp-schedule {name!r}; choose one of {', '.join(ALL_SCHEDULES)}")
    if P < 1 or N < 1 or V < 1:
        raise ConfigError(f"stages {P}, micro-batches {N} and virtual stages {V} must be at least 1")
    if name in VEE_SCHEDULES and V != 2:
        raise ConfigError(f"{name} runs two chunks a stage (a V): virtual stages 2, got {V}")
    if V > 1 and name not in ("interleaved",) + VEE_SCHEDULES:
        raise ConfigError(f"virtual stages {V} apply to the interleaved schedule only")
    if name == "dualpipev" and N < 2 * P:
        raise ConfigError(f"dualpipev needs at least 2P = {2 * P} micro-batches, got {N}")
    if name == "interleaved" and V > 1 and (P < 2 or N % P):
        raise ConfigError(f"interleaved needs at least 2 stages and micro-batches a multiple of {P}, got {N}")
    last = P * V - 1
    out = []
    orders = zb_order(name, P, N) if name in ZB_SCHEDULES else [_order(name, p, P, N, V) for p in range(P)]
    for p in range(P):
        acts = []
        for op, m, v in orders[p]:
            k = model_chunk(name, p, v, P)
            prev = chunk_place(name, k - 1, P)[0] if k > 0 else None      # the stages of the neighbours,
            after = chunk_place(name, k + 1, P)[0] if k < last else None  # None past the model's ends
            if op == "forward":
                if prev not in (None, p):                  # a V's turn (chunks P-1, P) stays on its stage
                    acts.append(Action("recv_act", m, v, prev))
                acts.append(Action("forward", m, v))
                if after not in (None, p):
                    acts.append(Action("send_act", m, v, after))
            elif op == "backward_weight":                   # W: local, nothing sent or received
                acts.append(Action(op, m, v))
            else:                                           # a whole backward, or its input part B
                if after not in (None, p):
                    acts.append(Action("recv_grad", m, v, after))
                acts.append(Action(op, m, v))
                if prev not in (None, p):
                    acts.append(Action("send_grad", m, v, prev))
        out.append(acts)
    return out


def in_flight(actions: list) -> list:
    """After each action of one stage, the (micro, chunk) pairs whose forward
    has run and whose backward has not: the activations that stage holds.
    The cost model's peak saved activations walk this list."""
    live, out = [], []
    for a in actions:
        if a.op == "forward":
            live = live + [(a.micro, a.chunk)]
        elif a.op in ("backward", "backward_input"):
            live = [x for x in live if x != (a.micro, a.chunk)]
        out.append(tuple(live))
    return out


def in_weight_phase(actions: list) -> list:
    """After each action of one stage, the (micro, chunk) pairs whose input
    gradient B has run and whose weight gradient W has not: the pairs whose
    filed weight work (the linears' saved inputs and output gradients,
    ``parallel.wgrad``) the stage holds. Empty under unsplit schedules."""
    live, out = [], []
    for a in actions:
        if a.op == "backward_input":
            live = live + [(a.micro, a.chunk)]
        elif a.op == "backward_weight":
            live = [x for x in live if x != (a.micro, a.chunk)]
        out.append(tuple(live))
    return out


def peak_in_flight(actions: list) -> int:
    """The most micro-batch chunks one stage holds activations for at once."""
    return max((len(x) for x in in_flight(actions)), default=0)


# ------------------------------------------------------------------ simulator

class Deadlock(RuntimeError):
    """``simulate`` found stages that wait on each other forever."""


def message_source(a: Action, stage: int, stages: int, schedule: str = DEFAULT_SCHEDULE) -> tuple:
    """(kind, micro, model chunk that sent it) of a send or receive: the
    identity of the message at both ends. Under interleaved one pair of
    stages exchanges several chunks of one micro-batch, so the micro alone
    cannot tell them apart. ``schedule`` places the chunks (``model_chunk``:
    a V under zbv)."""
    kind = a.op.split("_")[1]                             # "act" | "grad"
    k = model_chunk(schedule, stage, a.chunk, stages)     # this end's model chunk
    if a.op.startswith("recv"):
        k = k - 1 if kind == "act" else k + 1             # the sender's model chunk
    return kind, a.micro, k


def message_tag(a: Action, stage: int, stages: int, virtual: int, micro_batches: int,
                schedule: str = DEFAULT_SCHEDULE) -> int:
    """A nonnegative MPI tag unique to the message within one step: the two
    ends of a message compute the same tag, and no two messages share one,
    so order between two peers cannot mismatch."""
    kind, m, k = message_source(a, stage, stages, schedule)
    return ((0 if kind == "act" else 1) * stages * virtual + k) * micro_batches + m


def simulate(schedule: list, forward_time: float = 1.0, backward_time: float = 1.0,
             name: str = DEFAULT_SCHEDULE, times=None, transfer=None, overhead=None) -> dict:
    """Run every stage's list with the executor's semantics: a send never
    blocks (nonblocking, receives posted early), a receive blocks until the
    peer's message has arrived, compute takes ``forward_time`` /
    ``backward_time`` per chunk (a split backward's B and W half of it each)
    and communication is free. Unequal stages and real transfers (the cost
    model's bubble of a run, ``analysis.costbubble``): ``times(stage,
    action)`` gives each compute action its own duration, and
    ``transfer(stage, action)`` each send the time its message takes to
    arrive (it does not hold the sender), and ``overhead(stage, action)``
    the executor's own time before each action (idle, as a profile counts
    it: neither a phase nor a wait). Returns {"finish": per-stage end time,
    "busy": per-stage compute time, "time": the step, "bubble": idle share
    of P x step, "timeline": per stage the (start, end, Action) of every
    compute, which tools/pipeline_pictures.py draws}; raises Deadlock
    naming each stuck stage's next action.

    A message is matched by ``message_source`` (kind, micro, sending model
    chunk), as the executor's tags match it; a receive whose peer is not
    the sender's stage never matches."""
    P = len(schedule)
    pos, clock, busy = [0] * P, [0.0] * P, [0.0] * P
    timeline: list = [[] for _ in range(P)]
    sent: dict = {}           # (kind, micro, chunk, from, to) -> arrival time at the receiver
    taken: set = set()
    progress = True
    while progress:
        progress = False
        for p in range(P):
            while pos[p] < len(schedule[p]):
                a = schedule[p][pos[p]]
                before = overhead(p, a) if overhead is not None else 0.0
                if a.op in COMPUTE:
                    clock[p] += before
                    # a split backward: B and W half of a whole one each (F = B = W at backward_time = 2)
                    if times is not None:
                        dt = times(p, a)
                    else:
                        dt = {"forward": forward_time, "backward": backward_time}.get(a.op, backward_time / 2)
                    timeline[p].append((clock[p], clock[p] + dt, a))
                    clock[p] += dt
                    busy[p] += dt
                elif a.op.startswith("send"):
                    key = message_source(a, p, P, name) + (p, a.peer)
                    if key in sent:
                        raise Deadlock(f"stage {p} sends {key[:3]} twice")
                    clock[p] += before
                    sent[key] = clock[p] + (transfer(p, a) if transfer is not None else 0.0)   # arrival
                else:
                    key = message_source(a, p, P, name) + (a.peer, p)
                    if key not in sent or key in taken:
                        break                                   # blocked: not sent (or received already)
                    taken.add(key)
                    clock[p] = max(clock[p] + before, sent[key])
                pos[p] += 1
                progress = True
    stuck = [p for p in range(P) if pos[p] < len(schedule[p])]
    if stuck:
        raise Deadlock("; ".join(f"stage {p} waits at {schedule[p][pos[p]]}" for p in stuck))
    unmatched = sorted(set(sent) - taken)
    if unmatched:
        raise Deadlock(f"messages sent and never received: {unmatched[:3]}")
    # the step as a profile measures it: from the first compute's start to the last's end (with no
    # overhead, 0 to the last clock: stage 0 starts with a forward, every list ends with compute or a send)
    spans = [t for lane in timeline for t in lane]
    step = max(e for _, e, _ in spans) - min(s for s, _, _ in spans) if spans else 0.0
    idle = sum(step - b for b in busy)
    return {"finish": clock, "busy": busy, "time": step, "bubble": idle / (P * step) if step else 0.0,
            "timeline": timeline}
