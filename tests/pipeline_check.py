"""Run under mpiexec: pipeline stages (--pp) over a layout against the serial
model, in float64 with dropout (or in 16 bits against serial in the same
format, losses only after step 1, as tests/parallel_check.py explains).

Rank 0 also runs the serial model on MPI.COMM_SELF from the same seed and
batch (the whole batch at once, no accumulation) and sends its figures;
every rank compares the blocks of its own stage: loss, gradient norm, every parameter gradient after the
step's sums (the tied wte after the sum over stages 0 and P-1) and every
parameter after the AdamW steps with clipping. Measured point-to-point
traffic on every axis (point-to-point "pp" included) and the most saved
activations a stage holds equal the cost model's.

Usage: python -m mpi4py tests/pipeline_check.py CASE [-- CASE ...]
  CASE = LAYOUT DP DEPTH PP SCHEDULE V ACCUM [dropout=0.1] [batch=B] [steps=3] [dtype=float64]
         [recompute=none] [zero=0] [layers=4] [cp=1] [sp=0] [ckpt=DIR] [moe=CAPACITY] [ep=1] [bitwise=1]

bitwise=1 (a zero-bubble schedule on one chunk a stage): step 1's raw
gradients also equal, bitwise, those of the same grid under 1F1B.

moe=F: a mixture of 4 experts, top 2 (F the capacity factor, 0 dropless),
with --ep; its router losses count one micro-batch of every replica, so
the reference is the serial model accumulating those same groups (rows
permuted; dropout=0.0 needed, as the serial masks follow row positions).
Its costs are compared for the routing the stage's layers recorded
(tests/moe_costs.StageRuns: the ledgers' routes and each expert's runs,
per micro-batch), the traffic of the ledgers' world sum included;
deepseek=1 gives the mixture DeepSeekMoE's options (parallel_check.DEEPSEEK:
the sigmoid router with its bias and sequence-wise loss, groups, a shared
expert), priced the same way.

zero, recompute and dtype as MPICUBE_CHECK_ZERO, MPICUBE_CHECK_RECOMPUTE
and MPICUBE_CHECK_DTYPE in tests/parallel_check.py. ckpt=DIR then moves
the trained state through checkpoints: saved from this grid,
loaded and saved again on the serial layout (rank 0 alone), then on pp 4 x
1d (tp 2, the first 8 ranks), then loaded back here: every parameter and
AdamW moment bitwise equal to what this grid held, and the three
checkpoints' tensors bitwise equal too.
"""

import dataclasses
import json
import sys

import numpy as np
from mpi4py import MPI

from mpicube.core.config import ModelConfig
from mpicube.device.backend import make_backend
from mpicube.device.precision import dtype_of, is_half
from mpicube.parallel.comm import Counters
from mpicube.parallel.grid import build_layout
from mpicube.parallel.planning import resolve
from mpicube.parallel.gridspec import GridSpec
from mpicube.parallel.fsdp import make_store
from mpicube.model.routers import balance
from mpicube.training.accum import forward_backward
from mpicube.training.parts import Parts
from mpicube.training.pipeline import Pipeline, stage_specs
from mpicube.training.step import make_step

import parallel_check as pc
from moe_costs import StageRuns

DTYPE = pc.DTYPE
HALF = is_half(dtype_of(DTYPE))


def build_pipeline(grid, cfg, batch, dropout):
    backend = make_backend("cpu", DTYPE)
    counters = Counters()
    layout = build_layout(resolve(grid, cfg, batch, MPI.COMM_WORLD.Get_size()), backend, MPI.COMM_WORLD,
                          counters=counters)
    store = make_store(stage_specs(layout, cfg, grid.virtual_stages, grid.pp_schedule), backend, 7, dp=layout.axes.dp,
                       zero=grid.zero, stages=grid.pp, edp=layout.axes.edp)
    pipe = Pipeline(cfg, layout, store, schedule=grid.pp_schedule, virtual=grid.virtual_stages, dropout=dropout,
                    seed=7, grad_accum=grid.grad_accum)
    return Parts(cfg, backend, counters, layout, store, pipe, grid.grad_accum, pipeline=pipe)


def check_costs(parts, cfg, batch, grid, adam, dropout: bool, routing=None):
    """Measured elements/bytes/messages on every axis (point-to-point "pp"
    included), the peak saved activations of this stage (``dropout``:
    with its masks), and the weights,
    gradients and AdamW moments it holds (every buffer, the slots of --zero
    2/3 included) == the cost model (parallel_check's checks, on the
    problem of this stage); a mixture's ``routing`` is the stage's
    measured rows (``StageRuns.take``)."""
    from mpicube.analysis.costmemory import step_memory, step_memory_bytes

    problem = dataclasses.replace(pc.problem_of(cfg, parts.layout, grid, batch, DTYPE), routing=routing)
    where = f"rank {MPI.COMM_WORLD.rank} (stage {problem.stage})"
    pc.check_traffic(problem, parts.counters, where)
    pc.check_pipeline_memory(problem, parts.pipeline, where, dropout)
    store = parts.store
    if store.streams_gradients:
        params, grads = store.param_buffers(), store.grad_buffers()
        counted = (sum(b.size for b in params), sum(b.size for b in grads))
    else:
        params, grads = [b for b in store.buffers() if b is not store.flat_grad], [store.flat_grad]
        counted = (store.flat_work.size, store.flat_grad.size)
    got = counted + (adam.m.size + adam.v.size, sum(b.nbytes for b in params), sum(b.nbytes for b in grads),
                     adam.m.nbytes + adam.v.nbytes)
    want, want_bytes = step_memory(problem, dropout), step_memory_bytes(problem, dropout)
    model = (want.params, want.grads, want.optimizer, want_bytes.params, want_bytes.grads, want_bytes.optimizer)
    if got != model:
        raise AssertionError(f"{where}: measured (params, grads, optimizer, then their bytes) {got}, "
                             f"model predicts {model}")


def same_as_unsplit(twin, parts, x, y) -> None:
    """bitwise=1: the zero-bubble step's raw gradients (before any sum over
    ranks) are bitwise those of 1F1B on the same grid, whose backward is
    whole: splitting B from W moves no addition (parallel/wgrad.py)."""
    twin.store.zero_grad()
    forward_backward(twin, x, y, 1, pc.LOSS_SCALE)
    host = parts.layout.backend.to_host
    for spec in parts.store.specs:
        got, want = host(parts.store.grad[spec.name]), host(twin.store.grad[spec.name])
        if not np.array_equal(got, want):
            raise AssertionError(f"rank {MPI.COMM_WORLD.rank}: {spec.name}'s gradient differs from 1F1B's "
                                 f"(worst {np.abs(got - want).max():.2e})")
    if MPI.COMM_WORLD.rank == 0:
        print("bitwise equal to 1F1B's gradients", flush=True)


def save(parts, opt, path, comm):
    from mpicube.files import checkpoint
    from mpicube.training.state import state_blocks

    attrs = {"config": json.dumps(parts.cfg.to_dict()), "layout": json.dumps(parts.layout.describe())}
    blocks = state_blocks(parts.store, opt.adam, parts.layout.axes.dp.rank)
    return checkpoint.save(path, 1, blocks, attrs, comm=comm)


def load(parts, opt, path, comm):
    from mpicube.files import formats
    from mpicube.training.state import load_state

    with formats.open_everywhere(comm, path) as model_file:
        load_state(model_file.ck, parts.store, opt.adam, comm=comm)


def state_of(parts, opt) -> list:
    m, v = opt.adam.full_moments()
    return [parts.layout.backend.to_host(b).copy() for b in (parts.store.full_master(), m, v)]


def roundtrip(parts, opt, root, batch):
    """pp x layout -> serial -> pp 4 x 1d -> back (module docstring)."""
    from mpicube.training.parts import Numerics, build_parts

    world = MPI.COMM_WORLD
    before = state_of(parts, opt)
    save(parts, opt, f"{root}/a", world)
    paths = [f"{root}/a"]
    for ranks, grid in ((1, GridSpec("serial")), (8, GridSpec("1d", pp=4))):
        sub = world.Split(color=0 if world.rank < ranks else MPI.UNDEFINED, key=world.rank)
        if sub != MPI.COMM_NULL:
            other = build_parts(resolve(grid, parts.cfg, batch, ranks), sub, Numerics(DTYPE), seed=99)
            other_opt = make_step(other.store, other.layout.axes, weight_decay=0.1)
            load(other, other_opt, paths[-1], sub)
            save(other, other_opt, f"{root}/{grid.layout}", sub)
            sub.Free()
        paths.append(f"{root}/{grid.layout}")
        world.Barrier()
    parts.store.initialize(99)
    load(parts, opt, paths[-1], world)
    for name, got, want in zip(("parameters", "moment m", "moment v"), state_of(parts, opt), before):
        if not np.array_equal(got, want):
            raise AssertionError(f"rank {world.rank}: {name} differ after the round trip through checkpoints")
    if world.rank == 0:
        import h5py
        files = [h5py.File(f"{root}/{d}/ckpt/step_00000001/checkpoint.h5", "r") for d in ("a", "serial", "1d")]
        names = [f"{g}/{n}" for g in ("model", "optimizer/m", "optimizer/v") for n in files[0][g].keys()]
        assert "model/wte" in names and len(names) == 3 * (4 + 12 * parts.cfg.n_layer), names
        for f in files[1:]:
            for n in names:
                if not np.array_equal(f[n][...], files[0][n][...]):
                    raise AssertionError(f"{n} differs between the checkpoints of the round trip")
        print(f"checkpoint round trip OK: {len(names)} tensors", flush=True)


class SerialReference:
    """The serial model of the same seed, batch and dropout, on rank 0 only
    (the others receive its figures: one serial model per job, not per rank)."""

    def __init__(self, cfg, batch, dropout, groups=None):
        accum = 1 if groups is None else groups[1]
        self.parts = pc.build("serial", MPI.COMM_SELF, cfg, batch, 1, 1, dropout, grad_accum=accum)
        self.opt = make_step(self.parts.store, self.parts.layout.axes, weight_decay=0.1)
        self.perm = None
        if groups is not None:                  # a mixture: micro-batch m = every replica's micro-batch m
            dp, accum = groups
            b = batch // (dp * accum)
            self.perm = np.concatenate([np.arange((r * accum + m) * b, (r * accum + m + 1) * b)
                                        for m in range(accum) for r in range(dp)])

    def step(self, x, y, step: int, grads: bool) -> tuple:
        """(loss, gradient norm, {name: summed gradient} or None, {name: router bias after
        the step's update}) of one step, then its update (the bias's too)."""
        store, model = self.parts.store, self.parts.model
        store.zero_grad()
        if self.perm is not None:
            loss = forward_backward(self.parts, x[self.perm], y[self.perm], step, pc.LOSS_SCALE)
        else:
            loss = model.forward(x, y, step=step)
            model.backward(loss_scale=pc.LOSS_SCALE)
        self.opt.sync()
        norm = self.opt.grad_norm() / pc.LOSS_SCALE
        out = (loss, norm, {n: g.copy() for n, g in store.grad.items()} if grads else None)
        self.opt.step(1e-2, grad_scale=min(1.0, 1.0 / norm) / pc.LOSS_SCALE)
        log = model.router_log
        log.take()
        balance(store, self.parts.cfg, log.loads)
        return out + ({n: b.copy() for n, b in store.persistent.items()},)


def configure(options: dict) -> None:
    """One case's settings, into this module's and parallel_check's globals
    (the functions shared with parallel_check read them)."""
    global DTYPE, HALF
    DTYPE = pc.DTYPE = options.get("dtype", "float64")
    HALF = pc.HALF = is_half(dtype_of(DTYPE))
    pc.RECOMPUTE, pc.ZERO = options.get("recompute", "none"), int(options.get("zero", 0))
    pc.LOSS_SCALE = 1024.0 if DTYPE == "float16" else 1.0
    pc.WORST[0], pc.RTOL = 0.0, 1e-10


def main():
    """Cases separated by "--", each LAYOUT DP DEPTH PP SCHEDULE V ACCUM and
    any of dropout=, batch=, dtype=, recompute=, zero=, ckpt=DIR: one
    launch runs several on the same ranks (MPI start-up paid once)."""
    cases, case = [], []
    for arg in sys.argv[1:] + ["--"]:
        if arg == "--":
            if case:
                cases.append(case)
            case = []
        else:
            case.append(arg)
    for case in cases:
        words = [a for a in case if "=" not in a]
        options = dict(a.split("=", 1) for a in case if "=" in a)
        configure(options)
        run_case(words, options)


def run_case(words: list, options: dict):
    layout_name, dp, depth, pp = words[0], int(words[1]), int(words[2]), int(words[3])
    schedule, virtual, accum = words[4], int(words[5]), int(words[6])
    cp, sp = int(options.get("cp", 1)), options.get("sp", "0") == "1"
    moe = "moe" in options
    deepseek = options.get("deepseek") == "1"      # the mixture with DeepSeekMoE's options (parallel_check.DEEPSEEK)
    grid = GridSpec(layout_name, dp=dp, pp=pp, cp=cp, depth=depth, pp_schedule=schedule, virtual_stages=virtual,
                    grad_accum=accum, recompute=pc.RECOMPUTE, zero=pc.ZERO, sequence_parallel=sp,
                    ep=int(options.get("ep", 1)))
    dropout = float(options.get("dropout", 0.1))
    batch = int(options.get("batch", 8 * dp * accum))
    cfg = ModelConfig(vocab_size=61, n_ctx=8, n_layer=int(options.get("layers", 4)), n_head=4, n_embd=16)
    if moe:
        cfg = ModelConfig(vocab_size=61, n_ctx=8, n_layer=cfg.n_layer, n_head=4, n_embd=16, arch="llama",
                          n_kv_head=2, ffn_hidden=12, n_experts=4, top_k=2, router_aux_loss_coef=0.05,
                          router_z_loss_coef=0.01, capacity_factor=float(options["moe"]))
        assert dropout == 0.0, "moe=: dropout=0.0 (the grouped serial reference's masks follow row positions)"
        if deepseek:
            cfg = dataclasses.replace(cfg, **pc.DEEPSEEK)
    T = cfg.n_ctx
    rng = np.random.default_rng(3)
    steps = [(rng.integers(0, 61, (batch, T)), rng.integers(0, 61, (batch, T)))
             for _ in range(int(options.get("steps", 3)))]

    parts = build_pipeline(grid, cfg, batch, dropout)
    layout, store, counters = parts.layout, parts.store, parts.counters
    if HALF:
        pc.RTOL = pc.wire_tolerance(layout, store, DTYPE)            # the stage sum included
    world = MPI.COMM_WORLD
    serial = SerialReference(cfg, batch, dropout, (dp, accum) if moe else None) if world.rank == 0 else None
    opt = make_step(store, layout.axes, weight_decay=0.1)
    host = layout.backend.to_host
    if deepseek:
        pc.random_biases(store)
        if serial is not None:
            pc.random_biases(serial.parts.store)
    runs = StageRuns(parts.pipeline) if moe else None
    twin = None                     # bitwise=1: the same grid under 1F1B (the backward unsplit), step 1 compared
    if options.get("bitwise") == "1":
        twin = build_pipeline(dataclasses.replace(grid, pp_schedule="1f1b"), cfg, batch, dropout)
    for step, (x, y) in enumerate(steps, start=1):
        ref = serial.step(x, y, step, grads=step == 1 or not HALF) if serial is not None else None
        store.zero_grad()
        counters.reset()
        loss = forward_backward(parts, x, y, step, pc.LOSS_SCALE,
                                after_forward=runs.after_forward if runs is not None else lambda m: None)
        if twin is not None and step == 1:
            same_as_unsplit(twin, parts, x, y)
        opt.sync()
        norm = opt.grad_norm() / pc.LOSS_SCALE
        s_loss, s_norm, s_grads, s_biases = world.bcast(ref, root=0)       # rank 0's serial step
        pc.close(f"step {step} loss", [loss], [s_loss])
        pc.close(f"step {step} grad norm", [norm], [s_norm])
        if s_grads is not None:
            pc.check_gradients(store, host, s_grads, f"step {step}")
        opt.step(1e-2, grad_scale=min(1.0, 1.0 / norm) / pc.LOSS_SCALE)
        routing = runs.take(parts.pipeline.router_log.ledgers) if moe else None
        if deepseek:                          # the bias update from the world's loads, equal to serial's bitwise
            parts.pipeline.router_log.take()
            balance(store, cfg, parts.pipeline.router_log.loads)
            assert store.persistent and set(store.persistent) <= set(s_biases)
            for name, bias in store.persistent.items():
                assert np.array_equal(host(bias), s_biases[name]), f"step {step} {name}"
        parts.pipeline.router_log.take_ledgers()
        check_costs(parts, cfg, batch, grid, opt.adam, dropout > 0, routing)   # the step's all-gather too
    s_params = world.bcast({n: a.copy() for n, a in serial.parts.store.data.items()} if serial is not None else None)
    if not HALF:
        pc.check_params(store, host, s_params, f"after {len(steps)} steps")
    if "ckpt" in options:
        roundtrip(parts, opt, options["ckpt"], batch)
    MPI.COMM_WORLD.Barrier()
    moe_note = f" moe={options['moe']} ep={grid.ep}" + (" deepseek" if deepseek else "") if moe else ""
    if MPI.COMM_WORLD.rank == 0:
        print(f"OK pp {layout_name} world={MPI.COMM_WORLD.size} dp={dp} depth={depth} pp={pp} "
              f"schedule={schedule} V={virtual} accum={accum} dtype={DTYPE} recompute={pc.RECOMPUTE} "
              f"zero={pc.ZERO} cp={cp} sp={int(sp)}{moe_note} loss={s_loss:.12f} worst={pc.WORST[0]:.2e} (rtol {pc.RTOL:.1e})", flush=True)


if __name__ == "__main__":
    main()
