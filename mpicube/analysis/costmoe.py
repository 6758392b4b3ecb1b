"""Expert parallelism's all-to-all traffic for one rank and one step, from
the routing it measured (dropless dispatch sends what the router chose,
so the figure can only follow the step; under a capacity it is bounded by
C rows per expert).

What ``parallel.experts.Dispatch`` does per MoE layer and forward pass:
one exchange of the per-expert counts (``Ialltoall``: E/g integers to each
of the g-1 peers, 8 bytes each), the rows to the experts' ranks and the
outputs back (``Ialltoallv``, in the activations' format, one message per
peer with rows); backward sends the output gradients and brings the input
gradients back the same way, reusing the counts. ``--recompute blocks``
reruns the forward (its exchanges included) inside backward. The
gradient norm adds one all-reduce of a float64 over ep (each rank's
experts' squares, ``gradients.global_grad_norm``).
"""

from __future__ import annotations

from fractions import Fraction

from .costbase import Traffic


def ep_traffic(routes, g: int, rank: int, n_experts: int, row: int, width: int, forwards: int = 1,
               norm: bool = True) -> Traffic:
    """Traffic on axis "ep" of one step: ``routes`` lists (rows sent to,
    rows received from) each ep rank, (g,) each, one pair per MoE layer
    and micro-batch; ``rank`` this rank's ep rank, ``row`` the elements of
    a row (the hidden size), ``width`` the activations' bytes, ``forwards``
    forward passes per layer (2 under --recompute blocks), ``norm`` whether
    the step took the gradient norm."""
    t = Traffic()
    if g == 1:
        return t
    if norm:
        t.allreduce("ep", g, 1, width=8)
    for sent, received in routes:
        others = [j for j in range(g) if j != rank]
        t._add("ep", g, (g - 1) * (n_experts // g), g - 1, forwards, 8)             # the counts
        out = Fraction(sum(int(sent[j]) for j in others) * row)
        back = Fraction(sum(int(received[j]) for j in others) * row)
        t._add("ep", g, out, sum(1 for j in others if sent[j]), forwards + 1, width)       # rows, dy out
        t._add("ep", g, back, sum(1 for j in others if received[j]), forwards + 1, width)  # outputs, dx back
    return t


def capacity_bound(n_tokens_rank: int, top_k: int, cap: int, n_experts: int, g: int) -> int:
    """Rows one rank can send to the others per layer and pass under a
    capacity: its own choices, at most K per token, and at most C per
    expert for each of the (g-1) E/g experts it does not hold."""
    return min(n_tokens_rank * top_k, cap * (g - 1) * (n_experts // g))
