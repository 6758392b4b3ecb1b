"""A model on this rank, built for a layout: backend, communicators,
parameter store and GPT, with every size validated before the first
collective. Training, evaluation, generation, benchmarks and tests build
their models here."""

from __future__ import annotations

from dataclasses import dataclass

from . import threads
from .backend import make_backend
from .comm import Counters
from .config import ModelConfig
from .grid import build_layout, plan
from .model import GPT, gpt_params
from .params import ParamStore
from .zero import validate as validate_zero


@dataclass
class Parts:
    """A model on this rank: the layout, its parameter store and the GPT."""

    cfg: ModelConfig
    backend: object
    counters: object
    layout: object
    store: object
    model: object

    @property
    def rows(self) -> slice:
        """This data-parallel replica's rows of a global (B, T) batch."""
        b = self.layout.local_batch
        r = self.layout.axes.dp.rank
        return slice(r * b, (r + 1) * b)


def build_parts(cfg, layout_name, batch_size, mpi_world, dp=1, depth=1, dtype="float32", device="cpu",
                seed=0, dropout=0.0, tf32=False, zero=0) -> Parts:
    """Backend, layout, parameters, model. Every size is validated first
    (``plan`` is pure), before device selection makes its first collective;
    then every thread pool of the rank gets its share of the node's cores,
    on CPUs and GPUs alike, before the first GEMM."""
    plan(layout_name, cfg, batch_size, mpi_world.Get_size(), dp, depth)
    threads.configure(mpi_world)
    backend = make_backend(device, dtype, mpi_world, tf32=tf32)
    counters = Counters()
    layout = build_layout(layout_name, cfg, batch_size, backend, mpi_world, dp=dp, depth=depth,
                          counters=counters)
    store = ParamStore([layout.shard(d) for d in gpt_params(cfg)], backend, seed, dp=layout.axes.dp, zero=zero)
    model = GPT(cfg, layout, store, dropout=dropout, seed=seed)
    return Parts(cfg, backend, counters, layout, store, model)
