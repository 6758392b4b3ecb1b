"""Run under mpiexec: one layout against the serial model, in float64 (or
in a 16-bit format against serial in the same format).

Every rank also builds the serial model on MPI.COMM_SELF from the same seed
and batch, and compares its own blocks with the matching blocks of the serial
tensors (equivalent to gathering, without the gather): loss, logits, every
parameter gradient, and every parameter after three AdamW steps. Measured
communication (elements, bytes, messages per axis) and memory (elements and
bytes of parameters and saved activations) must equal the cost model.

Usage: python -m mpi4py tests/parallel_check.py LAYOUT DP DEPTH [DROPOUT [BATCH]]

Environment:
  MPICUBE_CHECK_DEVICE=gpu    the layout under test runs on the GPU (CuPy, or
                              CI's stand-in in tests/fake_gpu), the serial
                              reference on the CPU
  MPICUBE_CHECK_SIZE=large    a model whose per-rank arrays exceed the CPU's
                              cache-blocking size (ops.CACHE_ELEMS) on every
                              layout up to 8 ranks, with a batch of 16 or more
  MPICUBE_CHECK_DTYPE=float16 both models in mixed precision (float16 or
                              bfloat16), compared with the tolerance below

Tolerance in 16 bits (u = 2^-11 for float16, 2^-8 for bfloat16, the
largest relative error of one rounding). Two sources of difference:

1. Both models round float32 results to 16 bits at the same points. Where
   float32 reassociation (sums in a different order across ranks, relative
   size ~1e-7) moves a value across a 16-bit rounding boundary, that value
   changes by one unit in the last place, 2u relative. Such crossings are
   rare (a fraction ~1e-7/u of the roundings) and independent: a few units
   in the last place of a tensor's largest entry, budgeted as 4 ulps = 8u.
2. The layout's sums travel in 16 bits (mpicube.comm_wire): each of the g
   partials p_1..p_g of a sum S is rounded once before the float32 sum,
   which the serial model never does. The sum moves by at most
   sum_k u |p_k| <= g rho u M, where M is the largest |entry| of S's tensor
   and rho = max_k |p_k| / M the partials' size relative to it; an
   all-reduce also rounds S itself before the bias is added (u M more).
   Assumption: rho <= 1, i.e. no rank's partial exceeds the tensor's
   largest entry. A partial is a sum over 1/g of the inner dimension (of
   GEMM products, embedding rows, gradient terms) whose signs are random
   at initialisation, so |p_k| is typically |S|/sqrt(g); rho > 1 would need
   systematic cancellation between ranks. Second assumption: what reaches
   a checked tensor from the wire roundings of earlier layers is no larger
   than one such perturbation of its own - the layers in between
   (LayerNorm, GEMMs with N(0, 0.02) weights, residual adds) do not amplify
   relative errors at initialisation (the float64 check's 1e-10 shows it),
   and roundings of different sums are independent, so they add in
   quadrature, not coherently.

Together RTOL = 8u + (g rho + 1) u = (9 + g) u with rho = 1, g the largest
group a 16-bit sum runs over (1-D: p; 2-D, 2.5-D, 3-D: q); 11u on every
layout of tests/test_precision.py (g = 2), where the worst measured is
3.0u (float16, 1-D) and 2.3u (bfloat16, 3-D), against 0.01u-1.2u when the
sums travelled in float32. That holds while both models start from the same
parameters, i.e. for the loss, logits and gradients of step 1. After an
AdamW step it no longer does: Adam divides each gradient by its own running
magnitude, so a gradient entry that is mostly rounding noise moves its
parameter by a full step either way. So in 16 bits the gradients of steps
2 and 3 and the parameters after them are not compared, and the losses of
steps 2 and 3 (same RTOL) check the updates.
"""

import os
import sys

import numpy as np
from mpi4py import MPI

from mpicube.backend import make_backend
from mpicube.comm import Counters
from mpicube.config import ModelConfig
from mpicube.costmodel import Problem, step_memory, step_memory_bytes, step_traffic
from mpicube.grid import build_layout
from mpicube.model import GPT, gpt_params
from mpicube.optim import AdamW, global_grad_norm, sync_gradients
from mpicube.params import ParamStore, clipped_index, real_mask
from mpicube.precision import is_half, unit_roundoff, dtype_of

DEVICE = os.environ.get("MPICUBE_CHECK_DEVICE", "cpu")
DTYPE = os.environ.get("MPICUBE_CHECK_DTYPE", "float64")
HALF = is_half(dtype_of(DTYPE))
RTOL = 1e-10           # float64; 16-bit runs set it from the layout (wire_tolerance)
WORST = [0.0]          # the largest relative difference seen, for the report line
# float16 trains with loss scaling (mpicube.loss_scale); without it the
# gradients of activations here would sit among float16's subnormals, whose
# spacing is absolute, and the ulp argument above would not apply.
LOSS_SCALE = 1024.0 if DTYPE == "float16" else 1.0


def build(layout_name, comm, cfg, batch, dp, depth, dropout, seed=7, device="cpu"):
    backend = make_backend(device, DTYPE)
    counters = Counters()
    layout = build_layout(layout_name, cfg, batch, backend, comm, dp=dp, depth=depth, counters=counters)
    store = ParamStore([layout.shard(d) for d in gpt_params(cfg)], backend, seed)
    return layout, store, GPT(cfg, layout, store, dropout=dropout, seed=seed), counters


def wire_tolerance(layout) -> float:
    """RTOL in 16 bits, (9 + g) u (module docstring): g the largest group a
    16-bit sum runs over, none on one rank."""
    u = unit_roundoff(dtype_of(DTYPE))
    g = getattr(layout, "q", getattr(layout, "p", 1))
    return 8 * u + ((g + 1) * u if g > 1 else 0.0)


def close(name, got, want, scale=None):
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    scale = np.abs(want).max() if scale is None else scale
    err = np.abs(got - want).max() / max(scale, 1e-300) if got.size else 0.0
    WORST[0] = max(WORST[0], err)
    if not err <= RTOL:
        raise AssertionError(f"rank {MPI.COMM_WORLD.rank}: {name} differs from serial by {err:.3e} (relative)")


def check_traffic(layout_name, cfg, layout, batch, dp, depth, counters):
    """Measured elements, bytes and messages per axis == the analytic model."""
    problem = Problem(cfg, layout.name, layout.axes.tp.size, dp, depth, batch, cfg.n_ctx, DTYPE)
    want = step_traffic(problem)
    axes = set(want.elems) | set(counters.elems)
    for axis in axes:
        got = counters.elems.get(axis, 0), counters.bytes.get(axis, 0), counters.msgs.get(axis, 0)
        model = want.elems.get(axis, 0), want.bytes.get(axis, 0), want.msgs.get(axis, 0)
        if got != model:
            raise AssertionError(f"rank {MPI.COMM_WORLD.rank}: axis {axis}: measured {got[0]} elements / "
                                 f"{got[1]} bytes / {got[2]} messages, model predicts {model[0]} / {model[1]} / "
                                 f"{model[2]}")


def check_memory(cfg, layout, batch, dp, depth, dropout, store, model):
    """Parameters and saved activations == the analytic memory model, in
    elements and in bytes."""
    problem = Problem(cfg, layout.name, layout.axes.tp.size, dp, depth, batch, cfg.n_ctx, DTYPE)
    want, want_bytes = step_memory(problem, dropout > 0), step_memory_bytes(problem, dropout > 0)
    param_bytes = store.flat.nbytes + (store.flat_work.nbytes if store.mixed else 0)
    got = (store.flat.size, model.saved_elements(), param_bytes, model.saved_bytes())
    predicted = (want.params, want.activations, want_bytes.params, want_bytes.activations)
    if got != predicted:
        raise AssertionError(f"rank {MPI.COMM_WORLD.rank}: measured (params, activations, their bytes) {got}, "
                             f"model predicts {predicted}")


def main():
    layout_name, dp, depth = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    dropout = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0
    if os.environ.get("MPICUBE_CHECK_SIZE") == "large":
        cfg = ModelConfig(vocab_size=61, n_ctx=64, n_layer=2, n_head=12, n_embd=72)
    else:
        cfg = ModelConfig(vocab_size=61, n_ctx=8, n_layer=2, n_head=12, n_embd=36)
    T = cfg.n_ctx
    batch = int(sys.argv[5]) if len(sys.argv) > 5 else 72
    rng = np.random.default_rng(3)
    steps = [(rng.integers(0, 61, (batch, T)), rng.integers(0, 61, (batch, T))) for _ in range(3)]

    layout, store, model, counters = build(layout_name, MPI.COMM_WORLD, cfg, batch, dp, depth, dropout,
                                           device=DEVICE)
    host = layout.backend.to_host
    if HALF:
        global RTOL
        RTOL = wire_tolerance(layout)
    s_layout, s_store, s_model, _ = build("serial", MPI.COMM_SELF, cfg, batch, 1, 1, dropout)
    opt, s_opt = AdamW(store, weight_decay=0.1), AdamW(s_store, weight_decay=0.1)
    rows = slice(layout.axes.dp.rank * layout.local_batch, (layout.axes.dp.rank + 1) * layout.local_batch)

    for step, (x, y) in enumerate(steps, start=1):
        for st in (store, s_store):
            st.zero_grad()
        counters.reset()
        loss = model.forward(x[rows], y[rows], step=step)
        s_loss = s_model.forward(x, y, step=step)
        close(f"step {step} loss", np.array([loss]), np.array([s_loss]))
        check_memory(cfg, layout, batch, dp, depth, dropout, store, model)
        if step == 1:
            emb = model.embedding
            seqs = layout.axes.dp.rank * layout.local_batch + emb.logit_seqs
            v0, nv = emb.vocab_start, model.logits.shape[-1]
            real = max(0, min(nv, cfg.vocab_size - v0))
            close("logits", host(model.logits)[..., :real], s_model.logits[seqs][..., v0:v0 + real])
        model.backward(loss_scale=LOSS_SCALE)
        s_model.backward(loss_scale=LOSS_SCALE)
        sync_gradients(store, layout.axes.dp)
        norm = global_grad_norm(store, layout.axes.tp) / LOSS_SCALE
        s_norm = global_grad_norm(s_store, s_layout.axes.tp) / LOSS_SCALE
        close(f"step {step} grad norm", np.array([norm]), np.array([s_norm]))
        for spec in store.specs if step == 1 or not HALF else []:
            full = s_store.grad[spec.name]
            want = full[np.ix_(*clipped_index(spec))]
            mask = real_mask(spec)
            got = host(store.grad[spec.name])
            close(f"step {step} grad {spec.name}", np.where(mask, got, 0), np.where(mask, want, 0), np.abs(full).max())
            if not mask.all():
                assert np.all(got[~mask] == 0), f"padding gradient of {spec.name} is not zero"
        check_traffic(layout_name, cfg, layout, batch, dp, depth, counters)
        opt.step(1e-2, grad_scale=min(1.0, 1.0 / norm) / LOSS_SCALE)
        s_opt.step(1e-2, grad_scale=min(1.0, 1.0 / s_norm) / LOSS_SCALE)
    for spec in store.specs if not HALF else []:
        full = s_store.data[spec.name]
        mask = real_mask(spec)
        close(f"param {spec.name} after 3 steps", np.where(mask, host(store.data[spec.name]), 0),
              np.where(mask, full[np.ix_(*clipped_index(spec))], 0), np.abs(full).max())
    MPI.COMM_WORLD.Barrier()
    if MPI.COMM_WORLD.rank == 0:
        print(f"OK {layout_name} world={MPI.COMM_WORLD.size} dp={dp} depth={depth} device={DEVICE} "
              f"dtype={DTYPE} loss={s_loss:.12f} worst={WORST[0]:.2e} (rtol {RTOL:.1e})")


if __name__ == "__main__":
    main()
