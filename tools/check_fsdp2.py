"""An FSDP2 (``fully_shard``) GPT-2 checked against mpicube, on any number
of gloo ranks that divides the batch:

    mpicube trace --dtype float64 --steps 3 --out ref.h5
    torchrun --nproc-per-node 2 tools/check_fsdp2.py --ref ref.h5 --out fsdp.h5 [--plant BUG]
    mpicube compare ref.h5 fsdp.h5

Data parallelism with sharded parameters: every block and then the whole
model are ``fully_shard``-ed, so each rank holds dimension-0 shards of
every parameter, gradient and optimizer state (DTensors, recorded as the
shards they are), and runs its own B/world sequences of each batch
(recorded as its rows of the activations, logits and masks, the loss as
every rank's copy of the global mean). ``check`` below is the user code:
a framework's training loop with the recorder's four calls added.

``--plant BUG`` plants a data-parallel bug of issue 35's catalogue:

- ``dp-scale``: each rank's loss summed instead of averaged over the ranks
  (every gradient times the number of ranks; named at the first gradient,
  the loss agreeing);
- ``dropout-rank``: every rank applies the masks of rank 0's sequences, as
  ranks that share one random stream do (named at ``dropout/emb``).

``--plant all`` writes OUT (no bug) and OUT-BUG.h5 for each bug from one
launch (the test suite's).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

HERE = Path(__file__).resolve().parent
spec = importlib.util.spec_from_file_location("torch_trace", HERE / "torch_trace.py")
torch_trace = importlib.util.module_from_spec(spec)
spec.loader.exec_module(torch_trace)                 # the model, and mpicube.check on the path
from mpicube.check.namemaps import nanogpt          # noqa: E402
from mpicube.check.reference import Reference       # noqa: E402
from mpicube.check.torch import Recorder            # noqa: E402

PLANTS = ("dp-scale", "dropout-rank")


def rows_of(t, rows, full: tuple):
    """This rank's block of a tensor split by sequences: (block, index, shape)."""
    t = t.detach().numpy() if hasattr(t, "detach") else np.asarray(t)
    return t, (rows, *[np.arange(n) for n in full[1:]]), full


def check(ref_path: str, out: str, plant=None) -> None:
    """The user's code: the model, FSDP2, the optimizer and the loop, with
    the recorder's calls (marked) added; ``plant`` puts a bug in."""
    world, rank = dist.get_world_size(), dist.get_rank()
    ref = Reference(ref_path)
    dtype = torch.float64 if ref.dtype == "float64" else torch.float32
    model = torch_trace.GPT(ref.config, ref.dropout).to(dtype)
    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    name_map = nanogpt(ref.config)
    layout = {"framework": "torch", "torch": torch.__version__, "dp": world, "parallel": "FSDP2", "plant": plant}
    with ref, Recorder(model, name_map, out, ref, layout=layout,                           # recorder
                       act_index=lambda key, act: rows_of(act, rows, full_act)[1:]) as rec:
        rec.load_init()                                                                    # recorder
        opt = torch_trace.optimizer_for(model, ref, name_map)
        for s in ref.step_numbers():
            x, y = (torch.as_tensor(t) for t in ref.batch(s))                             # (B, T) each
            B, T = x.shape
            rows = np.arange(rank * B // world, (rank + 1) * B // world)                   # this rank's sequences
            full_act = (B, T, ref.config["n_embd"])
            drawn = np.arange(B // world) if plant == "dropout-rank" else rows
            masks = {site: m[drawn] for site, m in ref.masks(s).items()}
            if masks:
                model.set_masks(masks, "cpu", dtype)
            for group in opt.param_groups:
                group["lr"] = ref.lr(s)
            logits, loss = model(x[rows], y[rows])                                         # loss: this rank's mean
            (loss * world if plant == "dp-scale" else loss).backward()                    # FSDP2 averages gradients
            rec.gradients()                                                                # recorder
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), ref.optimizer["grad_clip"]["max_norm"])
            opt.step()
            opt.zero_grad()
            mean = loss.detach().clone()
            dist.all_reduce(mean)                                                          # the global mean loss
            rec.step(s, loss=mean / world, lr=ref.lr(s), grad_norm=norm.full_tensor(),     # recorder
                     logits=rows_of(logits, rows, (B, T, ref.config["vocab_size"])),
                     masks={k: rows_of(m, rows, ref.masks(s)[k].shape) for k, m in masks.items()},
                     tokens=ref.tokens[s - 1])
            if rank == 0:
                print(f"step {s}: loss {float(mean) / world:.6f}, grad_norm {float(norm.full_tensor()):.6f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ref", required=True, help="mpicube trace to take the model, optimizer and batches from")
    ap.add_argument("--out", required=True, help="trace file to write (rank 0)")
    ap.add_argument("--plant", choices=PLANTS + ("all",), default=None,
                    help="plant a bug to see it named; all: OUT without one, OUT-BUG.h5 for each")
    args = ap.parse_args(argv)
    dist.init_process_group("gloo")
    out = Path(args.out)
    for plant in ((None,) + PLANTS if args.plant == "all" else (args.plant,)):
        check(args.ref, str(out if plant is None or args.plant != "all" else
                            out.with_name(f"{out.stem}-{plant}{out.suffix}")), plant)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
