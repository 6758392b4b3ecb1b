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
  MPICUBE_CHECK_RECOMPUTE=blocks  the layout under test runs with --recompute
                              gathers or blocks (the serial reference with
                              none); memory is checked as what forward keeps
                              plus, for blocks, one rerun block's caches
  MPICUBE_CHECK_ACCUM=N       the layout under test runs each step as N
                              micro-batches (the trainer's
                              mpicube.training.accum.forward_backward), the serial
                              reference the whole batch at once; memory is
                              checked after every micro-batch's forward
                              (with both, they combine)
  MPICUBE_CHECK_ZERO=1        the layout under test shards its optimizer state
                              over dp (--zero 1; the serial model stays zero
                              0): gradients are compared on the chunk each
                              rank owns after the reduce-scatter, parameters
                              after the all-gather, and the memory check
                              measures the sharded moments and master
                              (2 and 3: --zero 2 / 3, gradients and weights
                              sharded per layer, parallel/fsdp.py; memory
                              is every weight and gradient buffer, slots
                              included)
  MPICUBE_CHECK_LAYERS=N      N transformer blocks instead of 2 (--zero 3
                              with more blocks than its two weight slots)
  MPICUBE_CHECK_SEQPAR=1      1-D with --sequence-parallel: canonical
                              activations sharded along the sequence,
                              traffic and memory with its cost-model terms
  MPICUBE_CHECK_CP=C          the layout under test runs with --cp C (world =
                              dp x C x tp; each rank holds 2 of 2C chunks of
                              every sequence): logits are compared at the
                              rank's global positions, traffic and memory
                              with the cp terms of the cost model
  MPICUBE_CHECK_ARCH=llama    a Llama model (grouped-query attention, 6
                              heads over 2 kv heads, untied head, no biases)
                              instead of GPT-2; traffic and memory compared
                              with the cost model's Llama terms too
  MPICUBE_CHECK_ARCH=mixtral  that Llama with a mixture of 4 experts, top 2,
                              the load-balancing and z-losses on (the loss
                              compared includes them); MPICUBE_CHECK_CAPACITY=F
                              dispatches with capacity factor F, and
                              MPICUBE_CHECK_EP=E splits the experts over E of
                              the dp replicas (--ep E); traffic and memory are
                              compared with the model for the routing each
                              layer recorded (analysis/costexperts.py,
                              costexpertcomm.py)
  MPICUBE_CHECK_DEEPSEEK=1    (a mixture) then, in the same launch, a second
                              case on the same plan: the mixture with
                              DeepSeekMoE's options (DEEPSEEK: the sigmoid
                              router with a random bias, 2 groups keeping 1,
                              scaling 2.5, a shared expert, the sequence-wise
                              auxiliary loss) over DEEPSEEK_STEPS steps, the
                              aux-loss-free bias updated after each from the
                              step's global loads (equal to serial's bit for
                              bit); loss, logits, gradients, parameters as
                              above. Its memory and traffic are not priced
                              (the cost model lacks the sigmoid router's
                              tape and the shared experts: left for issue 43
                              item 7)
  MPICUBE_CHECK_GENERATE=1    (a mixture, no --cp) also greedy generation on the
                              layout with --ep (cli.generate's Generator, its
                              smallest batch), with and without the key/value
                              cache, gives the serial model's tokens

Tolerance in 16 bits (u = 2^-11 for float16, 2^-8 for bfloat16, the
largest relative error of one rounding). The sources of difference:

1. Both models round float32 results to 16 bits at the same points. Where
   float32 reassociation (sums in a different order across ranks, relative
   size ~1e-7) moves a value across a 16-bit rounding boundary, that value
   changes by one unit in the last place, 2u relative. Such crossings are
   rare (a fraction ~1e-7/u of the roundings) and independent: a few units
   in the last place of a tensor's largest entry, budgeted as 4 ulps = 8u.
2. The layout's sums travel in 16 bits (mpicube.parallel.comm_wire): each of the g
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

3. Gradients are summed in stages, and under bfloat16 the optimizer's
   gradient sums travel in 16 bits too (precision.gradient_wire): the
   layout's sum of weight-gradient partials over q (2-D, 2.5-D, 3-D), then
   the parameter's replica group (3-D's i-k or i-j plane, q^2 ranks;
   2.5-D's depth, or its column x depth, q d), then data parallelism. A
   16-bit stage rounds each of its inputs once (an input that the stage
   before already rounded is not rounded again: that is exact) and each of
   its sums, every one at most M by the assumption of 2 (rho = 1): a plane
   of q^2 = 4 then dp = 2 rounds 8 partials and 2 + 1 sums.

Together RTOL = 8u + R u, R the most roundings that reach one entry: over
the layout's sums, R = g + 1 for its group g (1-D: p; 2-D, 2.5-D, 3-D: q),
i.e. (9 + g) u; over every parameter's chain of gradient sums,
``roundings``. On the layouts of tests/test_precision.py (dp = 1) that is
11u for 1-D and 2-D (R = 3), 13u for 3-D in bfloat16 (the plane of 4,
R = 5; 11u in float16, whose plane sums are float32), 15u for 2.5-D with
depth 2 in bfloat16 (q then depth, R = 7; 14u in float16); with dp = 2 in
bfloat16, 11u for serial and 1-D, 15u for 2-D. The worst measured is 3.0u
(float16, 1-D) and 2.5u (bfloat16, 3-D; 2.1u on 2-D x dp 2, 2.0u on 1-D
x dp 2), against 0.01u-1.2u when every sum travelled in float32. That
holds while both models start from the same parameters, i.e. for the
loss, logits and gradients of step 1. After an
AdamW step it no longer does: Adam divides each gradient by its own running
magnitude, so a gradient entry that is mostly rounding noise moves its
parameter by a full step either way. So in 16 bits the gradients of steps
2 and 3 and the parameters after them are not compared, and the losses of
steps 2 and 3 (same RTOL) check the updates.
"""

import os
import sys
from dataclasses import replace

import numpy as np
from mpi4py import MPI

from mpicube.device.backend import make_backend
from mpicube.parallel.comm import Counters
from mpicube.core.config import ModelConfig
from mpicube.analysis.costmodel import Problem, step_traffic
from mpicube.parallel.experts import model_specs
from mpicube.analysis.costmemory import (kept_and_rerun_terms, pipeline_peak_activation_bytes,
                                         pipeline_peak_activations, step_memory, step_memory_bytes)
from mpicube.analysis.costmuon import muon_workspace
from mpicube.cli.common import env_settings
from mpicube.parallel.grid import build_layout
from mpicube.parallel.planning import resolve
from mpicube.parallel.context import local_positions, ulysses_of
from mpicube.parallel.gridspec import GridSpec
from mpicube.training.accum import forward_backward
from mpicube.model.gpt import gpt_params
from mpicube.training.driver import make_runner
from moe_costs import check_kept, check_placement, measured_rows, record_runs, take_runs
from replicated_check import check_replicated
from mpicube.training.step import make_step
from mpicube.parallel.fsdp import make_store
from mpicube.parallel.paramspec import clipped_index, real_mask
from mpicube.parallel.zero import ExpertPartition
from mpicube.training.parts import Parts
from mpicube.device.precision import dtype_of, gradient_wire, is_half, unit_roundoff

DEVICE = os.environ.get("MPICUBE_CHECK_DEVICE", "cpu")
DTYPE = os.environ.get("MPICUBE_CHECK_DTYPE", "float64")
RECOMPUTE = os.environ.get("MPICUBE_CHECK_RECOMPUTE", "none")
ZERO = int(os.environ.get("MPICUBE_CHECK_ZERO", "0"))
HALF = is_half(dtype_of(DTYPE))
RTOL = 1e-10           # float64; 16-bit runs set it from the layout (wire_tolerance)
WORST = [0.0]          # the largest relative difference seen, for the report line
PADDED = [0]           # a mixture's zero rows padding experts' batches on this rank (3-D), for the report line
ACCUM = int(os.environ.get("MPICUBE_CHECK_ACCUM", "1"))
LAYERS = int(os.environ.get("MPICUBE_CHECK_LAYERS", "2"))
SEQPAR = os.environ.get("MPICUBE_CHECK_SEQPAR", "0") == "1"   # 1-D under --sequence-parallel
CP = int(os.environ.get("MPICUBE_CHECK_CP", "1"))   # context-parallel ranks (each sequence over CP ranks)
ARCH = os.environ.get("MPICUBE_CHECK_ARCH", "gpt2")
LLAMA = dict(n_head=6, n_embd=24, arch="llama", n_kv_head=2, ffn_hidden=20, rope_theta=100.0, rms_eps=1e-5)
CAPACITY = float(os.environ.get("MPICUBE_CHECK_CAPACITY", "0"))
EP = int(os.environ.get("MPICUBE_CHECK_EP", "1"))
MIXTRAL = dict(LLAMA, n_experts=4, top_k=2, router_aux_loss_coef=0.05, router_z_loss_coef=0.01,
               capacity_factor=CAPACITY)
DEEPSEEK_ON = os.environ.get("MPICUBE_CHECK_DEEPSEEK") == "1"
DEEPSEEK = dict(router="sigmoid", n_groups=2, topk_groups=1, routed_scaling_factor=2.5, n_shared_experts=1,
                moe_ffn_hidden=12, seq_aux_loss_coef=0.05, bias_update_rate=0.01, router_aux_loss_coef=0.0,
                router_z_loss_coef=0.0)
DEEPSEEK_STEPS = 5
# float16 trains with loss scaling (mpicube.training.loss_scale); without it the
# gradients of activations here would sit among float16's subnormals, whose
# spacing is absolute, and the ulp argument above would not apply.
LOSS_SCALE = 1024.0 if DTYPE == "float16" else 1.0


def build(layout_name, comm, cfg, batch, dp, depth, dropout, seed=7, device="cpu", grad_accum=1, recompute="none",
          zero=0, settings=None, ep=None):
    """``settings``: the plan's overlap and attention (None: as the command
    line reads them from MPICUBE_OVERLAP and MPICUBE_ATTENTION); ``ep``:
    the world's expert-parallel ranks (None: MPICUBE_CHECK_EP)."""
    backend = make_backend(device, DTYPE)
    counters = Counters()
    cp = CP if comm is MPI.COMM_WORLD else 1
    ep = (EP if ep is None else ep) if comm is MPI.COMM_WORLD else 1
    grid = GridSpec(layout_name, dp=dp, cp=cp, ep=ep, depth=depth,
                    sequence_parallel=SEQPAR and comm is MPI.COMM_WORLD,
                    grad_accum=grad_accum, recompute=recompute, **(env_settings() if settings is None else settings))
    layout = build_layout(resolve(grid, cfg, batch, comm.Get_size()), backend, comm, counters=counters)
    store = make_store(model_specs(layout, gpt_params(cfg)), backend, seed, dp=layout.axes.dp, zero=zero,
                       edp=layout.axes.edp)
    model = make_runner(cfg, layout, store, dropout=dropout, seed=seed, grad_accum=grad_accum)
    return Parts(cfg, backend, counters, layout, store, model, grad_accum)


def wire_tolerance(layout, store, dtype=None) -> float:
    """RTOL in 16 bits, 8u + R u (module docstring): R the most 16-bit
    roundings that reach one entry, over the layout's sums of activations
    and every gradient's chain of sums. Pipeline stages add the tied wte's
    sum over stages 0 and P-1 (one more 16-bit sum: 2u, as the rounding of
    its two inputs and of the sum)."""
    dtype = DTYPE if dtype is None else dtype
    u = unit_roundoff(dtype_of(dtype))
    g = getattr(layout, "q", getattr(layout, "p", 1))
    most = g + 1 if g > 1 else 0                       # one sum over the layout's group
    half_sums = is_half(gradient_wire(dtype_of(dtype)))
    for spec in store.specs:
        # 2-D, 2.5-D and 3-D sum weight-gradient partials over q (SUMMA's reduce,
        # the cube's reduce-scatter over i); 1-D's weight gradients are local
        chain = [(g, True)] if hasattr(layout, "q") and spec.decl.role in ("w_column", "w_row", "wte") else []
        chain.append((spec.grad_comm.size if spec.grad_comm is not None else 1, half_sums))   # replica group
        chain.append((layout.axes.dp.size, half_sums))                                         # data parallelism
        most = max(most, roundings(chain))
    stages = 2 * u if layout.axes.pp.size > 1 else 0.0
    return 8 * u + most * u + stages


def roundings(chain) -> int:
    """How many values of magnitude <= M (the tensor's largest entry, rho = 1)
    are rounded to 16 bits on the way into one entry of a sum computed in
    stages: ``chain`` lists (group size, travels in 16 bits?) from the first
    stage to the last. A 16-bit stage rounds each of its inputs (unless the
    stage before it already rounded them: rounding again is exact) and each
    of its sums (counted for a reduce-scatter too, which keeps float32: an
    upper bound)."""
    chain = [(g, half) for g, half in chain if g > 1]
    count, rounded = 0, False
    for at, (g, half) in enumerate(chain):
        after = 1
        for later, _ in chain[at + 1:]:
            after *= later                             # sums of this stage in one final entry
        if half:
            count += (0 if rounded else g * after) + after
        rounded = half
    return count


def close(name, got, want, scale=None):
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    scale = np.abs(want).max() if scale is None else scale
    err = np.abs(got - want).max() / max(float(scale), 1e-300) if got.size else 0.0   # float: a 16-bit 0 scale
    WORST[0] = max(WORST[0], err)
    if not err <= RTOL:
        raise AssertionError(f"rank {MPI.COMM_WORLD.rank}: {name} differs from serial by {err:.3e} (relative)")


def problem_of(cfg, layout, plan, batch: int, dtype: str = None) -> Problem:
    """The cost model's description of this rank's share of a run: the
    resolved ``plan`` (a gridspec.Plan) on ``layout`` with ``batch``
    sequences of cfg.n_ctx positions in ``dtype``, at this rank's pipeline
    stage. Every check of traffic and memory (here, pipeline_check,
    combo_matrix_check) starts from it, so they price the same run."""
    return Problem(cfg, layout.name, layout.axes.tp.size, plan.dp, plan.depth, batch, cfg.n_ctx,
                   DTYPE if dtype is None else dtype, recompute=plan.recompute, grad_accum=plan.grad_accum,
                   zero=plan.zero, cp=plan.cp, ulysses=plan.ulysses_size, sequence_parallel=plan.sequence_parallel, pp=plan.pp,
                   pp_schedule=plan.pp_schedule, virtual_stages=plan.virtual_stages, stage=layout.axes.pp.rank,
                   ep=layout.axes.ep.size if layout.axes.ep is not None else 1,
                   ep_rank=layout.axes.ep.rank if layout.axes.ep is not None else 0,
                   fp8=plan.fp8.name if getattr(plan, "fp8", None) is not None else "")


def check_traffic(problem, counters, where: str = None) -> None:
    """Measured elements, bytes and messages per axis == the analytic model."""
    assert_traffic(step_traffic(problem), counters, where or f"rank {MPI.COMM_WORLD.rank}")


def assert_traffic(want, counters, where: str) -> None:
    """Every axis's measured elements, bytes and messages (``counters``)
    equal the cost model's ``want`` (a Traffic); ``where`` names the rank."""
    wrong = []
    for axis in sorted(set(want.elems) | set(counters.elems)):
        got = counters.elems.get(axis, 0), counters.bytes.get(axis, 0), counters.msgs.get(axis, 0)
        model = want.elems.get(axis, 0), want.bytes.get(axis, 0), want.msgs.get(axis, 0)
        if got != model:
            wrong.append(f"axis {axis}: measured {got[0]} elements / {got[1]} bytes / {got[2]} messages, "
                         f"model predicts {model[0]} / {model[1]} / {model[2]}")
    if wrong:               # every axis that differs: which ones do tells what the model misses
        raise AssertionError(f"{where}: " + "; ".join(wrong))


def check_memory(problem, dropout: bool, store, model, kept, adam, where: str = None) -> None:
    """Parameters (master and working copy), gradients, AdamW moments and
    saved activations == the analytic memory model, in elements and in
    bytes (under --zero 1 the padded buffers and the sharded moments and
    master). ``kept`` is (elements, bytes) measured right after forward;
    under --recompute blocks the rerun block's caches (measured in
    backward) come on top, and what forward kept alone is checked too."""
    where = where or f"rank {MPI.COMM_WORLD.rank}"
    want, want_bytes = step_memory(problem, dropout), step_memory_bytes(problem, dropout)
    want_kept = sum(kept_and_rerun_terms(problem, dropout)[0].values())
    if kept[0] != want_kept:
        raise AssertionError(f"{where}: forward keeps {kept[0]} elements, model predicts {want_kept}")
    params = [b for b in store.buffers() if b is not store.flat_grad]     # master (or its chunk), working copy
    grads = [store.flat_grad]
    if isinstance(store.partition, ExpertPartition):                      # --zero 1 --ep: a (C,) of its own
        grads.append(store.grad_chunk)
    if store.streams_gradients:                                           # --zero 2/3: every buffer, slots too
        params, grads = store.param_buffers(), store.grad_buffers()
        counted = (sum(b.size for b in params), sum(b.size for b in grads))
    else:
        counted = (store.flat_work.size, sum(b.size for b in grads))
    got = counted + (adam.m.size + adam.v.size,
           kept[0] + model.recompute_peak_elements, sum(b.nbytes for b in params), sum(b.nbytes for b in grads),
           adam.m.nbytes + adam.v.nbytes, kept[1] + model.recompute_peak_bytes)
    # Muon's step temporaries (costmuon) sit in the optimizer figure but are gone between steps:
    # the moments are what persists here; tests/test_muon.py measures the temporaries' peak
    scratch = muon_workspace(problem)
    predicted = (want.params, want.grads, want.optimizer - scratch, want.activations, want_bytes.params,
                 want_bytes.grads, want_bytes.optimizer - scratch * problem.widths.grad, want_bytes.activations)
    if got != predicted:
        raise AssertionError(f"{where}: measured (params, grads, optimizer, activations, "
                             f"then their bytes) {got}, model predicts {predicted}")


def check_pipeline_memory(problem, pipe, where: str = None, dropout: bool = True) -> None:
    """The most saved activations this stage held at once (``pipe.peak_saved``,
    measured when forward_backward is given ``after_forward``) == the cost
    model's pipeline peak, in elements and bytes (``dropout``: whether the
    run keeps dropout masks)."""
    peak = sum(pipeline_peak_activations(problem, dropout=dropout).values())
    peak_bytes = pipeline_peak_activation_bytes(problem, dropout=dropout)
    if pipe.peak_saved != (peak, peak_bytes):
        raise AssertionError(f"{where or f'rank {MPI.COMM_WORLD.rank}'} (stage {problem.stage}): peak saved "
                             f"activations {pipe.peak_saved} (elements, bytes), model {(peak, peak_bytes)}")


def synced_gradient(store, host):
    """((P_pad,) host gradient, (P_pad,) bool mask) in the full buffer's
    coordinates: where this rank holds the synchronised gradient (all of it
    under --zero 0, its chunk under --zero 1, its chunk of every layer's
    segment under --zero 2 and 3) and its values there."""
    part = store.partition
    if not store.streams_gradients:       # the owned windows of the buffer (two with --ep: zero.ExpertPartition)
        full, chunk = host(store.flat_grad).copy(), host(store.grad_chunk)
        mask = np.zeros(store.flat_grad.size, dtype=bool)
        for start, stop, shift in part.windows():
            full[start:stop], mask[start:stop] = chunk[start - shift:stop - shift], True
        return full, mask
    full, mask, chunk = np.zeros(part.padded), np.zeros(part.padded, dtype=bool), host(store.flat_grad)
    for seg in part.list:
        full[seg.own], mask[seg.own] = chunk[seg.mine], True
    return full, mask


def check_gradients(store, host, serial_grads: dict, label: str) -> None:
    """Every gradient block this rank holds after the step's sums (all of
    it, or its ZeRO chunk) equals the matching block of the serial model's
    ``serial_grads`` ({name: full array}); padding gradients are zero."""
    synced, synced_mask = synced_gradient(store, host)                    # (P_pad,) each
    for spec in store.specs:
        full = serial_grads[spec.name]
        want = full[np.ix_(*clipped_index(spec))]
        lo, hi = store.offsets[spec.name]
        mask, mine = real_mask(spec), synced_mask[lo:hi].reshape(spec.local_shape)
        got = synced[lo:hi].reshape(spec.local_shape)
        close(f"{label} grad {spec.name}", np.where(mask & mine, got, 0), np.where(mask & mine, want, 0),
              np.abs(full).max())
        if not mask.all():
            assert np.all(got[~mask & mine] == 0), f"padding gradient of {spec.name} is not zero"


def check_params(store, host, serial_params: dict, label: str) -> None:
    """Every parameter block of this rank (the master, gathered if sharded:
    a collective) equals the matching block of ``serial_params``."""
    params = store.views(store.full_master())
    for spec in store.specs:
        full, mask = serial_params[spec.name], real_mask(spec)
        close(f"param {spec.name} {label}", np.where(mask, host(params[spec.name]), 0),
              np.where(mask, full[np.ix_(*clipped_index(spec))], 0), np.abs(full).max())


def check_logits(parts, m: int, serial_logits, label: str) -> None:
    """Micro-batch ``m``'s logits on this rank (its sequences, its context-
    parallel positions, its vocabulary columns) == the same entries of the
    serial model's (B, T, V) ``serial_logits``."""
    model, cfg = parts.model, parts.cfg
    emb = model.embedding
    seqs = parts.micro_rows(m).start + emb.logit_seqs           # global sequences of these logits
    v0, nv = emb.vocab_start, model.logits.shape[-1]
    real = max(0, min(nv, cfg.vocab_size - v0))
    ring = parts.layout.axes.cp
    pos = local_positions(cfg.n_ctx, ring.size, ring.rank, ulysses_of(ring))   # this rank's positions
    close(label, parts.layout.backend.to_host(model.logits)[..., :real], serial_logits[seqs][:, pos, v0:v0 + real])


def grid_of(layout_name: str, dp: int, depth: int) -> GridSpec:
    """The plan this module's environment switches describe (world rank's view)."""
    return GridSpec(layout_name, dp=dp, cp=CP, depth=depth, sequence_parallel=SEQPAR, grad_accum=ACCUM,
                    recompute=RECOMPUTE, zero=ZERO)


def check_generation(cfg, layout_name, dp, depth) -> list:
    """MPICUBE_CHECK_GENERATE=1: greedy tokens of the layout with the
    experts split over the ep ranks (every decoding step dispatches its
    rows with the all-to-all), with the key/value cache and without it,
    equal the serial model's (the same seed: the same weights). Each rank
    holds one row as ``mpicube generate`` runs it; a capacity is
    dropped as ``generate`` drops it (``generation_config``). Returns the
    tokens."""
    from mpicube.cli.generate import Generator, Sampler, generation_batch, generation_config

    assert CP == 1, "generation has no --cp"
    cfg, note = generation_config(cfg)
    assert (note is None) == (CAPACITY == 0), note
    world = MPI.COMM_WORLD
    batch = generation_batch(layout_name, cfg, world.size, dp, depth, ep=EP)
    parts = build(layout_name, world, cfg, batch, dp, depth, 0.0)
    serial = build("serial", MPI.COMM_SELF, cfg, 1, 1, 1, 0.0)
    for store in (parts.store, serial.store):          # weights 10x the init's: logits far from uniform
        store.flat[...] *= 10.0
        store.params_changed()
    prompt, new = [5, 17, 40], cfg.n_ctx - 3
    want = Generator(serial).run(prompt, new, Sampler(0.0, 0, 0), cache=False)["tokens"]
    for cache in (True, False):
        got = Generator(parts).run(prompt, new, Sampler(0.0, 0, 0), cache=cache)["tokens"]
        assert got == want, f"rank {world.rank}: generated {got} (cache {cache}), serial {want}"
    assert EP == 1 or parts.counters.elems["ep"] > 0, "no rows went over the ep axis"
    return want


def main():
    layout_name, dp, depth = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    dropout = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0
    if os.environ.get("MPICUBE_CHECK_SIZE") == "large":
        cfg = ModelConfig(vocab_size=61, n_ctx=64, n_layer=LAYERS, n_head=12, n_embd=72)
    else:
        cfg = ModelConfig(vocab_size=61, n_ctx=8, n_layer=LAYERS, n_head=12, n_embd=36)
    if ARCH in ("llama", "mixtral"):
        cfg = ModelConfig(vocab_size=61, n_ctx=cfg.n_ctx, n_layer=LAYERS, **(LLAMA if ARCH == "llama" else MIXTRAL))
    batch = int(sys.argv[5]) if len(sys.argv) > 5 else 72
    run_case(cfg, layout_name, dp, depth, dropout, batch)
    if DEEPSEEK_ON:
        assert ARCH == "mixtral", "MPICUBE_CHECK_DEEPSEEK=1 needs MPICUBE_CHECK_ARCH=mixtral"
        run_case(replace(cfg, **DEEPSEEK), layout_name, dp, depth, dropout, batch, deepseek=True)


def random_biases(store) -> None:
    """The same random bias in every sigmoid router of ``store`` on every rank."""
    for name, bias in store.persistent.items():      # drawn by layer: a pipeline stage holds some of them
        rng = np.random.default_rng([11, int(name.split(".")[1])])
        bias[...] = store.backend.asarray(rng.normal(0, 0.05, bias.shape), dtype=bias.dtype)


def run_case(cfg, layout_name, dp, depth, dropout, batch, deepseek=False):
    """One whole check of ``cfg`` on the plan (module docstring); ``deepseek``:
    the DeepSeekMoE case (MPICUBE_CHECK_DEEPSEEK), its biases updated and compared."""
    from mpicube.model.routers import balance

    T = cfg.n_ctx
    rng = np.random.default_rng(3)
    steps = [(rng.integers(0, 61, (batch, T)), rng.integers(0, 61, (batch, T)))
             for _ in range(DEEPSEEK_STEPS if deepseek else 3)]
    priced = not deepseek                   # the cost model prices Mixtral's mixture only (DEEPSEEK's note)

    parts = build(layout_name, MPI.COMM_WORLD, cfg, batch, dp, depth, dropout, device=DEVICE, grad_accum=ACCUM,
                  recompute=RECOMPUTE, zero=ZERO)
    layout, store, model, counters = parts.layout, parts.store, parts.model, parts.counters
    host = layout.backend.to_host
    if HALF:
        global RTOL
        RTOL = wire_tolerance(layout, store)
    serial = build("serial", MPI.COMM_SELF, cfg, batch, 1, 1, dropout)
    s_layout, s_store, s_model = serial.layout, serial.store, serial.model
    # A mixture's router losses (and capacity) count one micro-batch of every replica together: under
    # --grad-accum the reference is the serial model accumulating those same groups (the rows permuted
    # so that its micro-batch m is every replica's micro-batch m; dropout off, as its masks follow
    # row positions); the whole-batch serial model above still gives the logits (dropless only)
    grouped = ARCH == "mixtral" and ACCUM > 1
    if grouped:
        assert dropout == 0.0, "a mixture under --grad-accum is checked without dropout"
        ref = build("serial", MPI.COMM_SELF, cfg, batch, 1, 1, dropout, grad_accum=ACCUM)
        s_layout, s_store = ref.layout, ref.store
        b_m = batch // (dp * ACCUM)
        perm = np.concatenate([np.arange((r * ACCUM + m) * b_m, (r * ACCUM + m + 1) * b_m)
                               for m in range(ACCUM) for r in range(dp)])      # (B,) rows in the groups' order
    # the optimizer step the trainer runs (zero.ShardedStep under MPICUBE_CHECK_ZERO=1)
    opt, s_opt = make_step(store, layout.axes, weight_decay=0.1), make_step(s_store, s_layout.axes, weight_decay=0.1)
    assert store.partition.sharded == bool(ZERO), "MPICUBE_CHECK_ZERO=1 needs dp > 1"
    if ZERO == 1 and EP > 1:          # dense state over dp, the experts' over the expert-data group (dp cp / ep)
        assert (store.partition.dense.parts, store.partition.experts.parts) == (dp, dp * CP // EP)
    if ZERO >= 2 and EP > 1:          # the same per layer: each block's dense segment and its experts' segment
        assert {(s.expert, s.parts) for s in store.partition.list} == {(False, dp), (True, dp * CP // EP)}
    if deepseek:
        for st in (store, s_store, serial.store):
            random_biases(st)
        assert sorted(store.persistent) == [f"h.{i}.moe.router.score_bias" for i in range(cfg.n_layer)]
    start_biases = [b.copy() for b in s_store.persistent.values()]

    problem = problem_of(cfg, layout, grid_of(layout_name, dp, depth), batch)
    ran = record_runs(model) if ARCH == "mixtral" else None
    if ARCH == "mixtral" and priced:                        # info --experts' table, every layout
        check_placement(resolve(GridSpec(layout_name, dp=dp, cp=CP, ep=EP, depth=depth, grad_accum=ACCUM,
                                         recompute=RECOMPUTE, zero=ZERO), cfg, batch, MPI.COMM_WORLD.size), store)
    for step, (x, y) in enumerate(steps, start=1):
        for st in (store, s_store):
            st.zero_grad()
        counters.reset()
        if grouped:
            s_store.zero_grad()
            s_loss = forward_backward(ref, x[perm], y[perm], step, LOSS_SCALE)
            s_logits = None
            if not CAPACITY:
                serial.store.flat[...] = s_store.flat
                serial.store.params_changed()
                s_model.forward(x, y, step=step)
                s_logits = s_model.logits                           # (B, T, V) the whole batch
                s_model.router_log.take()
        else:
            s_loss = s_model.forward(x, y, step=step)
            s_logits = s_model.logits                               # (B, T, V) the whole batch

        kept = []                                                   # (elements, bytes) per micro-batch

        routing = []                                                # a mixture's Rows per layer, per micro-batch

        def after_forward(m):
            """Between micro-batch m's forward and its backward."""
            kept.append((model.saved_elements(), model.saved_bytes()))
            if ARCH == "mixtral":                                   # this forward's runs of each layer
                routing.append(measured_rows(model.router_log.ledgers[-1], take_runs(ran)))
            if step == 1 and s_logits is not None:
                check_logits(parts, m, s_logits, f"logits of micro-batch {m}")

        if ran is not None:
            take_runs(ran)                                          # the last step's reruns (--recompute blocks)
        loss = forward_backward(parts, x, y, step, LOSS_SCALE, after_forward=after_forward)
        close(f"step {step} loss", np.array([loss]), np.array([s_loss]))
        if not grouped:
            s_model.backward(loss_scale=LOSS_SCALE)
        assert len(set(kept)) == 1 or ARCH == "mixtral", f"micro-batches kept different amounts: {kept}"   # routing
        if parts.layout.attention_kind != "full" and priced:       # the memory model: blockwise attention
            if ARCH == "mixtral":                                   # priced for the routing each layer recorded
                assert ACCUM == 1 or RECOMPUTE != "blocks", "the rerun peak is priced for micro-batch 0's routing"
                for m in range(1, len(kept)):
                    check_kept(replace(problem, routing=(routing[m],)), dropout > 0, kept[m], f"micro-batch {m}")
                check_memory(replace(problem, routing=(routing[0],)), dropout > 0, store, model, kept[0], opt.adam)
            else:
                check_memory(problem, dropout > 0, store, model, kept[0], opt.adam)
        opt.sync()
        s_opt.sync()
        norm = opt.grad_norm() / LOSS_SCALE
        s_norm = s_opt.grad_norm() / LOSS_SCALE
        close(f"step {step} grad norm", np.array([norm]), np.array([s_norm]))
        if step == 1 or not HALF:
            check_gradients(store, host, s_store.grad, f"step {step}")
        opt.step(1e-2, grad_scale=min(1.0, 1.0 / norm) / LOSS_SCALE)
        s_opt.step(1e-2, grad_scale=min(1.0, 1.0 / s_norm) / LOSS_SCALE)
        if deepseek:                                      # the aux-loss-free bias, from the global loads
            padded_now = sum(n for led in model.router_log.ledgers for n in led.padded.values())
            model.router_log.take()
            (ref.model if grouped else s_model).router_log.take()
            serial_loads = (ref.model if grouped else s_model).router_log.loads
            assert sorted(model.router_log.loads) == sorted(serial_loads) and serial_loads
            for k, load in serial_loads.items():          # the counts of the whole global batch
                assert np.array_equal(model.router_log.loads[k], load), f"step {step} layer {k} loads"
            balance(store, cfg, model.router_log.loads)
            balance(s_store, cfg, serial_loads)
            if grouped:
                balance(serial.store, cfg, serial_loads)
            for name, bias in s_store.persistent.items():  # bit for bit: integers' signs
                assert np.array_equal(host(store.persistent[name]), bias), f"step {step} {name}"
            PADDED[0] += padded_now
        elif ARCH == "mixtral":                           # a mixture: priced for this step's routing
            check_traffic(replace(problem, routing=tuple(routing)), counters)
            PADDED[0] += sum(n for led in model.router_log.take_ledgers() for n in led.padded.values())
        else:
            check_traffic(problem, counters)              # the step's all-gather (zero 1) too
    if not HALF:
        check_params(store, host, s_store.data, f"after {len(steps)} steps")
    if deepseek:
        moved = max(float(np.abs(b - rng_start).max()) for b, rng_start in
                    zip(s_store.persistent.values(), start_biases))
        assert moved > 0, "the biases never moved"
        if MPI.COMM_WORLD.rank == 0:
            bias = ",".join(f"{v:+.2f}" for v in host(store.persistent["h.0.moe.router.score_bias"]))
            print(f"OK deepseek-moe {layout_name} world={MPI.COMM_WORLD.size} dp={dp} depth={depth} cp={CP} "
                  f"ep={EP} zero={ZERO} steps={len(steps)} worst={WORST[0]:.2e} bias[h.0]={bias}")
        return
    probed = not HALF and CP == 1            # the REPLICATED linear kind on this layout (tests/replicated_check.py)
    if probed:
        check_replicated(layout, close)
    padded = MPI.COMM_WORLD.allreduce(PADDED[0])
    generated = ""
    if os.environ.get("MPICUBE_CHECK_GENERATE") == "1":
        generated = " generated=" + ",".join(map(str, check_generation(cfg, layout_name, dp, depth)))
    if MPI.COMM_WORLD.rank == 0:
        print(f"OK {layout_name} world={MPI.COMM_WORLD.size} dp={dp} depth={depth} device={DEVICE} "
              f"dtype={DTYPE} recompute={RECOMPUTE} accum={ACCUM} zero={ZERO} cp={CP} loss={s_loss:.12f} "
              f"worst={WORST[0]:.2e} (rtol {RTOL:.1e})" + (" sequence-parallel" if SEQPAR else "") + f" arch={ARCH}"
              + (f" capacity={CAPACITY} ep={EP} padded={padded}" if ARCH == "mixtral" else "") + generated
              + (" replicated-linear" if probed else ""))


if __name__ == "__main__":
    main()
