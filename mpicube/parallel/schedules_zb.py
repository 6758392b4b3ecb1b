"""Zero-bubble pipeline schedules (Qi et al., "Zero Bubble Pipeline
Parallelism", 2023): each backward split into its input-gradient part B
(dX, which the stage below waits for) and its weight-gradient part W (dW,
which nothing waits for until the optimizer step), W deferred into the
time a stage would otherwise idle.

* ``zb-h1``: one chunk per stage, as 1F1B. Stage p keeps at most P - p
  micro-batches between their forward and their B (1F1B's P - p whole
  tapes between forward and backward) and at most p + 1 between their B
  and their W (only the linears' inputs and output gradients, filed by
  ``parallel.wgrad``): the stages near the end, which hold the fewest
  tapes, defer the most Ws, and the drain, where 1F1B waits for
  gradients, runs them. With F = B = W the idle time per stage falls from
  1F1B's (P-1)(F+B+W) to (P-1)(F+B-W), plus (P-N)W with fewer
  micro-batches than stages (too few Ws to fill the drain): a bubble of
  (P-1 + max(0, P-N)) / (3N + P-1 + max(0, P-N)) of the step against
  1F1B's (P-1)/(N + P-1).

Why generated rather than written out: the paper's schedules are the
result of a greedy list scheduler under a memory cap, and so are these.
``zb_order`` steps a clock in unit times (F = B = W = 1 chunk-time, free
communication); at every tick each idle stage starts, in this priority,
the oldest B whose gradient has arrived, else the next F if its input has
arrived and its cap allows another micro-batch in flight, else the oldest
deferred W. The orders it returns are then fixed: the executor runs them
with whatever the real times are, the simulator measures them, the
pictures draw them (``schedules.build_schedule`` adds the sends and
receives as for every schedule).

Every W of a chunk runs after its own B and in the order of that chunk's
Bs (micro-batch order), which keeps each weight gradient's sum order that
of the unsplit backward (``parallel.wgrad``).
"""

from __future__ import annotations

ZB_SCHEDULES = ("zb-h1",)


def zb_caps(name: str, stages: int, micro_batches: int) -> list:
    """Per stage, the most micro-batch chunks between forward and B at once
    (whole tapes): 1F1B's P - p."""
    return [min(stages - p, micro_batches) for p in range(stages)]


def zb_weight_caps(name: str, stages: int, micro_batches: int) -> list:
    """Per stage, the most micro-batch chunks whose B has run and W not, at once."""
    return [min(p + 1, micro_batches) for p in range(stages)]


def zb_order(name: str, stages: int, micro_batches: int) -> list:
    """Stage p's compute order: a list of (op, micro, local chunk), op in
    "forward", "backward_input", "backward_weight" (module docstring)."""
    P, N = stages, micro_batches
    caps = zb_caps(name, P, N)
    wcaps = zb_weight_caps(name, P, N)
    done = {}                                  # (op, micro, stage) -> finish tick
    order = [[] for _ in range(P)]
    next_f = [0] * P                           # the next micro-batch each stage forwards
    pending_b = [[] for _ in range(P)]         # micro-batches forwarded, B not yet run (ascending)
    pending_w = [[] for _ in range(P)]         # micro-batches whose B ran, W not yet (ascending)
    in_flight = [0] * P
    busy_until = [0] * P
    t, total = 0, 3 * N * P
    while sum(len(o) for o in order) < total:
        for p in range(P):
            if busy_until[p] > t:
                continue
            pick = None
            for m in pending_b[p][:1] if len(pending_w[p]) < wcaps[p] else []:   # B: the oldest, once its gradient is here
                if p == P - 1 or done.get(("backward_input", m, p + 1), t + 1) <= t:
                    pick = ("backward_input", m)
                    break
            if pick is None and next_f[p] < N and in_flight[p] < caps[p]:
                m = next_f[p]
                if p == 0 or done.get(("forward", m, p - 1), t + 1) <= t:
                    pick = ("forward", m)
            if pick is None and pending_w[p]:
                pick = ("backward_weight", pending_w[p][0])
            if pick is None:
                continue
            op, m = pick
            if op == "forward":
                next_f[p] += 1
                in_flight[p] += 1
                pending_b[p].append(m)
            elif op == "backward_input":
                pending_b[p].remove(m)
                pending_w[p].append(m)
                in_flight[p] -= 1
            else:
                pending_w[p].remove(m)
            done[op, m, p] = t + 1
            busy_until[p] = t + 1
            order[p].append((op, m, 0))
        t += 1
        if t > 10 * total + 10:
            raise RuntimeError(f"{name}: the greedy order did not finish (P={P}, N={N})")
    return order


def zb_bubble_fraction(name: str, stages: int, micro_batches: int) -> float:
    """The idle share of a step with F = B = W (the cost model's convention:
    a backward twice a forward, split evenly), in F units per stage
    (module docstring): (P-1 + max(0, P-N)) / (3N + P-1 + max(0, P-N))."""
    p, n = stages, micro_batches
    idle = p - 1 + max(0, p - n)
    return idle / (3 * n + idle)
