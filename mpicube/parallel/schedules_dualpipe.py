"""DualPipeV (DeepSeek-V3's DualPipe cut in half, Sea AI Lab's "cut-in-half"
V): the order of every stage's computes, as data.

The placement is zbv's V (``schedules_zb.model_chunk``): stage p holds
model chunks p (phase 0, the way down) and 2P-1-p (phase 1, the way back
up), so each micro-batch crosses the stages in two directions, and the
first stage holds both the embeddings and the loss. What differs from
ZBV is the order, written out in eight steps rather than found by a
greedy scheduler. Stage p (of P, N >= 2P micro-batches), every phase
taking its micro-batches in order:

1. 2(P-1-p) forwards of phase 0 (the stages further down start later);
2. p+1 pairs F0 F1: the way back up starts;
3. P-1-p triples B1 W1 F1: a split backward on phase 1 and its weight
   part at once (the zero-bubble trick filling the warm-up);
4. N-2P+p+1 rounds F0 B1 F1 B0, backwards whole: the steady state, where
   DualPipe overlaps each forward with the other phase's backward (one
   stream here: they run one after the other, in that order);
5. P-1-p pairs B1, then F1 B0: the forwards run out;
6. p+1 pairs B1 B0, whose second half splits the backward (B now, W filed
   for later; on odd stages from the pair's B1, on even ones from its B0);
7. P-1-p pairs W B0: a filed W, then a split backward of phase 0;
8. p+1 Ws: the rest of the filed weight work, oldest first.

Ws run in the order their Bs filed them (first in, first out), and every
whole backward of a phase comes before its first split one, so each
weight gradient is summed in micro-batch order, as unsplit
(``parallel.wgrad``).

Why the bubble is small: steps 1-3 are a fill of (P-1) chunk-times per
stage beyond what the stages below need, and steps 6-8 drain with Ws
that would otherwise be idle; ``simulate`` measures it, and with F = B =
W = c (a chunk-time) and a whole backward 2c the idle share is
(P-1) / (6N + P-1), as zbv's for N >= P. DualPipe's own overlap of F and
B (its F&B term) needs two streams, which mpicube's one-stream executor
does not model.
"""

from __future__ import annotations


def dualpipev_order(stages: int, micro_batches: int) -> list:
    """Stage p's compute order for every p: (op, micro, local chunk) with op
    in "forward", "backward" (whole), "backward_input", "backward_weight"."""
    P, N = stages, micro_batches
    if N < 2 * P:
        raise ValueError(f"DualPipeV needs at least 2P = {2 * P} micro-batches, got {N}")
    return [_stage_order(P, N, p) for p in range(P)]


def _stage_order(P: int, N: int, p: int) -> list:
    order, nf, nb, filed = [], [0, 0], [0, 0], []

    def f(v):
        order.append(("forward", nf[v], v))
        nf[v] += 1

    def b(v, split=False):
        if split:
            order.append(("backward_input", nb[v], v))
            filed.append((nb[v], v))
        else:
            order.append(("backward", nb[v], v))
        nb[v] += 1

    def w():
        m, v = filed.pop(0)
        order.append(("backward_weight", m, v))

    for _ in range(2 * (P - 1 - p)):             # 1: F0
        f(0)
    for _ in range(p + 1):                       # 2: F0 F1
        f(0)
        f(1)
    for _ in range(P - 1 - p):                   # 3: B1 W1 F1
        b(1, split=True)
        w()
        f(1)
    for _ in range(N - 2 * P + p + 1):           # 4: F0 B1 F1 B0
        f(0)
        b(1)
        f(1)
        b(0)
    for _ in range(P - 1 - p):                   # 5: B1, F1 B0
        b(1)
        f(1)
        b(0)
    half, split = (p + 1) // 2, False            # 6: B1 B0, the second half split
    for i in range(p + 1):
        if i == half and p % 2 == 1:
            split = True
        b(1, split)
        if i == half and p % 2 == 0:
            split = True
        b(0, split)
    for _ in range(P - 1 - p):                   # 7: W B0
        w()
        b(0, split=True)
    while filed:                                 # 8: W
        w()
    return order
