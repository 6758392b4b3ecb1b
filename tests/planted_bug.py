"""The mpicube command line with one bug planted from outside the package
(tests/test_trace.py, tests/test_planted_bugs.py): a trace must name the
first tensor it corrupts.

    mpiexec -n 8 python tests/planted_bug.py BUG trace --layout 3d ...

The package carries no test hook for any of these: each is a patch of one
function or class of mpicube's own code path, made here before the command
runs (``plant`` returns its undo, so tests/planted_check.py runs the whole
catalogue in one launch), so the bug runs exactly where a real one would. BUG is
one of the catalogue of issue 35 (one per real class of parallel bug):

- ``cube-axis=PREFIX``: the named 3-D linear (e.g. ``h.1.mlp.c_fc``)
  reduce-scatters its output over the input's row axis instead of the
  other one: the shapes still fit, the sums are wrong.
- ``sp-grad``: the replicated parameters' partial gradients are not summed
  over the tensor-parallel group (under --sequence-parallel every rank's
  LayerNorm and row-parallel bias gradient then holds its own rows' share).
- ``scale=AXIS`` (dp or cp): every gradient comes out multiplied by that
  axis's size (a loss normalised per replica, or per ring rank, instead of
  by the global token count).
- ``norm-replicas``: the gradient norm counts a replicated block once per
  rank that holds it instead of once.
- ``tied-order``: under a pipeline the tied wte pair is summed in the
  wrong order against the update: the first stage keeps its own half (the
  lookup's) and steps on it, only the last stage receives the sum.
- ``qkv-split``: the fused q/k/v is split over the tensor-parallel ranks
  as one block of columns instead of each of q, k and v in turn, so a
  rank's "q heads" are q and k columns.
- ``dropout-rank``: dropout masks drawn at the replica's local sequence
  index instead of the global one, so every data-parallel replica drops
  the same places of different sequences.
- ``vocab-pad``: the padding columns of a vocabulary padded to a multiple
  of the tensor-parallel size are left in the softmax instead of masked.
- ``router-aux-grad``: a mixture of experts' load-balancing loss is added
  to the loss but its gradient never reaches the router (a detached aux
  loss): the loss and every activation agree, the router's gradient does
  not (transformers #48687's class: router gradients wrong, loss right).
- ``dp-partial=NAME``: the gradient of parameter NAME is left out of the
  data-parallel sum: each replica steps on its own share of it, a pending
  sum consumed as replicated (the missing all-reduce that identical
  inputs hide; named with the sum over dp that would have been right,
  check/placements.py).
- ``moments-dropped=S``: AdamW's moments zeroed before step S, as a
  resume that lost them would (the step count kept).
- ``loss-scale-reset=S``: the dynamic loss scaler back at its initial
  scale before step S, as a resume that did not restore it would.
- ``replica-skip=S``: the data-parallel replica of dp rank 1 skips step
  S's update: its weights and moments drift from the others'.
- ``grads-unapplied``: the gradients are computed, summed and clipped,
  and never applied (the optimizer step does nothing).
- ``precision-off``: a 16-bit run computes in float32 (its trace still
  declares the 16-bit dtype): mixed precision silently off.
- ``grad-error=NAME``: parameter NAME's summed gradient comes out 1% too
  large (the envelope's demonstration, docs/trace-format.md: a bfloat16
  candidate that the depth bound passes and the envelope fails).
- ``kpe-grad-tp`` (issue 43, torchtitan PR #1373's review): MLA's rotary
  key k_pe, which every head reads, has its gradient left unsummed over
  the tensor-parallel ranks holding the other heads: each rank's
  kv_down steps on its own heads' share of k_pe's gradient.
- ``ep-grad-doubled`` (pytorch #160285): under --ep every expert's
  summed gradient comes out twice as large (the loss curve stays the
  same).
- ``bias-local-loads``: the aux-loss-free bias is updated from this
  rank's last micro-batch's loads instead of the whole global batch's
  (every dp, cp and ep rank, every micro-batch): replicas part.
- ``bias-sign``: the bias update's sign flipped (torchtitan #1506): an
  overloaded expert's bias rises.
- ``fp8-amax-shard``: ``--fp8``'s tensor scales from each rank's own
  shard: the amax all-reduce over the stage left out (named at the first
  scale of a split tensor, a weight's on 1-D).
- ``fp8-scale-inverted``: the quantizer divides by the scale instead of
  multiplying (Q = x / s): the scales agree, the FP8 bytes do not.
- ``fp8-grad-e4m3``: the output gradients quantized in e4m3 where the
  recipe says e5m2 (tensorwise's default): named at the first dy scale.
- ``fp8-block-straddle``: a layout's shard boundary cuts through an
  --fp8-block tile or block, and each rank takes the block's scale from
  its own piece (the zero-padded rest of the block). mpicube's layouts
  refuse such a plan (``parallel/fp8.py``: ``check_plan`` while
  resolving, ``check_shard`` as they build); the plant turns both checks
  off, only while it is planted, so the layout quantizes the straddling
  block from the local piece as such a framework does: on 1-D tp 2 with
  --fp8 mxfp8 --fp8-block 16 and --n-embd 16, the attention's output
  projection's input x (8 of a block's 16 columns per rank), named at its
  scale.
- ``mtp-local``: each multi-token prediction depth's loss normalised by
  the token count of this rank's micro-batch (its valid positions)
  instead of the whole step's (Megatron #2417, #1532): equal on one
  rank, off by the replica count under dp.
- ``none``: nothing planted (a clean trace in the same launch).
"""

import dataclasses
import sys


def _swap(owner, attr: str, new):
    """Set ``owner.attr`` to ``new``; the undo puts the old one back."""
    old = getattr(owner, attr)
    setattr(owner, attr, new)
    return lambda: setattr(owner, attr, old)


def _swap_everywhere(module, attr: str, new):
    """``module.attr`` replaced in every loaded module that imported it by
    name too (``from ..model.gpt import gpt_params``); one undo for all."""
    old = getattr(module, attr)
    holders = [m for m in list(sys.modules.values()) if m is not None and getattr(m, attr, None) is old]
    for m in holders:
        setattr(m, attr, new)
    return lambda: [setattr(m, attr, old) for m in holders]


def cube_axis(prefix):
    from mpicube.parallel.layouts import cube

    init = cube.CubeLinear.__init__

    def planted(self, store, name, a, b, **kwargs):
        init(self, store, name, a=a, b=a if name == prefix else b, **kwargs)
    return _swap(cube.CubeLinear, "__init__", planted)


def sp_grad(_):
    from mpicube.parallel import gradients

    return _swap(gradients, "sync_replica_groups", lambda store: store.settle())


def scale(axis):
    from mpicube.parallel import gradients

    call = gradients.GradientSync.__call__

    def planted(self):
        call(self)
        self.store.flat_grad[...] *= getattr(self.axes, axis).size
    return _swap(gradients.GradientSync, "__call__", planted)


def norm_replicas(_):
    from mpicube.parallel import gradients

    squares = gradients.weighted_squares

    def planted(xp, grad, replica_runs):
        return squares(xp, grad, [(1, run) for _, run in replica_runs])
    return _swap_everywhere(gradients, "weighted_squares", planted)


def tied_order(_):
    from mpicube.parallel import gradients

    init = gradients.GradientSync.__init__

    class FirstKeepsItsOwn:
        """The pair's communicator, except that stage 0 keeps its own half."""

        def __init__(self, comm, pp_rank):
            self.comm, self.first = comm, pp_rank == 0

        def allreduce(self, a, **kwargs):
            total = self.comm.allreduce(a, **kwargs)
            return a.copy() if self.first else total

    def planted(self, store, axes):
        init(self, store, axes)
        if self.tied is not None:
            self.tied = FirstKeepsItsOwn(self.tied, axes.pp.rank)
    return _swap(gradients.GradientSync, "__init__", planted)


def qkv_split(_):
    from mpicube.model import gpt

    params = gpt.gpt_params

    def planted(cfg):
        return [dataclasses.replace(d, groups=1) if ".attn.c_attn." in d.name else d for d in params(cfg)]
    return _swap_everywhere(gpt, "gpt_params", planted)


def dropout_rank(_):
    from mpicube.model import block

    def planted(self, micro):
        return micro * self.layout.local_batch              # the replica's own index, not the global one
    return _swap(block.Dropout, "first_seq", planted)


def vocab_pad(_):
    from mpicube import ops

    cross_entropy = ops.cross_entropy_forward

    def planted(logits, targets, vocab_start, vocab_size, *args):
        return cross_entropy(logits, targets, vocab_start, 1 << 40, *args)     # no column is padding
    return _swap(ops, "cross_entropy_forward", planted)


def router_aux_grad(_):
    from mpicube.model import moe

    return _swap(moe.RouterLedger, "dprobs", lambda self: None)


def dp_partial(name):
    from mpicube.parallel import gradients

    call = gradients.GradientSync.__call__

    def planted(self):
        own = self.store.grad[name].copy()                  # this replica's share, before the dp sum
        call(self)
        self.store.grad[name][...] = own
    return _swap(gradients.GradientSync, "__call__", planted)


def _before_step(what):
    """Trainer.train_step made to call ``what(trainer, s)`` first."""
    from mpicube.training import train

    step = train.Trainer.train_step

    def planted(self, s):
        what(self, s)
        return step(self, s)
    return _swap(train.Trainer, "train_step", planted)


def moments_dropped(at):
    def drop(trainer, s):
        if s == int(at):
            trainer.opt.adam.m[...] = 0
            trainer.opt.adam.v[...] = 0
    return _before_step(drop)


def loss_scale_reset(at):
    first = {}

    def reset(trainer, s):
        first.setdefault("scale", trainer.scaler.scale)
        if s == int(at):
            trainer.scaler.scale, trainer.scaler.good_steps = first["scale"], 0
    return _before_step(reset)


def replica_skip(at):
    def skip(trainer, s):
        opt = trainer.opt
        if s == int(at) and trainer.parts.layout.axes.dp.rank == 1:
            opt.step = lambda *args, **kwargs: vars(opt).pop("step")       # this once: no update
    return _before_step(skip)


def grads_unapplied(_):
    from mpicube.training import step

    undo = [_swap(cls, "step", lambda self, lr, grad_scale=1.0: None)
            for cls in (step.ReplicatedStep, step.ShardedStep)]
    return lambda: [u() for u in undo]


def precision_off(_):
    import numpy as np

    from mpicube.device import backend

    post = backend.Backend.__post_init__

    def planted(self):
        post(self)
        if self.dtype.itemsize == 2:                         # a 16-bit run: float32 instead, silently
            self.dtype = np.dtype(np.float32)
    return _swap(backend.Backend, "__post_init__", planted)


def grad_error(name):
    from mpicube.parallel import gradients

    call = gradients.GradientSync.__call__

    def planted(self):
        call(self)
        self.store.grad[name][...] *= 1.01
    return _swap(gradients.GradientSync, "__call__", planted)


def kpe_grad_tp(_):
    from mpicube.parallel.layouts import base

    return _swap(base.Layout, "shared_key_backward", lambda self, dk: self.backend.xp.ascontiguousarray(dk))


def ep_grad_doubled(_):
    from mpicube.parallel import gradients

    call = gradients.GradientSync.__call__

    def planted(self):
        call(self)
        if self.axes.ep is not None and self.axes.ep.size > 1:
            for spec in self.store.specs:
                if spec.expert:
                    self.store.grad[spec.name][...] *= 2
    return _swap(gradients.GradientSync, "__call__", planted)


def bias_local_loads(_):
    import numpy as np

    from mpicube.training import driver

    take = driver.RouterLog.take

    def planted(self):
        last = self.ledgers[-1] if self.ledgers else None
        rec = take(self)
        if last is not None:                             # this rank's own counts (before the ledger's sums)
            E = last.cfg.n_experts
            self.loads = {layer: np.asarray(self.to_host(last.stats[layer][:E]), dtype=np.float64)
                          for layer in last.layers}
        return rec
    return _swap(driver.RouterLog, "take", planted)


def bias_sign(_):
    from mpicube.ops import deepseek_router

    update = deepseek_router.bias_update

    def planted(bias, loads, rate, centred=False):
        return 2 * bias - update(bias, loads, rate, centred)        # bias - delta
    return _swap(deepseek_router, "bias_update", planted)


def fp8_amax_shard(_):
    from mpicube.parallel import fp8

    quantized = fp8.LinearFp8.tensor_quantized

    class OwnShard:
        """The stage's communicator with its max-reduce left out."""

        def allreduce(self, a, **kwargs):
            return a

    def planted(self, a2, role, fmt):
        stage, self.stage = self.stage, OwnShard()
        try:
            return quantized(self, a2, role, fmt)
        finally:
            self.stage = stage
    return _swap(fp8.LinearFp8, "tensor_quantized", planted)


def fp8_scale_inverted(_):
    from mpicube.ops import fp8

    quantize = fp8.quantize

    def planted(x, scale, group, fmt):
        return quantize(x, (1 / scale.astype("float64")).astype(scale.dtype), group, fmt)
    return _swap_everywhere(fp8, "quantize", planted)


def fp8_grad_e4m3(_):
    from mpicube.ops import fp8, fp8_recipes

    return _swap(fp8_recipes.Recipe, "format", lambda self, role: fp8.E4M3)


def fp8_block_straddle(_):
    from mpicube.parallel import fp8, planning

    off = lambda *args, **kwargs: None                      # noqa: E731 - no refusal: the straddle runs
    undo = [_swap_everywhere(fp8, "check_shard", off), _swap(planning, "check_fp8", off)]
    return lambda: [u() for u in undo]


def mtp_local(_):
    import dataclasses as dc

    from mpicube.training import driver

    context = driver.micro_context

    def planted(*args, **kwargs):
        idx, targets, ctx = context(*args, **kwargs)
        local = tuple(int(valid.sum()) for _, _, valid in ctx.mtp)          # this rank's rows and positions
        return idx, targets, dc.replace(ctx, mtp_counts=local)
    return _swap_everywhere(driver, "micro_context", planted)


PLANTS = {"cube-axis": cube_axis, "sp-grad": sp_grad, "scale": scale, "norm-replicas": norm_replicas,
          "tied-order": tied_order, "qkv-split": qkv_split, "dropout-rank": dropout_rank, "vocab-pad": vocab_pad,
          "router-aux-grad": router_aux_grad, "dp-partial": dp_partial,
          "moments-dropped": moments_dropped, "loss-scale-reset": loss_scale_reset, "replica-skip": replica_skip,
          "grads-unapplied": grads_unapplied, "precision-off": precision_off,
          "grad-error": grad_error, "kpe-grad-tp": kpe_grad_tp, "ep-grad-doubled": ep_grad_doubled,
          "bias-local-loads": bias_local_loads, "bias-sign": bias_sign, "fp8-amax-shard": fp8_amax_shard,
          "fp8-scale-inverted": fp8_scale_inverted, "fp8-grad-e4m3": fp8_grad_e4m3,
          "fp8-block-straddle": fp8_block_straddle, "mtp-local": mtp_local,
          "none": lambda _: (lambda: None)}


def plant(bug: str):
    """Plant ``BUG`` or ``BUG=ARG``; returns the undo."""
    name, _, arg = bug.partition("=")
    return PLANTS[name](arg)


if __name__ == "__main__":
    plant(sys.argv.pop(1))
    from mpicube.cli.main import main

    main(sys.argv[1:])
