"""A model on this rank, built for a resolved plan (every size validated
before the first collective, by ``parallel.planning.resolve``): backend,
communicators, parameter store and GPT. Training, evaluation, generation, benchmarks and tests build
their models here."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..device import precision, threads
from ..device.backend import Backend, make_backend
from ..core import memory
from ..parallel.comm import Counters
from ..parallel.comm_agree import agree_max
from ..core.config import ModelConfig
from ..parallel.grid import build_layout
from ..parallel.planning import Resolved
from ..model.gpt import gpt_params
from ..parallel.experts import model_specs
from .driver import Runner, build_gpt
from ..parallel.fsdp import make_store
from .pipeline import Pipeline, stage_specs


@dataclass
class Parts:
    """A model on this rank: the layout, its parameter store and the GPT."""

    cfg: ModelConfig
    backend: object
    counters: object
    layout: object
    store: object
    model: object
    grad_accum: int = 1     # micro-batches per step; the layout is built for one of them
    pipeline: object = None  # training.pipeline.Pipeline under --pp > 1 (then ``model`` is it too)

    @property
    def batch_size(self) -> int:
        """Global sequences per step (all micro-batches)."""
        return self.layout.batch_size * self.grad_accum

    @property
    def rows(self) -> slice:
        """This data-parallel replica's rows of a global (B, T) batch."""
        b = self.layout.local_batch * self.grad_accum
        r = self.layout.axes.dp.rank
        return slice(r * b, (r + 1) * b)

    def micro_rows(self, m: int) -> slice:
        """This replica's rows of micro-batch ``m`` in the global (B, T)
        batch: the m-th run of B/(dp N) rows inside ``rows``."""
        b = self.layout.local_batch
        first = self.rows.start + m * b
        return slice(first, first + b)


@dataclass(frozen=True)
class Numerics:
    """Where and in which format a model computes: the backend's choices
    (``device.backend.make_backend``), apart from the plan's, which say how
    the work is split."""

    dtype: str = "float32"
    device: str = "cpu"
    tf32: bool = False        # GPU float32 GEMMs on tensor cores


def build_parts(run: Resolved, mpi_world, numerics: Numerics = Numerics(), seed: int = 0,
                dropout: float = 0.0, *, recorder=None) -> Parts:
    """Backend, layout, parameters, model, for the resolved plan ``run``
    (``parallel.planning.resolve``: every size is validated there, purely,
    before device selection makes its first collective; nothing is checked
    again here). Every thread pool of the rank gets its share of the
    node's cores, on CPUs and GPUs alike, before the first GEMM. With
    ``run.plan.grad_accum`` N the layout and its buffers are sized for
    micro-batches of batch_size / N sequences. A model that cannot fit in
    this rank's memory is refused before anything is allocated
    (``require_room``; ``run.seq_len``, the sequences the model will run,
    adds their attention scores to the bound). With pp > 1 the rank holds
    its stage's parameters only and ``model`` is the ``Pipeline`` of the
    plan's schedule over its virtual stages per stage. ``recorder`` (a
    ``parallel.profiler.Recorder``, under ``--profile``) is handed to the
    communicators as they are built; None (the default): nothing records."""
    cfg, grid, accum = run.cfg, run.plan, run.plan.grad_accum
    threads.configure(mpi_world)
    backend = make_backend(numerics.device, numerics.dtype, mpi_world, tf32=numerics.tf32)
    require_run_room(run, backend, mpi_world)
    counters = Counters()
    layout = build_layout(run, backend, mpi_world, counters=counters, recorder=recorder)
    if grid.pp > 1:
        virtual = grid.virtual_stages
        store = make_store(stage_specs(layout, cfg, virtual, grid.pp_schedule), backend, seed, dp=shard_group(layout),
                           zero=grid.zero, stages=grid.pp, edp=layout.axes.edp)
        pipe = Pipeline(cfg, layout, store, schedule=grid.pp_schedule, virtual=virtual, dropout=dropout,
                        seed=seed, grad_accum=accum)
        return Parts(cfg, backend, counters, layout, store, pipe, accum, pipeline=pipe)
    store = make_store(model_specs(layout, gpt_params(cfg)), backend, seed, dp=shard_group(layout), zero=grid.zero,
                       edp=layout.axes.edp)
    model = Runner(build_gpt(cfg, layout, store, dropout=dropout, seed=seed, grad_accum=accum), layout, accum)
    return Parts(cfg, backend, counters, layout, store, model, accum)


def room_needed(cfg: ModelConfig, backend, tp: int, micro_batch: int, seq_len=None) -> int:
    """A lower bound of the bytes a rank allocates for this model: its
    share of the parameters (at least 1/tp of them) in the weights the
    model computes with and in the gradients, and, given ``seq_len``, what
    one layer keeps for backward of its ``micro_batch`` sequences at the
    least (q, k, v, the scaled q, the GELU input and tanh: 12 h per token,
    every layout splits them over its tp ranks; blockwise attention keeps
    no scores). Python ints: a size of 2**31 layers is a number, not an
    overflow."""
    share = -(-cfg.n_params() // tp)
    need = share * (backend.master_dtype.itemsize + backend.dtype.itemsize)
    if seq_len:
        need += micro_batch * seq_len * 12 * cfg.n_embd // tp * backend.dtype.itemsize
    return need


def require_room(cfg: ModelConfig, backend, mpi_world, layout: str, tp: int, micro_batch: int, seq_len=None):
    """ConfigError on every rank (one line) when ``room_needed`` exceeds
    the smallest room of any rank: host memory (``core.memory``), or the
    free memory of the rank's GPU. Every rank reaches this, so they agree
    with one small allreduce before the first large allocation."""
    need = room_needed(cfg, backend, tp, micro_batch, seq_len)
    if backend.is_gpu:
        free = int(backend.xp.cuda.Device().mem_info[0])
        room, why = free, f"its GPU has {memory.format_bytes(free)} free"
    else:
        room, why = memory.available()
    if mpi_world.Get_size() > 1:
        least = -agree_max(mpi_world, -room)
        if least < room:
            room, why = least, f"a rank of this job has only {memory.format_bytes(least)}"
    count = memory.format_count
    memory.require(need, f"the model (n_layer {count(cfg.n_layer)}, n_embd {count(cfg.n_embd)}, n_ctx "
                         f"{count(cfg.n_ctx)}, vocab {count(cfg.vocab_size)}: {count(cfg.n_params())} parameters) "
                         f"on layout {layout} (tp {tp})", room=(room, why),
                   purpose=" per rank for its weights and gradients" + (" and one layer's activations"
                                                                        if seq_len else ""))


def require_run_room(run: Resolved, backend, mpi_world) -> None:
    """``require_room`` for the resolved plan ``run``: each rank's
    micro-batch, and T/cp positions of each sequence on a cp rank."""
    grid = run.plan
    require_room(run.cfg, backend, mpi_world, run.layout, run.tp, run.batch_size // (grid.dp * grid.grad_accum),
                 run.seq_len and run.seq_len // grid.cp)


def require_host_room(run: Resolved, numerics: Numerics, mpi_world) -> None:
    """The host-memory check of ``build_parts`` made early, before the
    run directory exists, so that a model too large for the machine leaves
    nothing behind. Pure arithmetic and one small allreduce: no backend is
    selected. GPU runs are checked once their device is chosen."""
    if numerics.device == "cpu":
        require_run_room(run, Backend(np, precision.dtype_of(numerics.dtype), "cpu"), mpi_world)


def recompute_note(layout, recompute: str):
    """The one line to say when a recompute mode has nothing to do on this
    layout, else None."""
    if recompute == "gathers" and layout.name == "serial":
        return "note: --recompute gathers: nothing is gathered on the serial layout"
    return None


def shard_group(layout):
    """The replicas ZeRO shards over: all of dp, or under --hsdp the
    rank's shard group (the replica groups' all-reduce is GradientSync's)."""
    axes = layout.axes
    return axes.dp_shard if axes.dp_shard is not None else axes.dp
