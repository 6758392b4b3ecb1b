"""Run under mpiexec: one layout trained three optimizer steps with
--recompute none, gathers and blocks, in float64 with dropout. Recomputing
repeats the same arithmetic on the same numbers, so gathers and blocks must
equal none to 1e-12 (relative): the loss and gradient norm of every step,
every gradient of step 1 and every parameter after step 3. The modes must
also really trade: measured saved activations shrink (gathers: what forward
keeps; blocks: what forward keeps plus one rerun block) and the measured
communication grows.

Usage: python -m mpi4py tests/recompute_check.py LAYOUT [DEPTH]
"""

import sys

import numpy as np
from mpi4py import MPI

from mpicube.device.backend import make_backend
from mpicube.parallel.comm import Counters
from mpicube.core.config import ModelConfig
from mpicube.parallel.grid import build_layout
from mpicube.parallel.planning import resolve
from mpicube.parallel.gridspec import GridSpec
from mpicube.model.gpt import gpt_params
from mpicube.training.driver import make_runner
from mpicube.training.optim import AdamW
from mpicube.parallel.gradients import global_grad_norm, sync_gradients
from mpicube.parallel.params import ParamStore

RTOL = 1e-12
CFG = ModelConfig(vocab_size=61, n_ctx=8, n_layer=2, n_head=4, n_embd=16)
BATCH = 8


def run(layout_name, depth, recompute, steps):
    """Three steps on this rank; returns what is compared and measured."""
    backend = make_backend("cpu", "float64")
    counters = Counters()
    run = resolve(GridSpec(layout_name, depth=depth, recompute=recompute), CFG, BATCH, MPI.COMM_WORLD.Get_size())
    layout = build_layout(run, backend, MPI.COMM_WORLD, counters=counters)
    store = ParamStore([layout.shard(d) for d in gpt_params(CFG)], backend, 11)
    model = make_runner(CFG, layout, store, dropout=0.1, seed=11)
    opt = AdamW(store, weight_decay=0.1)
    out = {"loss": [], "norm": [], "grads": None, "kept": 0, "peak": 0, "elems": 0}
    for step, (x, y) in enumerate(steps, start=1):
        store.zero_grad()
        counters.reset()
        out["loss"].append(model.forward(x, y, step=step))
        out["kept"] = model.saved_elements()
        model.backward()
        out["peak"] = model.recompute_peak_elements
        out["elems"] = counters.total_elems()
        sync_gradients(store, layout.axes.dp)
        norm = global_grad_norm(store, layout.axes.tp)
        out["norm"].append(norm)
        if step == 1:
            out["grads"] = {name: store.grad[name].copy() for name in store.grad}
        opt.step(1e-2, grad_scale=min(1.0, 1.0 / norm))
    out["params"] = {name: store.data[name].copy() for name in store.data}
    return out


def differ(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-300)) if b.size else 0.0


def main():
    layout_name = sys.argv[1]
    depth = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    rng = np.random.default_rng(5)
    steps = [(rng.integers(0, CFG.vocab_size, (BATCH, CFG.n_ctx)),
              rng.integers(0, CFG.vocab_size, (BATCH, CFG.n_ctx))) for _ in range(3)]
    base = run(layout_name, depth, "none", steps)
    worst = 0.0
    for mode in ("gathers", "blocks"):
        got = run(layout_name, depth, mode, steps)
        checks = [("loss", got["loss"], base["loss"]), ("grad norm", got["norm"], base["norm"])]
        checks += [(f"step 1 grad {n}", got["grads"][n], base["grads"][n]) for n in base["grads"]]
        checks += [(f"param {n} after 3 steps", got["params"][n], base["params"][n]) for n in base["params"]]
        for name, a, b in checks:
            err = differ(a, b)
            worst = max(worst, err)
            assert err <= RTOL, f"rank {MPI.COMM_WORLD.rank}: {mode}: {name} differs from none by {err:.3e}"
        total = got["kept"] + got["peak"]
        assert total < base["kept"], f"{mode}: {total} saved elements, not fewer than none's {base['kept']}"
        assert got["elems"] > base["elems"], f"{mode}: moves {got['elems']}, not more than none's {base['elems']}"
        if MPI.COMM_WORLD.rank == 0:
            print(f"{mode}: saved {got['kept']} + rerun {got['peak']} elements (none {base['kept']}), "
                  f"moves {float(got['elems']):.0f} elements (none {float(base['elems']):.0f})")
    MPI.COMM_WORLD.Barrier()
    if MPI.COMM_WORLD.rank == 0:
        print(f"OK recompute {layout_name} world={MPI.COMM_WORLD.size} worst={worst:.2e}")


if __name__ == "__main__":
    main()
