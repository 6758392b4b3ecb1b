"""Validation loss: of the model a run is training, and of any model file
(``mpicube eval``) on any layout and world size."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from ..files import data, formats
from . import dataplan
from ..parallel.comm import on_root
from .accum import forward_loss
from ..core.errors import ConfigError
from ..parallel.gridspec import Plan
from ..parallel.layouts.base import nearest_multiples
from ..parallel.planning import resolve
from .parts import Numerics, Parts, build_parts
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


def evaluate_checkpoint(ckpt_path, plan="auto", numerics: Numerics = Numerics(), mpi_world=None,
                        want: "EvalData" = None) -> dict:
    """Mean cross-entropy of a checkpoint's model (any model file) over
    evaluation batches of a token shard, on any plan and world size
    (``plan``: a Plan or a layout name; its ``grad_accum`` micro-batches
    per batch, which a pipeline runs through its stages). ``want``: the
    shard, batch size, sequence length and batch count (``EvalData``)."""
    want = want if want is not None else EvalData()
    if mpi_world is None:
        from mpi4py import MPI

        mpi_world = MPI.COMM_WORLD
    plan = Plan.of(plan)
    with formats.open_everywhere(mpi_world, ckpt_path) as ck:     # any model file
        cfg = ck.config
        saved = saved_state(ck)                                   # the checkpoint's records, checked
        T = int(want.seq_len or cfg.n_ctx)
        if not 1 <= T <= cfg.n_ctx:
            raise ConfigError(f"--seq-len {T} must be between 1 and the model's context {cfg.n_ctx}")
        if plan.sequence_parallel and T % plan.tp(mpi_world.Get_size()):   # --sequence-parallel: T/tp positions
            tp = plan.tp(mpi_world.Get_size())
            raise ConfigError(f"--sequence-parallel: --seq-len {T} must be divisible by the tensor-parallel "
                              f"size {tp}: use --seq-len {nearest_multiples(T, tp)}")
        if want.batches < 0:
            raise ConfigError(f"--batches must be 0 (all) or more, got {want.batches}")
        run = resolve(plan, cfg, want.batch_size, mpi_world.Get_size(), seq_len=T, saved=saved.batch_size)
        B, batch_note = run.batch_size, run.batch_note
        if batch_note and saved.batch_size:
            batch_note = f"{batch_note}; the checkpoint's batch {saved.batch_size} does not fit"
        data_path, tokens, n, note = dataplan.plan_eval_data(mpi_world, want.data_path, saved.data, B, T,
                                                             want.batches)
        on_root(mpi_world, lambda: data.check_vocab(tokens, cfg.vocab_size, data_path))
        parts = build_parts(run, mpi_world, numerics)
        formats.load_params(ck, parts.store)
        step = ck.step
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        loss = mean_eval_loss(parts, eval_model(parts), tokens, T, n)
    return {"loss": loss, "step": step, "batches": n, "tokens": n * B * T, "batch_size": B, "seq_len": T,
            "layout": parts.layout.describe(), "checkpoint": str(ck.path), "data": data_path,
            **({"note": note} if note else {}), **({"batch_note": batch_note} if batch_note else {})}


@dataclass(frozen=True)
class EvalData:
    """What ``evaluate_checkpoint`` reads: the shard (None: the one the
    checkpoint was trained on), the batch (None: the checkpoint's if the
    plan takes it, else the smallest of at least 8 it accepts), the
    sequence length (None: the model's context) and the batches (0: all)."""

    data_path: Optional[str] = None
    batch_size: Optional[int] = None
    seq_len: Optional[int] = None
    batches: int = 8
