"""A DTensor tensor-parallel GPT-2 checked against mpicube, on any number
of gloo ranks that divides the heads:

    mpicube trace --dtype float64 --steps 3 --out ref.h5
    torchrun --nproc-per-node 2 tools/check_dtensor.py --ref ref.h5 --out tp.h5 [--plant BUG]
    mpicube compare ref.h5 tp.h5

The model is tools/torch_trace.py's nanoGPT-style GPT-2 made Megatron-style
tensor parallel by ``parallelize_module``: in every block ``attn.c_attn``
and ``mlp.c_fc`` column-parallel, ``attn.c_proj`` and ``mlp.c_proj``
row-parallel, each rank computing its own heads. So that a rank's block of
``c_attn`` rows is whole heads, the fused q/k/v holds its rows per head
(``[q k v]`` of head 0, then of head 1, ..., as Megatron's ``linear_qkv``),
which the name map regroups into the trace's ``[q | k | v]`` (rule
"heads"). Every rank records: the split weights as the DTensor shards
their placements give, the attention dropout masks as the heads it applied,
everything else as replicas, so ``compare`` puts the shards together and
checks that every replica agrees.

``--plant BUG`` plants one of the catalogue of issue 35 (the same bugs
tests/planted_bug.py plants in mpicube), each named by ``compare`` at the
first tensor it spoils:

- ``grad-scale``: the last block's ``c_fc`` weight gradient multiplied by
  the number of ranks (a gradient scaled by a parallel size);
- ``norm-replicas``: the clipping norm sums every rank's squares, so the
  replicated gradients count once per rank (``grad_norm``);
- ``qkv-split``: the fused q/k/v kept in nanoGPT's ``[q | k | v]`` row
  order and split by ``ColwiseParallel`` as it is, so rank 0's "heads" are
  all of q and half of k (``act/h.0.attn``);
- ``dropout-rank``: every rank applies the attention dropout mask of rank
  0's heads, as ranks that share one random stream do
  (``dropout/h.0.attn``, with a reference traced with --dropout);
- ``sp-grad`` (with ``--sp``): the norms' gradients, replicated weights
  whose rows are split, left unsummed over the ranks (the last block's
  ``ln_2`` gradient, its replicas parting between the ranks).

``--sp`` adds Megatron-style sequence parallelism: between the embedding
and ``ln_f`` each rank holds its T/tp rows of the residual stream, and the
recorder is told where they lie (``act_index``).

``--plant all`` writes OUT (no bug) and one OUT-BUG.h5 per bug from one
launch (the test suite's; with ``--sp`` sp-grad too, and OUT-tp.h5: tensor
parallelism without sequence parallelism, no bug).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

HERE = Path(__file__).resolve().parent
spec = importlib.util.spec_from_file_location("torch_trace", HERE / "torch_trace.py")
torch_trace = importlib.util.module_from_spec(spec)
spec.loader.exec_module(torch_trace)                 # the model, the loop, and mpicube.check on the path
from mpicube.check.namemaps import Rule, nanogpt    # noqa: E402
from mpicube.check.reference import Reference       # noqa: E402

PLANTS = ("grad-scale", "norm-replicas", "qkv-split", "dropout-rank")
SP_PLANTS = ("sp-grad",)


class HeadsAttention(torch.nn.Module):
    """Causal attention over this rank's heads: ``c_attn`` (made
    column-parallel) gives (B, T, 3 C/tp) whose columns are [q k v] per
    local head, ``c_proj`` (row-parallel) sums the heads' outputs."""

    def __init__(self, cfg: dict, p: float, tp: int, rank: int, plant):
        super().__init__()
        C, self.n_head = cfg["n_embd"], cfg["n_head"]
        self.c_attn, self.c_proj = torch.nn.Linear(C, 3 * C), torch.nn.Linear(C, C)
        self.attn_dropout, self.resid_dropout = torch_trace.ReplayDropout(p), torch_trace.ReplayDropout(p)
        self.nh, self.p, self.plant = self.n_head // tp, p, plant
        self.heads = np.arange(rank * self.nh, (rank + 1) * self.nh)                 # this rank's heads
        self.drawn = np.arange(self.nh) if plant == "dropout-rank" else self.heads    # the mask it applies
        self.applied = None

    def forward(self, x):
        C = x.shape[-1]
        qkv, hd = self.c_attn(x), C // self.n_head                                   # (B, T, 3 nh hd)
        B, T = qkv.shape[:2]                         # whole sequences (x: a rank's rows under --sp)
        q, k, v = qkv.view(B, T, self.nh, 3, hd).unbind(3)                           # (B, T, nh, hd) each
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))                              # (B, nh, T, hd)
        att = (q @ k.transpose(-2, -1)) / hd ** 0.5                                   # (B, nh, T, T)
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        att = att.masked_fill(~causal, float("-inf")).softmax(dim=-1)
        if self.p > 0:
            keep = self.attn_dropout.mask[:, self.drawn]                              # (B, nh, T, T)
            att = att * keep / (1.0 - self.p)
            full = tuple(self.attn_dropout.mask.shape)
            self.applied = (keep.numpy(), (np.arange(B), self.heads, np.arange(T), np.arange(T)), full)
        y = (att @ v).transpose(1, 2).reshape(B, T, self.nh * hd)                     # (B, T, C/tp)
        return self.resid_dropout(self.c_proj(y))


class SequenceParallelGPT(torch_trace.GPT):
    """``--sp``: between the embedding and ``ln_f`` each rank holds T/tp rows
    of the residual stream (Megatron's sequence parallelism): the norms and
    the residual dropouts work on those rows, the column-parallel linears
    gather the rows (``input_layouts=Shard(1)``), the row-parallel ones
    reduce-scatter onto them (``output_layouts=Shard(1)``). The norms'
    weights are replicated but each rank's gradient covers its rows only,
    so they are summed over the ranks after backward (``sum_norm_grads``)."""

    def __init__(self, cfg: dict, p: float, mesh):
        super().__init__(cfg, p)
        self.mesh, self.tp, self.rank = mesh, mesh.size(), mesh.get_local_rank()

    def rows(self, T: int) -> slice:
        n = T // self.tp
        return slice(self.rank * n, (self.rank + 1) * n)

    def forward(self, idx, targets):
        t, T = self.transformer, idx.shape[1]
        x = t.drop(t.wte(idx) + t.wpe(torch.arange(T)))                             # (B, T, C) on every rank
        x = DTensor.from_local(x, self.mesh, [Replicate()]).redistribute(self.mesh, [Shard(1)]).to_local()
        for block in t.h:                                                            # (B, T/tp, C) rows
            x = block(x)
        x = DTensor.from_local(x, self.mesh, [Shard(1)]).full_tensor()              # (B, T, C) gathered
        logits = self.lm_head(t.ln_f(x))
        return logits, torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))

    def set_masks(self, masks: dict, device, dtype) -> None:
        super().set_masks(masks, device, dtype)
        for block in self.transformer.h:                                             # the residual masks' rows
            rows = self.rows(block.attn.resid_dropout.mask.shape[1])
            block.attn.resid_dropout.mask = block.attn.resid_dropout.mask[:, rows]
            block.mlp.dropout.mask = block.mlp.dropout.mask[:, rows]

    def act_index(self, key: str, out):
        """A block's activations are this rank's rows; the others are whole."""
        if not key.startswith("h."):
            return None
        B, n, C = out.shape
        return (np.arange(B), np.arange(self.rank * n, (self.rank + 1) * n), np.arange(C)), (B, n * self.tp, C)


def sum_norm_grads(model) -> None:
    """The sequence-parallel norms' gradients summed over the ranks."""
    for block in model.transformer.h:
        for p in (*block.ln_1.parameters(), *block.ln_2.parameters()):
            dist.all_reduce(p.grad)


def per_head_qkv(cfg: dict):
    """nanoGPT's map with ``c_attn``'s rows per head (Megatron's layout)."""
    m = nanogpt(cfg)
    for i in range(cfg["n_layer"]):
        for kind in ("weight", "bias"):
            m.rules[f"h.{i}.attn.c_attn.{kind}"] = Rule((f"transformer.h.{i}.attn.c_attn.{kind}",), "heads",
                                                        cfg["n_head"])
    return m


def applied(model, masks: dict) -> dict:
    """The masks as this rank applied them: its heads of each attention mask."""
    return {**masks, **{f"h.{i}.attn": b.attn.applied for i, b in enumerate(model.transformer.h)}}


def clip_counting_replicas(model, max_norm: float):
    """The planted norm: every rank's squares summed, replicas included."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
    total = torch.stack([(t * t).sum() for t in local]).sum()
    dist.all_reduce(total)
    norm = total.sqrt()
    coef = min(1.0, max_norm / (float(norm) + 1e-6)) if max_norm > 0 else 1.0
    for g in grads:
        g.mul_(coef)
    return norm


def run(ref, out: str, plant, mesh, sp: bool = False) -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    model = SequenceParallelGPT(ref.config, ref.dropout, mesh) if sp else torch_trace.GPT(ref.config, ref.dropout)
    rows = Shard(1) if sp else Replicate()                  # what the block's residual stream is
    for block in model.transformer.h:
        block.attn = HeadsAttention(ref.config, ref.dropout, world, rank, plant)
        parallelize_module(block, mesh, {
            "attn.c_attn": ColwiseParallel(input_layouts=rows), "attn.c_proj": RowwiseParallel(output_layouts=rows),
            "mlp.c_fc": ColwiseParallel(input_layouts=rows), "mlp.c_proj": RowwiseParallel(output_layouts=rows)})
    model = model.to(torch.float64 if ref.dtype == "float64" else torch.float32)

    def after_backward(m):
        if sp and plant != "sp-grad":                      # the planted bug: the sum left out
            sum_norm_grads(m)
        if plant == "grad-scale":
            m.transformer.h[-1].mlp.c_fc.weight.grad.mul_(world)

    layout = {"framework": "torch", "torch": torch.__version__, "tp": world, "sequence_parallel": sp,
              "parallel": "DTensor tp", "plant": plant or "none"}
    name_map = nanogpt(ref.config) if plant == "qkv-split" else per_head_qkv(ref.config)
    torch_trace.train_and_record(model, ref, out, ref.steps, "cpu", layout, name_map=name_map,
                                 after_backward=after_backward,
                                 clip_fn=clip_counting_replicas if plant == "norm-replicas" else torch_trace.clip,
                                 applied=applied, act_index=model.act_index if sp else None,
                                 say=print if rank == 0 else (lambda *_: None))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ref", required=True, help="mpicube trace to take the model, optimizer and batches from")
    ap.add_argument("--out", required=True, help="trace file to write (rank 0)")
    ap.add_argument("--sp", action="store_true", help="sequence parallelism between the embedding and ln_f")
    ap.add_argument("--plant", choices=PLANTS + SP_PLANTS + ("all",), default=None,
                    help="plant a bug to see it named (sp-grad needs --sp)")
    args = ap.parse_args(argv)
    if args.plant in SP_PLANTS and not args.sp:
        ap.error(f"--plant {args.plant} is a bug of sequence parallelism: add --sp")
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    with Reference(args.ref) as ref:
        if args.plant != "all":
            run(ref, args.out, args.plant, mesh, args.sp)
        else:
            out = Path(args.out)
            named = lambda tag: str(out.with_name(f"{out.stem}-{tag}{out.suffix}"))       # noqa: E731
            if args.sp:                                     # tensor parallelism alone too, no bug
                run(ref, named("tp"), None, mesh, False)
            for plant in (None,) + PLANTS + (SP_PLANTS if args.sp else ()):
                run(ref, args.out if plant is None else named(plant), plant, mesh, args.sp)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
