"""A model on this rank, built for a layout: backend, communicators,
parameter store and GPT, with every size validated before the first
collective. Training, evaluation, generation, benchmarks and tests build
their models here."""

from __future__ import annotations

from dataclasses import dataclass

from ..device import threads
from ..device.backend import make_backend
from ..parallel.comm import Counters
from ..core.config import ModelConfig
from ..parallel.grid import build_layout, plan
from ..model.gpt import GPT, gpt_params
from ..parallel.params import ParamStore
from ..parallel.zero import validate as validate_zero


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


def build_parts(cfg, layout_name, batch_size, mpi_world, dp=1, depth=1, dtype="float32", device="cpu",
                seed=0, dropout=0.0, tf32=False, grad_accum=1, recompute="none", zero=0) -> Parts:
    """Backend, layout, parameters, model. Every size is validated first
    (``plan`` is pure), before device selection makes its first collective;
    then every thread pool of the rank gets its share of the node's cores,
    on CPUs and GPUs alike, before the first GEMM. ``batch_size`` is the
    step's; with ``grad_accum`` N the layout and its buffers are sized for
    micro-batches of batch_size / N sequences. ``recompute`` is the
    layout's memory mode (layouts/base.py RECOMPUTE_MODES)."""
    plan(layout_name, cfg, batch_size, mpi_world.Get_size(), dp, depth, grad_accum, recompute)
    validate_zero(zero, dp)
    threads.configure(mpi_world)
    backend = make_backend(device, dtype, mpi_world, tf32=tf32)
    counters = Counters()
    layout = build_layout(layout_name, cfg, batch_size, backend, mpi_world, dp=dp, depth=depth,
                          counters=counters, grad_accum=grad_accum, recompute=recompute)
    store = ParamStore([layout.shard(d) for d in gpt_params(cfg)], backend, seed, dp=layout.axes.dp, zero=zero)
    model = GPT(cfg, layout, store, dropout=dropout, seed=seed, grad_accum=grad_accum)
    return Parts(cfg, backend, counters, layout, store, model, grad_accum)


def recompute_note(layout, recompute: str):
    """The one line to say when a recompute mode has nothing to do on this
    layout, else None."""
    if recompute == "gathers" and layout.name == "serial":
        return "note: --recompute gathers: nothing is gathered on the serial layout"
    return None
