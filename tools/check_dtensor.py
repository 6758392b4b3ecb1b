"""A DTensor tensor-parallel GPT-2 checked against mpicube, on any number
of gloo ranks:

    mpicube trace --dtype float64 --steps 3 --out ref.h5
    torchrun --nproc-per-node 2 tools/check_dtensor.py --ref ref.h5 --out tp.h5 [--plant grad-scale]
    mpicube compare ref.h5 tp.h5

The model is tools/torch_trace.py's nanoGPT-style GPT-2 with each block's
MLP made Megatron-style tensor parallel by ``parallelize_module``
(``c_fc`` column-parallel, ``c_proj`` row-parallel); attention stays
replicated (nanoGPT's fused ``c_attn`` cannot be split by columns without
regrouping its heads). Every rank records: the MLP weights as the DTensor
shards their placements give, everything else as replicas, so ``compare``
puts the shards together and checks that every replica agrees.

``--plant grad-scale`` multiplies the last block's ``c_fc`` weight
gradient by the number of ranks after backward - a gradient scaled by a
parallel size, the bug class AdamW hides - and ``compare`` names that
gradient as the first divergence.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

HERE = Path(__file__).resolve().parent
spec = importlib.util.spec_from_file_location("torch_trace", HERE / "torch_trace.py")
torch_trace = importlib.util.module_from_spec(spec)
spec.loader.exec_module(torch_trace)                 # the model, the loop, and mpicube.check on the path
from mpicube.check.reference import Reference       # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ref", required=True, help="mpicube trace to take the model, optimizer and batches from")
    ap.add_argument("--out", required=True, help="trace file to write (rank 0)")
    ap.add_argument("--plant", choices=["grad-scale"], default=None, help="plant a bug to see it named")
    args = ap.parse_args(argv)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    ref = Reference(args.ref)
    model = torch_trace.GPT(ref.config, ref.dropout).to(torch.float64 if ref.dtype == "float64" else torch.float32)
    for block in model.transformer.h:
        parallelize_module(block.mlp, mesh, {"c_fc": ColwiseParallel(), "c_proj": RowwiseParallel()})

    def grad_scale(m):
        m.transformer.h[-1].mlp.c_fc.weight.grad.mul_(world)

    layout = {"framework": "torch", "torch": torch.__version__, "tp": world, "parallel": "DTensor MLP tp"}
    with ref:
        torch_trace.train_and_record(model, ref, args.out, ref.steps, "cpu", layout,
                                     after_backward=grad_scale if args.plant else None,
                                     say=print if dist.get_rank() == 0 else (lambda *_: None))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
