"""Validation loss: of the model a run is training, and of any model file
(``mpicube eval``) on any layout and world size."""

from __future__ import annotations

import numpy as np

from ..files import data, formats
from . import dataplan
from ..parallel.comm import on_root
from .accum import forward_loss
from ..core.errors import ConfigError
from ..parallel import context
from ..parallel.grid import saved_or_default_batch
from ..parallel.layouts.base import nearest_multiples
from ..parallel.gridspec import GridSpec
from .parts import Parts, build_parts
from .state import saved_state


def eval_model(parts: Parts):
    """The same model run with dropout off. Under pipeline stages the
    Pipeline, whose forward-only pass runs chunks without dropout."""
    if parts.pipeline is not None:
        return parts.pipeline
    return parts.model.evaluation()


def mean_eval_loss(parts: Parts, model, tokens, seq_len: int, n_batches: int) -> float:
    """Mean cross-entropy over evaluation batches 0..n_batches-1 (forward
    only, in the run's micro-batches); every batch has B x T positions, so
    this is the mean over all."""
    B = parts.batch_size
    total = 0.0
    for k in range(n_batches):
        x, y = data.eval_batch(tokens, B, seq_len, k)               # (B, T) each
        total += forward_loss(parts, model, x, y)
    return total / n_batches


def evaluate_checkpoint(ckpt_path, data_path=None, batch_size=None, seq_len=None, batches=8, grid="auto",
                        dtype="float32", device="cpu", mpi_world=None, tf32=False, grad_accum=1) -> dict:
    """Mean cross-entropy of a checkpoint's model over ``batches`` evaluation
    batches (0 = all) of a token shard, on any layout and world size
    (``grid``: a GridSpec or a layout name; ``grad_accum`` micro-batches
    per batch, which a pipeline runs through its stages)."""
    if mpi_world is None:
        from mpi4py import MPI

        mpi_world = MPI.COMM_WORLD
    with formats.open_everywhere(mpi_world, ckpt_path) as ck:     # any model file
        cfg = ck.config
        saved = saved_state(ck)                                   # the checkpoint's records, checked
        B, batch_note = eval_batch_size(batch_size, saved.batch_size, grid, cfg, mpi_world.Get_size(),
                                        grad_accum)
        T = int(seq_len or cfg.n_ctx)
        if not 1 <= T <= cfg.n_ctx:
            raise ConfigError(f"--seq-len {T} must be between 1 and the model's context {cfg.n_ctx}")
        context.validate(T, GridSpec.of(grid).cp)                  # --cp: 2C chunks of every sequence
        spec = GridSpec.of(grid)
        if spec.sequence_parallel and T % spec.tp(mpi_world.Get_size()):   # --sequence-parallel: T/tp positions
            tp = spec.tp(mpi_world.Get_size())
            raise ConfigError(f"--sequence-parallel: --seq-len {T} must be divisible by the tensor-parallel "
                              f"size {tp}: use --seq-len {nearest_multiples(T, tp)}")
        if batches < 0:
            raise ConfigError(f"--batches must be 0 (all) or more, got {batches}")
        data_path, tokens, n, note = dataplan.plan_eval_data(mpi_world, data_path, saved.data, B, T, batches)
        on_root(mpi_world, lambda: data.check_vocab(tokens, cfg.vocab_size, data_path))
        parts = build_parts(cfg, grid, B, mpi_world, dtype=dtype, device=device, tf32=tf32, seq_len=T,
                            grad_accum=grad_accum)
        formats.load_params(ck, parts.store)
        step = ck.step
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        loss = mean_eval_loss(parts, eval_model(parts), tokens, T, n)
    return {"loss": loss, "step": step, "batches": n, "tokens": n * B * T, "batch_size": B, "seq_len": T,
            "layout": parts.layout.describe(), "checkpoint": str(ck.path), "data": data_path,
            **({"note": note} if note else {}), **({"batch_note": batch_note} if batch_note else {})}


def eval_batch_size(given, saved, grid, cfg, world_size, grad_accum=1) -> tuple:
    """(batch size, words announcing it or None): the one given; else the
    checkpoint's training batch if this layout accepts it; else the
    smallest of at least 8 that it accepts (grid.default_batch)."""
    if given is not None:
        return int(given), None
    batch, kept, why = saved_or_default_batch(saved, grid, cfg, world_size, grad_accum)
    if kept or not saved:
        return batch, None if kept else why
    return batch, f"{why}; the checkpoint's batch {saved} does not fit"
