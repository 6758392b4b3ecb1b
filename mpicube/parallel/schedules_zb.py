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
  gradients, runs them. (Counted in micro-batches the two together reach
  P + 1 on every stage, against 1F1B's P on stage 0: capping them at P
  costs bubble with this scheduler.) With F = B = W the idle time per
  stage falls from 1F1B's (P-1)(F+B+W) to (P-1)(F+B-W), plus (P-N)W with fewer
  micro-batches than stages (too few Ws to fill the drain): a bubble of
  (P-1 + max(0, P-N)) / (3N + P-1 + max(0, P-N)) of the step against
  1F1B's (P-1)/(N + P-1).

* ``zbv``: two chunks per stage in a V (``model_chunk``): stage p holds
  model chunks p and 2P-1-p, so a micro-batch runs down the stages on
  chunks 0..P-1, turns on the last stage (chunks P-1 and P there: no
  message) and comes back up on P..2P-1; the loss sits on stage 0 beside
  the embeddings, and the gradient's first step back starts where the
  forward began. Each stage keeps at most 2 min(P, N) chunk tapes (half a
  stage's layers each: 1F1B's P whole micro-batches) and min(P, N) filed
  weight phases. In chunk-times c (F = B = W = c, half a stage's F) the
  only idle time left is the fill, (P-1)c a stage, plus 3(P-N)c with
  fewer micro-batches than stages: (P-1 + 3 max(0, P-N)) / (6N + P-1 +
  3 max(0, P-N)) of the step, below ZB-H1's.

* ``dualpipev``: the same V, its order written out in DeepSeek's eight
  steps (``schedules_dualpipe``); ``zb_order`` hands it over.

Why generated rather than written out: the paper finds its schedules with
a list scheduler under a memory limit (its ZB-H1 and ZB-V figures are the
hand-tidied results), and a greedy one gives the bubbles above exactly
for every P and N (tests/test_schedules.py), with no special case per
size.
``zb_order`` steps a clock in unit times (F = B = W = 1 chunk-time, free
communication); at every tick each idle stage starts, in this priority,
the oldest B whose gradient has arrived (if its cap allows another
filed weight phase), else the first F by (micro-batch, chunk) whose input
has arrived (if its cap allows another tape), else the oldest deferred
W. The orders it returns are then fixed: the executor runs them with
whatever the real times are, the simulator measures them, the pictures
draw them (``schedules.build_schedule`` adds the sends and receives as
for every schedule).

Every W of a chunk runs after its own B and in the order of that chunk's
Bs (micro-batch order), which keeps each weight gradient's sum order that
of the unsplit backward (``parallel.wgrad``).
"""

from __future__ import annotations

from .schedules_dualpipe import dualpipev_order

ZB_SCHEDULES = ("zb-h1", "zbv", "dualpipev")
VEE_SCHEDULES = ("zbv", "dualpipev")          # two chunks a stage, placed in a V


def model_chunk(name: str, stage: int, v: int, stages: int) -> int:
    """The model chunk of stage ``stage``'s local chunk ``v``: v P + stage
    (the loop every other schedule uses), or in a V stage for chunk 0 and
    2P-1-stage for chunk 1, so chunks P-1 and P share the last stage and
    the last chunk (the head) sits on stage 0 beside the first."""
    if name in VEE_SCHEDULES:
        return stage if v == 0 else 2 * stages - 1 - stage
    return v * stages + stage


def chunk_place(name: str, k: int, stages: int) -> tuple:
    """(stage, local chunk) holding model chunk ``k`` (``model_chunk``'s inverse)."""
    if name in VEE_SCHEDULES:
        return (k, 0) if k < stages else (2 * stages - 1 - k, 1)
    return k % stages, k // stages


def zb_caps(name: str, stages: int, micro_batches: int) -> list:
    """Per stage, the most (micro-batch, chunk) tapes between forward and B
    at once: 1F1B's P - p under ZB-H1; 2P chunk-tapes of half a stage's
    layers each under ZBV (1F1B's P whole ones on every stage)."""
    if name in VEE_SCHEDULES:
        return [2 * min(stages, micro_batches)] * stages
    return [min(stages - p, micro_batches) for p in range(stages)]


def zb_weight_caps(name: str, stages: int, micro_batches: int) -> list:
    """Per stage, the most (micro-batch, chunk) pairs whose B has run and W not."""
    if name in VEE_SCHEDULES:
        return [min(stages, micro_batches)] * stages
    return [min(p + 1, micro_batches) for p in range(stages)]


def zb_order(name: str, stages: int, micro_batches: int) -> list:
    """Stage p's compute order: a list of (op, micro, local chunk), op in
    "forward", "backward_input", "backward_weight" (module docstring)."""
    P, N = stages, micro_batches
    if name == "dualpipev":                    # written out in steps, not found greedily
        return dualpipev_order(P, N)
    V = 2 if name in VEE_SCHEDULES else 1
    last = P * V - 1
    caps, wcaps = zb_caps(name, P, N), zb_weight_caps(name, P, N)
    done = {}                                  # (op, micro, model chunk) -> finish tick
    order = [[] for _ in range(P)]
    forwards = [sorted((m, model_chunk(name, p, v, P)) for m in range(N) for v in range(V)) for p in range(P)]
    pending_b = [[] for _ in range(P)]         # (micro, chunk) forwarded, B not yet run
    pending_w = [[] for _ in range(P)]         # (micro, chunk) whose B ran, W not yet (in B's order)
    tapes = [0] * P
    t, total = 0, 3 * N * V * P

    def ready(op, m, k):
        return done.get((op, m, k), t + 1) <= t

    while sum(len(o) for o in order) < total:
        for p in range(P):
            pick = None
            if len(pending_w[p]) < wcaps[p]:   # B: the oldest whose gradient is here (the head's: none needed)
                for m, k in sorted(pending_b[p], key=lambda mk: (mk[0], -mk[1])):
                    if k == last or ready("backward_input", m, k + 1):
                        pick = ("backward_input", m, k)
                        break
            if pick is None and tapes[p] < caps[p]:
                for m, k in forwards[p]:       # F: the first whose input is here, by (micro, chunk)
                    if k == 0 or ready("forward", m, k - 1):
                        pick = ("forward", m, k)
                        break
            if pick is None and pending_w[p]:
                pick = ("backward_weight",) + pending_w[p][0]
            if pick is None:
                continue
            op, m, k = pick
            if op == "forward":
                forwards[p].remove((m, k))
                tapes[p] += 1
                pending_b[p].append((m, k))
            elif op == "backward_input":
                pending_b[p].remove((m, k))
                pending_w[p].append((m, k))
                tapes[p] -= 1
            else:
                pending_w[p].remove((m, k))
            done[op, m, k] = t + 1
            order[p].append((op, m, chunk_place(name, k, P)[1]))
        t += 1
        if t > 10 * total + 10:
            raise RuntimeError(f"{name}: the greedy order did not finish (P={P}, N={N})")
    return order


def zb_bubble_fraction(name: str, stages: int, micro_batches: int) -> float:
    """The idle share of a step with F = B = W (the cost model's convention:
    a backward twice a forward, split evenly), in F units per stage
    (module docstring): (P-1 + max(0, P-N)) / (3N + P-1 + max(0, P-N))."""
    p, n = stages, micro_batches
    if name == "dualpipev":                    # N >= 2P: no shortfall term (schedules_dualpipe)
        return (p - 1) / (6 * n + p - 1)
    if name in VEE_SCHEDULES:                  # in chunk-times (half a stage's F): 6N of work a stage
        idle = p - 1 + 3 * max(0, p - n)
        return idle / (6 * n + idle)
    idle = p - 1 + max(0, p - n)
    return idle / (3 * n + idle)
