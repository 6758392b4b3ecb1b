"""This rank's experts of one MoE layer, run on the token rows a
``parallel.experts.Dispatch`` brings them (model/moe.py's forward and
backward), overlapping the all-to-all with their computation where the
layout lets an expert run on its rows in two batches.

Serial and 1-D (``Layout.expert_rows`` answers ``every`` False: an
expert's linears move nothing, or only activations among ranks that hold
the same tokens): the rows of this rank's own tokens for its own experts
never travel (``Dispatch.own``), so while the other ranks' rows are in
flight (``Dispatch.post``) each local expert runs on the own rows, and on
the received ones once they have arrived; those outputs go back
(``post_back``) and the two parts are put back in the sent order.
Backward does the same with the output gradients, and model/moe.py
computes the router's backward while the input gradients travel back.
An expert so runs as two batches: a weight gradient sums the two in turn
(equal to one batch's to rounding), and on 1-D its c_proj's all-reduce
is two calls, the same bytes in 2(p-1) more messages per expert and pass.

2-D, 2.5-D and 3-D (``every`` True): an expert's linears broadcast weight
panels (SUMMA) or gather weights (the cube), which a second batch would
move again, and the cube pads each batch to its j line's most rows; so
each expert runs once, on all its rows in source order (the ep group's
global token order), after they have all arrived.

With the plan's overlap off (``MPICUBE_OVERLAP=0``) the same batches run
in the same order and each exchange is waited for as soon as it is
posted: the blocking path, with the same results and the same traffic.
"""

from __future__ import annotations

import numpy as np

from .. import ops
from ..device.arrays import array_module
from ..parallel.experts import Dispatch


class LocalExperts:
    """``experts``: [(c_fc, c_proj)] the layout's linears of this rank's
    experts, in local order."""

    def __init__(self, layout, experts: list, backend):
        self.layout, self.experts, self.backend = layout, experts, backend

    def forward(self, route: Dispatch, rows):
        """rows (m, h) this rank's kept rows grouped by destination ->
        (outputs (m, h) in the same order, saved, zero rows the experts
        were padded with)."""
        held = route.recv_matrix.sum(axis=0)                                  # (E_l,) rows of each local expert
        sizes, every = self.layout.expert_rows(held)                          # (E_l,) rows each runs on
        sizes = np.asarray(self.backend.to_host(sizes), dtype=np.int64)
        pending = route.post(rows)
        if every:                                                             # once, on every row
            full = route.gathered(route.own(rows), pending.wait())            # (r, h) in source order
            y, runs = self._run(full, route.all_index, sizes, True)
            y_own, y_others = route.split(y)
            saved = (runs,)
        else:                                                                 # own rows while the others travel
            others = None if self.layout.overlap else pending.wait()
            own_sizes = self._sizes(route.own_index)                          # (E_l,) each batch padded alone
            y_own, own_runs = self._run(route.own(rows), route.own_index, own_sizes)   # (s, h)
            others = pending.wait() if others is None else others             # (r_o, h)
            other_sizes = self._sizes(route.others_index)
            y_others, other_runs = self._run(others, route.others_index, other_sizes)
            saved = (own_runs, other_runs)
            sizes = own_sizes + other_sizes
        y_back = route.sent(y_own, route.post_back(y_others).wait())          # (m, h)
        return y_back, saved, int((sizes - held).sum())

    def _sizes(self, index):
        """(E_l,) the rows each local expert runs on for one batch whose
        rows of expert k are ``index(k)``: the layout's padding of the
        batch's counts (1-D under --recompute gathers: a multiple of tp)."""
        held = np.array([index(k).shape[0] for k in range(len(self.experts))], dtype=np.int64)   # (E_l,)
        return np.asarray(self.backend.to_host(self.layout.expert_rows(held)[0]), dtype=np.int64)

    def backward_start(self, route: Dispatch, d_rows, saved):
        """d_rows (m, h) the output gradients in the sent order -> (the
        own rows' input gradients (s, h), the ``Pending`` of the others'
        (m - s, h)): ``route.sent(own, pending.wait())`` finishes, after
        whatever the caller computes meanwhile."""
        pending = route.post(d_rows)
        if len(saved) == 1:
            full = route.gathered(route.own(d_rows), pending.wait())          # (r, h)
            dx_own, dx_others = route.split(self._back(full, saved[0]))
        else:
            others = None if self.layout.overlap else pending.wait()
            dx_own = self._back(route.own(d_rows), saved[0])                  # (s, h)
            others = pending.wait() if others is None else others
            dx_others = self._back(others, saved[1])                          # (r_o, h)
        return dx_own, route.post_back(dx_others)

    def _run(self, rows, index, sizes=None, every: bool = False):
        """rows (n, h) -> (outputs (n, h), runs): each local expert's
        SwiGLU on its rows ``index(k)``, padded to ``sizes[k]`` (default:
        as many as it has); one with none is skipped unless ``every``."""
        xp = array_module(rows)
        y = xp.zeros_like(rows)                                               # (n, h)
        runs = []
        for k, (c_fc, c_proj) in enumerate(self.experts):
            mine = index(k)                                                   # (m_e,) host
            size = mine.shape[0] if sizes is None else int(sizes[k])
            if size == 0 and not every:
                runs.append(None)
                continue
            mine = xp.asarray(mine)
            f, s_fc = c_fc.forward(padded(rows[mine], size))                  # (M_e, 1, 2 F_l) intermediate
            g, s_act = ops.swiglu_forward(f)                                  # (M_e, 1, F_l)
            out, s_proj = c_proj.forward(g)                                   # (M_e, 1, h)
            y[mine] = out[:mine.shape[0], 0]
            runs.append((mine, size, s_fc, s_act, s_proj))
        return y, runs

    def _back(self, d_rows, runs):
        """d_rows (n, h) output gradients laid out as ``_run``'s rows ->
        (n, h) input gradients; adds each expert's weight gradients."""
        xp = array_module(d_rows)
        dx = xp.zeros(d_rows.shape, dtype=d_rows.dtype)                       # (n, h)
        for (c_fc, c_proj), run in zip(self.experts, runs):
            if run is None:
                continue
            mine, size, s_fc, s_act, s_proj = run
            dg = c_proj.backward(padded(d_rows[mine], size), s_proj)          # (M_e, 1, F_l)
            dxe = c_fc.backward(ops.swiglu_backward(dg, s_act), s_fc)         # (M_e, 1, h)
            dx[mine] = dxe[:mine.shape[0], 0]
        return dx


def padded(rows, size: int):
    """rows (m, w) -> (size, 1, w): the rows, then size - m zero rows
    (a layout's padding, ``Layout.expert_rows``), as a layout's linear
    takes them."""
    if rows.shape[0] == size:
        return rows[:, None, :]
    out = array_module(rows).zeros((size, 1, rows.shape[1]), dtype=rows.dtype)   # (size, 1, w)
    out[:rows.shape[0], 0] = rows
    return out
