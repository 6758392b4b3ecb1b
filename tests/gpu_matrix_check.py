"""Run on CI's CuPy stand-in under ``mpiexec -n 8``: every layout x
{float64, float16, bfloat16} x {staged, CUDA-aware} on ``--device gpu``
against the serial CPU model of the same dtype, in one launch.

Eight ranks hold every layout: serial x dp 8, 1-D p=2 x dp 4, 2-D q=2 x dp 2,
2.5-D q=2 depth 2 and 3-D q=2. Each rank computes the serial CPU reference
once per dtype (on MPI.COMM_SELF, the way tests/parallel_check.py does, and
with its helpers: the blocks each rank compares are the matching blocks of
the serial tensors), then runs each layout twice, staged through host
buffers and with MPI reading the stand-in's "device" memory
(MPICUBE_CUDA_AWARE=1 is read at each collective, so one process does
both). Compared: the loss, the rank's logits, the gradient norm and every
gradient block of step 1, and in float64 every parameter after one AdamW
step. Tolerance: 1e-10 in float64; in 16 bits parallel_check's
wire_tolerance for the layout (its docstring derives it). The stand-in's
stream-order model is on throughout: a collective handed a buffer still
being written by queued work raises.

Usage: mpiexec -n 8 python -m mpi4py tests/gpu_matrix_check.py [DTYPE ...]
Prints one "OK layout dtype transport worst=..." line per case from rank 0.
"""

import os
import sys

import numpy as np
from mpi4py import MPI

import parallel_check as pc
from mpicube.core.config import ModelConfig
from mpicube.device.precision import dtype_of, is_half
from mpicube.training.accum import forward_backward
from mpicube.training.step import make_step

LAYOUTS = [("serial", 8, 1), ("1d", 4, 1), ("2d", 2, 1), ("2.5d", 1, 2), ("3d", 1, 1)]   # (layout, dp, depth)
TRANSPORTS = [("staged", "0"), ("cuda-aware", "1")]
CFG = ModelConfig(vocab_size=61, n_ctx=8, n_layer=2, n_head=4, n_embd=16)
BATCH, DROPOUT, LR = 8, 0.1, 1e-2


def reference(x, y):
    """The serial CPU model's step 1: loss, logits, gradients, parameters after one step."""
    serial = pc.build("serial", MPI.COMM_SELF, CFG, BATCH, 1, 1, DROPOUT)
    serial.store.zero_grad()
    loss = serial.model.forward(x, y, step=1)
    logits = serial.model.logits                                             # (B, T, V)
    serial.model.backward(loss_scale=pc.LOSS_SCALE)
    opt = make_step(serial.store, serial.layout.axes, weight_decay=0.1)
    opt.sync()
    norm = opt.grad_norm() / pc.LOSS_SCALE
    grads = {name: g.copy() for name, g in serial.store.grad.items()}
    opt.step(LR, grad_scale=min(1.0, 1.0 / norm) / pc.LOSS_SCALE)
    return loss, logits, norm, grads, {name: d.copy() for name, d in serial.store.data.items()}


def run_case(layout_name, dp, depth, want, x, y) -> None:
    loss_w, logits_w, norm_w, grads_w, params_w = want
    parts = pc.build(layout_name, MPI.COMM_WORLD, CFG, BATCH, dp, depth, DROPOUT, device="gpu")
    layout, store, model = parts.layout, parts.store, parts.model
    host = layout.backend.to_host
    pc.RTOL = pc.wire_tolerance(layout, store) if pc.HALF else 1e-10
    store.zero_grad()

    def after_forward(m):
        pc.check_logits(parts, m, logits_w, "logits")

    loss = forward_backward(parts, x, y, 1, pc.LOSS_SCALE, after_forward=after_forward)
    pc.close("loss", np.array([loss]), np.array([loss_w]))
    opt = make_step(store, layout.axes, weight_decay=0.1)
    opt.sync()
    norm = opt.grad_norm() / pc.LOSS_SCALE
    pc.close("grad norm", np.array([norm]), np.array([norm_w]))
    pc.check_gradients(store, host, grads_w, "step 1")
    opt.step(LR, grad_scale=min(1.0, 1.0 / norm) / pc.LOSS_SCALE)
    if not pc.HALF:             # after an AdamW step 16-bit parameters are not comparable (parallel_check)
        pc.check_params(store, host, params_w, "after a step")


def main(dtypes):
    assert MPI.COMM_WORLD.size == 8, "run on 8 ranks"
    rng = np.random.default_rng(3)
    x, y = rng.integers(0, CFG.vocab_size, (BATCH, CFG.n_ctx)), rng.integers(0, CFG.vocab_size, (BATCH, CFG.n_ctx))
    for dtype in dtypes:
        pc.DTYPE, pc.HALF = dtype, is_half(dtype_of(dtype))          # parallel_check's helpers read these
        pc.LOSS_SCALE = 1024.0 if dtype == "float16" else 1.0
        want = reference(x, y)
        for layout_name, dp, depth in LAYOUTS:
            for transport, aware in TRANSPORTS:
                os.environ["MPICUBE_CUDA_AWARE"] = aware
                pc.WORST[0] = 0.0
                try:
                    run_case(layout_name, dp, depth, want, x, y)
                except Exception as exc:
                    raise AssertionError(f"{layout_name} {dtype} {transport}: {exc}") from exc
                worst = MPI.COMM_WORLD.allreduce(pc.WORST[0], op=MPI.MAX)
                if MPI.COMM_WORLD.rank == 0:
                    print(f"OK {layout_name} {dtype} {transport} worst={worst:.2e} (rtol {pc.RTOL:.1e})", flush=True)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main(sys.argv[1:] or ["float64", "float16", "bfloat16"])
