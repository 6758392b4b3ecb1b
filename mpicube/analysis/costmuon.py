"""What Muon's step holds on top of the optimizer state (``training.muon``):
its temporaries, which exist only inside ``Muon.step`` but set the peak
of a step, priced where ``costmemory`` prices the optimizer state.

Counted from the code, in the master format (elements, each
``widths.grad`` bytes), numpy freeing a temporary when its last reference
goes:

* the Nesterov update of the rank's chunk (C,); under --zero 1-3 its
  all-gather (P_pad,), and the update buffer of the same size (P_pad,;
  the whole local buffer without ZeRO, where the gather is the chunk
  itself);
* one whole matrix at a time: the rank's block (n,), every tp rank's
  blocks gathered (tp, n) over tp (none on one rank), the assembled
  whole (in, out) and its orthogonalised copy (in, out), beside the
  previous matrix's result (the loop's name for it is rebound only when
  this one's returns); the peak over the stage's matrices in order;
* Newton-Schulz's workspace on the matrix it sees (a stacked q/k/v or
  gate/up part under ``--muon-qkv split``, the whole under joint), X
  (r, c) with r <= c: at its peak, in the update of X, the old X, a X,
  B X and the new X (4 r c) beside A and B (2 r^2); in building B, X
  beside the old B, A, b A, c A A and the new B (r c + 5 r^2, the old A
  let go) - the larger of the two, plus one (r, c) copy of X that the
  GEMM takes when X is a transposed view (``gemm_threads``).

tests/test_muon.py holds this within 10 % of the peak tracemalloc sees
in ``Muon._muon`` (numpy's smaller temporaries, the index grids and a
second packing copy make up the rest).
"""

from __future__ import annotations

from ..parallel import zero
from .costbase import Problem, Traffic
from .costparams import local_param_sizes, model_decls, segments_of


def newton_schulz_workspace(rows: int, cols: int) -> int:
    """Elements NS5 holds at its peak on one (rows, cols) matrix (module docstring)."""
    r, c = min(rows, cols), max(rows, cols)
    return max(5 * r * c + 2 * r * r, 2 * r * c + 5 * r * r)


def muon_workspace(p: Problem, qkv: str = "split") -> int:
    """Elements of Muon's temporaries at their peak on this rank (0 under
    another optimizer or without a hidden matrix on this stage)."""
    from ..training.muon import column_groups, is_hidden_matrix

    if p.optimizer != "muon":
        return 0
    sizes = local_param_sizes(p)
    params = sum(n for n, _ in sizes.values())
    matrices = [d for d in model_decls(p.cfg) if d.name in sizes and is_hidden_matrix(d)]
    if not matrices:
        return 0
    if p.segmented:                                # --zero 2, 3: one partition per layer (segments_of)
        segments = segments_of(p, sizes)
        chunk, padded = sum(c for _, _, c, _, _ in segments), sum(parts * c for _, _, c, parts, _ in segments)
        flat = chunk + 2 * padded                  # nesterov (C,), the gathered (P_pad,), the update (P_pad,)
    elif p.sharded:
        padded, chunk = zero.sizes(params, p.shard_dp, p.zero)
        flat = chunk + 2 * padded
    else:
        flat = 2 * params                          # nesterov (= the "gathered"), the update
    one, before = 0, 0
    for d in matrices:
        n_in, n_out = d.shape
        block = sizes[d.name][0]
        gathered = p.tp * block if p.tp > 1 else 0
        ns = max(newton_schulz_workspace(hi - lo, n_in) for lo, hi in column_groups(n_out, d.groups, qkv))
        one = max(one, before + block + gathered + 2 * n_in * n_out + ns)
        before = n_in * n_out                      # its result lives on until the next matrix's returns
    return flat + one


MUON_MATRICES = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def muon_traffic(p: Problem, sizes: dict, segments) -> Traffic:
    """--optimizer muon (training.muon), once per step: under --zero 1-3
    the Nesterov update's chunk all-gathered over dp (C elements, the
    master's width), then this rank's block of each of the stage's hidden
    matrices all-gathered over tp (one all-gather a matrix), so every rank
    holds each whole matrix for Newton-Schulz in turn."""
    t, w = Traffic(), p.widths
    if p.sharded:
        params = sum(n for n, _ in sizes.values())
        chunk = sum(c for _, _, c, _, _ in segments) if segments else zero.sizes(params, p.dp, p.zero)[1]
        t.allgather("dp", p.shard_dp, chunk, width=w.grad)
    for name, (n, _) in sizes.items():                 # one all-gather per matrix
        if name.endswith(MUON_MATRICES):
            t.allgather("tp", p.tp, n, width=w.grad)
    return t
