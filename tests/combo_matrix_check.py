"""Run under mpiexec: many combinations of the axes in one launch, each
against the serial model (tests/test_combo_matrix.py picks the cases and
groups them by world size).

A case is one whole plan: layout (with its tensor-parallel size) x dp x pp
(schedule) x cp x sequence parallelism x zero x recompute x grad-accum x
dtype. Every rank builds every case of the launch in turn on
MPI.COMM_WORLD through the trainer's own builder
(training.parts.build_parts on the plan planning.resolve returns), as
tests/gpu_matrix_check.py runs its layouts, and computes the serial
reference itself on MPI.COMM_SELF (once per model, dtype and batch, not
per case), comparing its own blocks with the matching blocks of the serial
tensors: no gather, no rank 0 bottleneck.

Checked for each case over STEPS AdamW steps with dropout 0.1: the loss
and gradient norm of every step, the logits of step 1 (at the rank's
context-parallel positions; not under pp, whose logits live on the last
stage's micro-batches only), every gradient block after the step's sums
(the ZeRO chunk under zero 1-3), the parameters after the last step; each
rank's measured elements, bytes and messages per axis equal to the cost
model, and its saved activations (the pipeline's peak under pp) and
parameter, gradient and optimizer buffers equal to the memory model, and
(without pp) generation's key/value cache (``GPT.new_caches``) equal to
``costmemory.kv_cache_elems``.
Tolerance: 1e-10 in float64; in 16 bits parallel_check.wire_tolerance
(its module docstring derives it), losses only after step 1. The checks
are parallel_check's functions, so this and the per-layout checks test
the same things the same way.

Llama cases (arch=llama heads= kv=; test_combo_matrix.LLAMA_CASES) run the
Llama block (RMSNorm, rotary, SwiGLU, grouped-query attention, untied
head) the same way; where the head split exceeds kv= the layout
replicates kv heads (params.SharedColumns), and ckpt=1 also saves a
checkpoint that a serial reader must see as the serial model.

DeepSeek-V3 cases (arch=deepseek_v3 [qrank=] [experts= ep=] [mtp=]; test_combo_matrix.DEEPSEEK_CASES) run
multi-head latent attention (replicated latents, heads split, k_pe's gradient summed over them) with a
dense MLP, or with experts= DeepSeekMoE after the first block (``DEEPSEEK_MOE``; ep= of the dp replicas
hold the experts), and mtp= multi-token prediction depths (model/mtp.py: on a pipeline's last stage, its
wte copy summed with stage 0's); their traffic, memory and latent cache (the kv latent and k_pe per
token) equal the cost model's MLA terms (analysis/costmla.py) and MTP depths (analysis/costmtp.py) as the
others' do, a DeepSeekMoE's priced for the routing each micro-batch recorded (the ledger's
routes and each local expert's runs: tests/moe_costs.py, ``StageRuns`` under pp), as parallel_check
prices Mixtral's.

FP8 cases (fp8=RECIPE [fp8block=N] steps=3; test_combo_matrix.FP8_CASES)
quantize every linear's GEMM operands (parallel/fp8.py) on the layout and
in the serial reference alike, accumulate in float64, and must equal
serial to 1e-12 (the quantized operands are the same bits; only the
order of float64 sums differs; step 1's quantized x, W and dy of every
GEMM and their scales are compared bit for bit, assembled as trace --fp8
writes them: tests/fp8_operands.py); every one compares its memory with the
model (the quantized copies a grid layout keeps under a tensor scale,
3-D's local X under a tile recipe, delayed's amax histories:
analysis/costfp8.py) and its traffic (amax all-reduces on axis "fp8",
rowwise's row amaxes on the layouts' axes, 3-D's second gathers under a
tile or row recipe; a mixture's experts on every batch of rows they ran
on, MLA's replicated down-projections).

Usage: mpiexec -n W python -m mpi4py tests/combo_matrix_check.py CASE [-- CASE ...]
  CASE = key=value words: layout= tp= depth= dp= pp= schedule= virtual= cp= sp=0|1
         zero= recompute= accum= dtype= layers= batch= [arch=llama heads= kv=] [arch=deepseek_v3 qrank=]
         [experts= ep=] [mtp=] [ckpt=1]
         [cpkind=ulysses|hybrid ulysses=U] [opt=muon qkv=split|joint] [hsdp=R]
         [fp8=RECIPE fp8block=N steps=N]
  (every case's tp x dp x pp x cp must be W)
Prints one "OK case <words> worst=... (rtol ...) <seconds>s" line per case from rank 0.
"""

from __future__ import annotations

import gc
import os
import sys
import time
from dataclasses import dataclass, replace

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import fp8_operands  # noqa: E402
import parallel_check as pc  # noqa: E402  (the shared checks; they read its DTYPE/HALF/RTOL/LOSS_SCALE)
from moe_costs import StageRuns, check_kept, measured_rows, record_runs, take_runs  # noqa: E402
from replicated_check import check_replicated  # noqa: E402
from mpicube.analysis.costfp8 import history_elems  # noqa: E402
from mpicube.analysis.costmemory import kv_cache_elems  # noqa: E402
from mpicube.core.config import ModelConfig  # noqa: E402
from mpicube.device.precision import dtype_of, is_half  # noqa: E402
from mpicube.parallel.gridspec import Plan  # noqa: E402
from mpicube.parallel.planning import resolve  # noqa: E402
from mpicube.training.accum import forward_backward  # noqa: E402
from mpicube.training.fp8_options import fp8_recipe  # noqa: E402
from mpicube.training.parts import Numerics, build_parts  # noqa: E402
from mpicube.training.step import make_step  # noqa: E402

SEED, DROPOUT, LR, STEPS = 7, 0.1, 1e-2, 2
VOCAB, SEQ, HEADS, EMBD = 61, 16, 4, 16
LLAMA = dict(arch="llama", ffn_hidden=24, rope_theta=100.0, rms_eps=1e-5)   # arch=llama: heads= and kv= say the rest
# arch=deepseek_v3: multi-head latent attention (qrank= the q latent's rank, 0: q_proj), v narrower than q/k
DEEPSEEK = dict(arch="deepseek_v3", ffn_hidden=24, rope_theta=100.0, rms_eps=1e-5, kv_lora_rank=8,
                qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=6)
# arch=deepseek_v3 experts=E: DeepSeekMoE after the first (dense) block: the sigmoid router, E experts in 4
# groups, top 2 within 2 groups, scaled 2.5, one shared expert, the sequence-wise auxiliary loss
DEEPSEEK_MOE = dict(top_k=2, router="sigmoid", n_groups=4, topk_groups=2, routed_scaling_factor=2.5,
                    n_shared_experts=1, moe_ffn_hidden=8, first_k_dense=1, seq_aux_loss_coef=0.01,
                    router_aux_loss_coef=0.0, router_z_loss_coef=0.0)


@dataclass(frozen=True)
class Case:
    """One combination, as the words on the command line say it."""

    layout: str
    tp: int
    depth: int = 1
    dp: int = 1
    pp: int = 1
    schedule: str = "1f1b"
    virtual: int = 1
    cp: int = 1
    sp: bool = False
    zero: int = 0
    recompute: str = "none"
    accum: int = 1
    dtype: str = "float64"
    layers: int = 2
    batch: int = 8
    arch: str = "gpt2"
    heads: int = HEADS
    kv: int = 0           # Llama's kv heads (0: as many as heads)
    ckpt: int = 0         # 1: save a checkpoint after the last step and read it as serial (check_checkpoint)
    cpkind: str = "ring"  # --cp-kind: ring, ulysses or hybrid (parallel/ulysses.py)
    ulysses: int = 1      # --ulysses under hybrid
    opt: str = "adamw"    # --optimizer: adamw or muon (training/muon.py)
    qkv: str = "split"    # --muon-qkv: c_attn's q, k, v orthogonalised split or joint
    hsdp: int = 1         # --hsdp R: ZeRO-3 in dp/R shard groups, replicas all-reduced
    experts: int = 0      # arch=llama with a mixture of this many experts (top 2; Mixtral's)
    fp8: str = ""         # an FP8 recipe (--fp8), accumulated in the case's dtype; "" = off
    fp8block: int = 0     # --fp8-block (0: the recipe's)
    steps: int = STEPS
    qrank: int = 6        # deepseek_v3's q latent rank (0: a plain q_proj)
    ep: int = 1           # --ep: expert-parallel ranks taken from dp (a case with experts)
    mtp: int = 0          # deepseek_v3's multi-token prediction depths (--mtp-depth; weight 0.5)
    bias: int = 0         # 1: the aux-loss-free bias update (rate 0.01) after every step, from random biases

    INTS = ("tp", "depth", "dp", "pp", "virtual", "cp", "zero", "accum", "layers", "batch", "heads", "kv", "ckpt",
            "ulysses", "hsdp", "fp8block", "steps", "experts", "qrank", "ep", "mtp", "bias")

    @classmethod
    def parse(cls, words: list) -> "Case":
        kw = dict(w.split("=", 1) for w in words)
        for k in cls.INTS:
            if k in kw:
                kw[k] = int(kw[k])
        if "sp" in kw:
            kw["sp"] = kw["sp"] == "1"
        return cls(**kw)

    @property
    def world(self) -> int:
        return self.tp * self.dp * self.pp * self.cp

    def plan(self) -> Plan:
        return Plan(self.layout, dp=self.dp, pp=self.pp, cp=self.cp, depth=self.depth, pp_schedule=self.schedule,
                    virtual_stages=self.virtual, sequence_parallel=self.sp, zero=self.zero,
                    recompute=self.recompute, grad_accum=self.accum, cp_kind=self.cpkind, ulysses=self.ulysses,
                    hsdp=self.hsdp, fp8=self.recipe(), ep=self.ep)

    def recipe(self):
        """The case's FP8 Recipe (accumulating in its dtype), or None."""
        return fp8_recipe(self.fp8, self.dtype, block=self.fp8block or None) if self.fp8 else None

    def cfg(self) -> ModelConfig:
        if self.arch == "deepseek_v3":
            moe = dict(DEEPSEEK_MOE, n_experts=self.experts, bias_update_rate=0.01 * self.bias) if self.experts else {}
            mtp = dict(mtp_depth=self.mtp, mtp_loss_weight=0.5) if self.mtp else {}
            return ModelConfig(vocab_size=VOCAB, n_ctx=SEQ, n_layer=self.layers, n_head=self.heads, n_embd=EMBD,
                               **DEEPSEEK, q_lora_rank=self.qrank, **moe, **mtp)
        if self.arch == "llama":
            moe = dict(n_experts=self.experts, top_k=2) if self.experts else {}
            return ModelConfig(vocab_size=VOCAB, n_ctx=SEQ, n_layer=self.layers, n_head=self.heads, n_embd=EMBD,
                               **LLAMA, n_kv_head=self.kv or self.heads, **moe)
        return ModelConfig(vocab_size=VOCAB, n_ctx=SEQ, n_layer=self.layers, n_head=self.heads, n_embd=EMBD)

    def words(self) -> str:
        return " ".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in vars(self).items())


def configure(dtype: str) -> None:
    """parallel_check's globals for a case in ``dtype`` (its helpers read them)."""
    pc.DTYPE, pc.HALF = dtype, is_half(dtype_of(dtype))
    pc.LOSS_SCALE = 1024.0 if dtype == "float16" else 1.0
    pc.RTOL, pc.WORST[0] = 1e-10, 0.0


class References:
    """The serial model's figures for every (model, dtype, batch) the launch
    needs, computed once on MPI.COMM_SELF by every rank (same seed, same
    data, same dropout masks, the whole batch at once)."""

    def __init__(self):
        self.done = {}

    def get(self, case: Case, steps: list) -> dict:
        key = (case.layers, case.dtype, case.batch, case.arch, case.heads, case.kv, case.opt, case.qkv, case.fp8,
               case.fp8block, case.steps, case.experts, case.qrank, case.mtp, case.bias)
        if key not in self.done:
            self.done[key] = self._run(case, steps)
        return self.done[key]

    @staticmethod
    def _run(case: Case, steps: list) -> dict:
        # FP8 scales are the micro-batch's (the GEMM's operand): its reference runs the case's micro-batches
        accum = case.accum if case.fp8 else 1
        assert accum == 1 or case.dp == 1, "an FP8 case with accum > 1 runs on dp 1 (its micro-batches are serial's)"
        serial = build_parts(resolve(Plan("serial", grad_accum=accum, fp8=case.recipe()), case.cfg(), case.batch, 1),
                             MPI.COMM_SELF, Numerics(case.dtype), seed=SEED, dropout=DROPOUT)
        opt = make_step(serial.store, serial.layout.axes, weight_decay=0.1, optimizer=case.opt, muon_qkv=case.qkv)
        out = {"loss": [], "norm": [], "grads": [], "bias": []}
        random_biases(serial.store)
        for step, (x, y) in enumerate(steps, start=1):
            serial.store.zero_grad()
            logits = []                                                    # (B/N, T, V) per micro-batch
            watched = fp8_operands.watch(serial, case.batch, SEQ) if case.fp8 and step == 1 else None
            out["loss"].append(forward_backward(serial, x, y, step, pc.LOSS_SCALE,
                                                after_forward=lambda m: logits.append(serial.model.logits.copy())))
            if watched is not None:                                        # step 1's quantized operands
                out["fp8"] = fp8_operands.collected(serial, watched, accum, MPI.COMM_SELF)
            if step == 1:
                out["logits"] = np.concatenate(logits)                     # (B, T, V)
            opt.sync()
            norm = opt.grad_norm() / pc.LOSS_SCALE
            out["norm"].append(norm)
            out["grads"].append({n: g.copy() for n, g in serial.store.grad.items()})
            opt.step(LR, grad_scale=min(1.0, 1.0 / norm) / pc.LOSS_SCALE)
            out["bias"].append(update_biases(serial, case))
        out["params"] = {n: d.copy() for n, d in serial.store.data.items()}
        return out


def random_biases(store) -> None:
    """The same random bias in every sigmoid router of ``store`` on every
    rank, drawn by layer (a pipeline stage holds some of them)."""
    for name, bias in store.persistent.items():
        rng = np.random.default_rng([11, int(name.split(".")[1])])
        bias[...] = store.backend.asarray(rng.normal(0, 0.05, bias.shape), dtype=bias.dtype)


def update_biases(parts, case: Case) -> dict:
    """bias=1: the trainer's aux-loss-free update after the step (the loads
    of the whole global batch, every replica and micro-batch: an MTP
    depth's mixture among them) -> {name: bias} this rank holds, on the host."""
    from mpicube.model.routers import balance

    if not case.bias:
        return {}
    log = parts.model.router_log
    log.take()
    balance(parts.store, parts.cfg, log.loads)
    return {n: parts.layout.backend.to_host(b).copy() for n, b in parts.store.persistent.items()}


def batches(case: Case) -> list:
    """case.steps (x, y) global batches of the case's size (the same on every rank)."""
    rng = np.random.default_rng(3)
    return [(rng.integers(0, VOCAB, (case.batch, SEQ)), rng.integers(0, VOCAB, (case.batch, SEQ)))
            for _ in range(case.steps)]


def run_case(case: Case, refs: References) -> None:
    world = MPI.COMM_WORLD
    assert case.world == world.size, f"{case.words()}: needs {case.world} ranks, launched on {world.size}"
    configure(case.dtype)
    if case.fp8:                    # FP8 operands are bitwise the serial model's; float64 sums differ in order only
        pc.RTOL = 1e-12
    steps = batches(case)
    want = refs.get(case, steps)
    plan, cfg = case.plan(), case.cfg()
    parts = build_parts(resolve(plan, cfg, case.batch, world.size), world, Numerics(case.dtype), seed=SEED,
                        dropout=DROPOUT)
    layout, store, model, counters = parts.layout, parts.store, parts.model, parts.counters
    host = layout.backend.to_host
    if pc.HALF:
        pc.RTOL = pc.wire_tolerance(layout, store, case.dtype)
    problem = replace(pc.problem_of(cfg, layout, plan, case.batch, case.dtype), optimizer=case.opt, hsdp=case.hsdp)
    where = f"rank {world.rank} (stage {layout.axes.pp.rank})"
    opt = make_step(store, layout.axes, weight_decay=0.1, optimizer=case.opt, muon_qkv=case.qkv)
    random_biases(store)
    # a mixture is priced for the routing each layer recorded (tests/moe_costs.py: the ledgers' routes and
    # each local expert's runs), per micro-batch; under pp the stage's chunks' (StageRuns)
    ran = runs = None
    if case.experts:
        ran, runs = (record_runs(model), None) if parts.pipeline is None else (None, StageRuns(parts.pipeline))
    for step, (x, y) in enumerate(steps, start=1):
        store.zero_grad()
        counters.reset()
        kept = []                                                    # (elements, bytes) per micro-batch
        routing = []                                                 # a mixture's Rows per layer, per micro-batch
        if ran is not None:
            take_runs(ran)                                           # the last step's reruns (--recompute blocks)

        def after_forward(m):
            """Between micro-batch m's forward and its backward (under pp the
            pipeline measures its own peak when this is given)."""
            if runs is not None:
                runs.after_forward(m)
            if parts.pipeline is None:
                kept.append((model.saved_elements(), model.saved_bytes()))
                if ran is not None:                                  # this forward's runs of each layer
                    routing.append(measured_rows(model.router_log.ledgers[-1], take_runs(ran)))
                if step == 1:
                    pc.check_logits(parts, m, want["logits"], f"logits of micro-batch {m}")

        watched = fp8_operands.watch(parts, case.batch, SEQ) if case.fp8 and step == 1 else None
        loss = forward_backward(parts, x, y, step, pc.LOSS_SCALE, after_forward=after_forward)
        if watched is not None:             # step 1's FP8 bytes and scales: serial's bit for bit
            got = fp8_operands.collected(parts, watched, case.accum, world)
            wrong = fp8_operands.differences(got, want["fp8"], case.recipe()) if world.rank == 0 else None
            wrong = world.bcast(wrong, root=0)
            assert not wrong, f"step 1 FP8 operands: {wrong[:3]} ({len(wrong)} in all)"
        pc.close(f"step {step} loss", [loss], [want["loss"][step - 1]])
        if runs is not None:                                         # the stage's ledgers, before the bias update
            routing = list(runs.take(parts.pipeline.router_log.ledgers))
        routed = replace(problem, routing=tuple(routing)) if routing else problem   # priced for its routing
        if parts.pipeline is None:
            assert len(set(kept)) == 1 or case.experts, f"micro-batches kept different amounts: {kept}"
            assert case.accum == 1 or case.recompute != "blocks" or not case.experts, \
                "the rerun peak is priced for micro-batch 0's routing"
            for m in range(1, len(routing)):        # a mixture's micro-batches keep what their routing asks
                check_kept(replace(routed, routing=(routing[m],)), True, kept[m], f"micro-batch {m}")
            pc.check_memory(replace(routed, routing=tuple(routing[:1])) if routing else problem, True,
                            store, model, kept[0], opt.adam, where)
        opt.sync()
        norm = opt.grad_norm() / pc.LOSS_SCALE
        pc.close(f"step {step} grad norm", [norm], [want["norm"][step - 1]])
        if step == 1 or not pc.HALF:        # after an AdamW step 16-bit gradients are not comparable
            pc.check_gradients(store, host, want["grads"][step - 1], f"step {step}")
        opt.step(LR, grad_scale=min(1.0, 1.0 / norm) / pc.LOSS_SCALE)
        biases = update_biases(parts, case)
        assert not case.bias or biases, f"{where}: bias=1 but no router bias here"
        for name, bias in biases.items():               # bit for bit: integers' signs, whatever the ep size
            assert np.array_equal(bias, want["bias"][step - 1][name]), f"{where}: step {step} {name}"
        pc.check_traffic(routed, counters, where)                    # the step's all-gathers too
        if case.fp8 and step > 1:       # delayed's amax histories (one pushed per step): the memory model's
            held = sum(h.size for h in layout.fp8.history.values())
            want_held = history_elems(problem, layout.fp8.recipe.history)
            assert held == want_held, f"{where}: amax histories hold {held} amaxes, model {want_held}"
        if parts.pipeline is not None:
            pc.check_pipeline_memory(routed, parts.pipeline, where)
        if case.experts:                                             # the step's ledgers (update_biases took them)
            model.router_log.take_ledgers()
    if not pc.HALF:
        pc.check_params(store, host, want["params"], f"after {case.steps} steps")
    if parts.pipeline is None:          # generation's cache (GQA: kv heads; MLA: latent and k_pe) == the model
        caches = sum(c.c_kv.size + c.k_pe.size if hasattr(c, "c_kv") else c.k.size + c.v.size
                     for c in model.new_caches())
        assert caches == kv_cache_elems(problem), f"{where}: KV cache {caches}, model {kv_cache_elems(problem)}"
    if not pc.HALF and case.cp == 1:    # the REPLICATED linear kind on this case's layout
        check_replicated(layout, pc.close)
    if case.ckpt:
        assert any(spec.shared is not None for spec in store.specs), "ckpt=1 is for a layout replicating kv heads"
        check_checkpoint(parts, opt, want["params"])


def check_checkpoint(parts, opt, params: dict) -> None:
    """A layout with replicated kv heads saves a checkpoint that holds every
    element once (the writer refuses a doubly written one) and that a
    serial reader sees as the serial model's tensors."""
    import shutil
    import tempfile

    from mpicube.files import checkpoint
    from mpicube.training.state import state_blocks

    world = MPI.COMM_WORLD
    root = world.bcast(tempfile.mkdtemp(prefix="kvrep") if world.rank == 0 else None, root=0)
    try:
        axes = parts.layout.axes
        checkpoint.save(root, 1, state_blocks(parts.store, opt.adam, axes.dp.rank + axes.cp.rank), {}, comm=world)
        if world.rank == 0:
            with checkpoint.open_checkpoint(checkpoint.latest(root)) as ck:
                for name, want in params.items():
                    pc.close(f"checkpoint {name}", ck.read(f"model/{name}"), want)
    finally:
        world.Barrier()
        if world.rank == 0:
            shutil.rmtree(root, ignore_errors=True)


def main(argv: list) -> None:
    cases, words = [], []
    for arg in argv + ["--"]:
        if arg == "--":
            if words:
                cases.append(Case.parse(words))
            words = []
        else:
            words.append(arg)
    refs = References()
    world = MPI.COMM_WORLD
    for case in cases:
        t0 = time.perf_counter()
        try:
            run_case(case, refs)
        except Exception as exc:
            raise AssertionError(f"case {case.words()}: {exc}") from exc
        worst = world.allreduce(pc.WORST[0], op=MPI.MAX)
        gc.collect()
        world.Barrier()
        if world.rank == 0:
            print(f"OK case {case.words()} worst={worst:.2e} (rtol {pc.RTOL:.1e}) "
                  f"{time.perf_counter() - t0:.1f}s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
