"""The training loop: data, model, optimizer, checkpoints, logging, signals.

One step, on every rank (s is 1-based)::

    x, y = loader.batch(s - 1)                # (B, T) global batch, same on every rank
    loss = forward_backward(parts, x, y, s)   # this replica's rows, in --grad-accum micro-batches
    opt.sync(); norm = opt.grad_norm()       # opt: step.make_step (--zero 1: step.ShardedStep)
    opt.step(schedule(s), clip_scale(norm))

How the run starts (options, data plan, run directory, the model built,
restored or loaded) is ``launch.Launch``, which ``Trainer`` extends. This
step is the only training step in mpicube: ``mpicube trace`` observes it
through ``hooks.StepHooks`` instead of running a copy of its own.

Everything a run needs to continue is (parameters, AdamW moments and t, the
step): the loader is random access by step and dropout masks are a function
of the step, so a resumed run repeats the uninterrupted one bit for bit on the
same layout, and follows it up to rounding on any other.

Stopping early (mpicube.training.stopping) is agreed by all ranks at step boundaries with one tiny
uncounted all-reduce: SIGTERM/SIGUSR1 on any rank or ``--time-limit``
(checkpoint, exit status 75 = EX_TEMPFAIL, "requeue me"), ``--stop-after``
(checkpoint, exit status 0). A non-finite loss or gradient norm stops the run
without saving the bad state (exit status 3). Rank 0 failing to append to
metrics.jsonl (a full disk) is agreed the same way: every rank tries to save
the step, then the job ends with one line and exit status 74, as it does when
a save itself fails (``RunDirError``); the step whose record failed has none.
The step boundary, an
evaluation and a checkpoint save are noted for the watchdog
(``mpicube.parallel.watchdog``, ``--collective-timeout``, exit status 76),
which the command line runs around the trainer.

Files in the run directory (rank 0 writes all but the checkpoint shards)::

    config.json      model, options, layout, world size, version
    metrics.jsonl    one object per step, and one per evaluation
    ckpt/            checkpoints (mpicube.files.checkpoint)
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Optional

import numpy as np

from .. import __version__
from ..core.console import Console
from ..core.errors import RunDirError, UserError
from ..files import checkpoint
from ..parallel.comm_agree import agree_max
from ..parallel.waiting import WAITS
from ..model.routers import balance
from .accum import forward_backward
from .evaluate import eval_model, evaluate_checkpoint, mean_eval_loss  # noqa: F401 (evaluate_checkpoint: API)
from .launch import Launch
from .options import TrainOptions  # noqa: F401 (TrainOptions re-exported: tests and tools import it here)
from .parts import build_parts  # noqa: F401 (re-exported for tools and tests)
from .stopping import IO_FAILURE, SIGNAL, EarlyStop
from .state import describe_layout, state_blocks

EXIT_PREEMPTED = 75      # EX_TEMPFAIL: stopped by a signal or --time-limit, resume me
EXIT_DIVERGED = 3        # non-finite loss or gradient norm

class DivergedError(UserError):
    """The loss or gradient norm stopped being finite."""

    exit_code = EXIT_DIVERGED


# --------------------------------------------------------------------------- the trainer


class Trainer(Launch):
    """Set up once (``Launch.setup``), then ``run()``; returns the process
    exit status. ``hooks`` observe every step (``hooks.StepHooks``); a run
    with ``keep_files=False`` has no run directory: no lock, config,
    metrics or checkpoints (what ``mpicube trace`` runs). ``recorder`` (a
    ``parallel.profiler.Recorder``, ``--profile``'s) is handed to the
    communicators when they are built; None: they record nothing."""

    def __init__(self, opts: TrainOptions, mpi_world=None, hooks=(), keep_files: bool = True, recorder=None):
        if mpi_world is None:
            from mpi4py import MPI

            mpi_world = MPI.COMM_WORLD
        self.opts = opts
        self.hooks = list(hooks)
        self.keep_files = keep_files
        self.recorder = recorder
        self.run_dir = None
        self.world = mpi_world
        self.rank = mpi_world.Get_rank()
        self.stop = EarlyStop(mpi_world, opts.time_limit)   # signals and --time-limit, agreed by all ranks
        self.last_ckpt = None           # path of the last checkpoint of this run
        self.console = Console(False, 1, 0, 1)
        self.metrics = None
        self.lock = None                # rank 0: the run directory's lock
        self.owner = None               # this job's name in temporary checkpoint directories
        self.notes = []                 # said once the console is up

    def _record(self, rec: dict) -> None:
        """Rank 0: append ``rec`` to metrics.jsonl. A failure (a full disk)
        is kept for the step's end, where every rank learns of it
        (``EarlyStop.agree``) and the run checkpoints and stops; no further
        record is written."""
        if self.metrics is not None and self.stop.io_failure is None:
            try:
                self.metrics.write(rec)
            except RunDirError as exc:
                self.stop.io_failure = str(exc)

    # --- the loop ------------------------------------------------------------
    def run(self) -> int:
        with self.stop.signal_handlers():
            try:
                self.setup()
                return self._loop()
            finally:
                self.console.close()
                if self.metrics is not None:
                    self.metrics.close()
                if self.lock is not None:
                    self.lock.release()

    def _loop(self) -> int:
        o, first, last = self.opts, self.start_step, self.opts.last_step
        self.console = Console(self.rank == 0, first, last, o.log_every)
        say = self.console.say
        layout = self.parts.layout
        chosen = " (chosen by --layout auto)" if o.layout == "auto" else ""
        batch = self.batch_note or f"batch {o.batch_size}"
        if o.grad_accum > 1:
            batch += f" in {o.grad_accum} micro-batches of {o.batch_size // o.grad_accum}"
        say(f"mpicube {__version__}: {self.cfg.n_params():,} parameters, {describe_layout(layout.describe())}"
            f"{chosen}, {batch}, {self.world.Get_size()} rank(s), run {self.run_dir}")
        for note in self.notes:
            say(note)
        if first > last:
            say(f"nothing to do: the run is at step {first - 1}, "
                f"{'--stop-after' if last < o.steps else '--steps'} is {last}")
            return 0
        self._notify("run_started")
        for s in range(first, last + 1):
            t0 = time.monotonic()
            WAITS.at_step(s)                    # progress, for the watchdog (--collective-timeout)
            rec = self.train_step(s)
            self._record(rec)
            self.console.step(rec)
            self._notify("step_done", s, rec)
            if self.eval_batches and (s % o.eval_every == 0 or s == o.steps):
                val = self.evaluate(s)
                self._record({"step": s, "val_loss": val})
                say(f"step {s} | val_loss {val:.4f}" if val is not None else f"step {s} | val_loss is not finite")
            self.stop.slowest_step = max(self.stop.slowest_step, time.monotonic() - t0)
            stop = self.stop.agree()
            if stop == IO_FAILURE:
                raise self._stop_on_io_failure(s)
            if self.keep_files and (s == last or stop or (o.ckpt_every and s % o.ckpt_every == 0)):
                self.save(s)
                stop = stop or (s < last and self.stop.agree())    # a signal during the save: stop on it
            if stop:
                why = "a signal" if stop == SIGNAL else f"--time-limit {o.time_limit:g}s"
                then = "; continue with --resume" if self.keep_files else ""
                say(f"stopped by {why} after step {s}{then} (exit status {EXIT_PREEMPTED})")
                return EXIT_PREEMPTED
        if last < o.steps:
            say(f"stopped after step {last} (--stop-after); continue with the same command plus --resume, "
                f"less --stop-after (or with a later one)")
        else:
            say(f"done: {last} steps")
        return 0

    def _stop_on_io_failure(self, s: int) -> RunDirError:
        """Every rank, after rank 0 failed to write the run directory during
        step ``s``: the error to end the job with (exit status 74), after an
        attempt to save step ``s``, so that freeing the disk and resuming
        loses no work. A save that fails too leaves the last good checkpoint
        as it was (``checkpoint.save`` commits whole or not at all)."""
        what = self.stop.io_failure or "rank 0 could not write the run directory"
        try:
            path = self.save(s)
        except RunDirError as exc:
            return RunDirError(f"{what} after step {s}; and the checkpoint failed too: {exc}")
        return RunDirError(f"{what} after step {s}; saved {path}: fix the disk and continue with --resume")

    def train_step(self, s: int) -> dict:
        """One optimizer step; the metrics record of step ``s``."""
        o, p = self.opts, self.parts
        p.counters.reset()
        p.backend.synchronize()
        t0 = time.perf_counter()
        x, y = self.loader.batch(s - 1)                      # (B, T) each, global
        self._notify("step_started", s, x, y)
        loss_scale = self.scaler.scale if self.scaler is not None else 1.0
        after_forward = (lambda m: self._notify("forward_done", s, m)) if self.hooks else None
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            p.store.zero_grad()
            loss = forward_backward(p, x, y, s, loss_scale, after_forward)   # N micro-batches, gradients added up
            self.opt.sync()
            self._notify("gradients_synced", s)
            norm = self.opt.grad_norm() / loss_scale
            # 2: the loss is not finite (diverged); 1: only the gradient is (an
            # overflow: skip the step when loss scaling, else diverged). Agreed
            # by every rank, so all skip or stop together.
            verdict = agree_max(self.world, 2 if not math.isfinite(loss) else int(not math.isfinite(norm)))
            if verdict == 2 or (verdict == 1 and self.scaler is None):
                raise DivergedError(self._diverged_message(s, loss, norm))
            skipped = verdict == 1
            self._notify("gradients_ready", s, loss, norm, loss_scale, skipped)
            lr = self.schedule(s)
            if not skipped:
                clip = min(1.0, o.grad_clip / (norm + 1e-6)) if o.grad_clip > 0 else 1.0
                self.opt.step(lr, clip / loss_scale)
            if self.scaler is not None:
                self.scaler.update(not skipped)
        p.backend.synchronize()
        dt = time.perf_counter() - t0
        rec = {
            "step": s,
            "loss": loss,
            "lr": lr,
            "grad_norm": None if skipped else norm,
            "step_time_s": dt,
            "tokens_per_s": o.batch_size * o.seq_len / dt if dt > 0 else 0.0,
            "comm_elems": float(p.counters.total_elems()),
            "comm_bytes": float(p.counters.total_bytes()),
            "comm_msgs": int(p.counters.total_msgs()),
        }
        if hasattr(p.model, "mtp_log"):                      # multi-token prediction: main_loss, mtp_loss_{k}
            rec.update(p.model.mtp_log.take())
        if hasattr(p.model, "router_log"):                   # a mixture of experts: router losses, tokens per expert
            rec.update(p.model.router_log.take())
            if not skipped:                                  # the aux-loss-free bias, from the step's global loads
                balance(p.store, p.cfg, p.model.router_log.loads)
            if p.counters.bytes.get("ep"):                  # --ep: the all-to-all's bytes (analysis/costmoe.py)
                rec["ep_bytes"] = float(p.counters.bytes["ep"])
        if self.scaler is not None:
            rec.update(loss_scale=loss_scale, skipped=skipped)
            if skipped:
                self.console.say(f"step {s}: gradient overflow at loss scale {loss_scale:g}: step skipped, "
                                 f"scale now {self.scaler.scale:g}")
        return rec

    def _notify(self, point: str, *args) -> None:
        """Call every observer's ``point`` (a ``StepHooks`` method) with this trainer."""
        for hook in self.hooks:
            getattr(hook, point)(self, *args)

    def _diverged_message(self, s, loss, norm) -> str:
        what = f"loss is {loss}" if not math.isfinite(loss) else f"gradient norm is {norm}"
        last = f"the last checkpoint, {self.last_ckpt}, is intact" if self.last_ckpt else "no checkpoint was written"
        return (f"training diverged at step {s}: the {what}; stopped without saving this state "
                f"({last}; try a lower --lr or a longer --warmup)")

    def evaluate(self, s: int) -> Optional[float]:
        """Mean validation loss over the first ``eval_batches`` evaluation batches (None if not finite)."""
        WAITS.in_phase("evaluation")
        model = eval_model(self.parts)
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            val = mean_eval_loss(self.parts, model, self.val_tokens, self.opts.seq_len, self.eval_batches)
        WAITS.in_phase("step")
        return val if math.isfinite(val) else None

    def save(self, s: int) -> Path:
        t0 = time.monotonic()
        p, o = self.parts, self.opts
        attrs = {
            "config": json.dumps(self.cfg.to_dict()),
            "train": json.dumps(o.to_dict()),
            "layout": json.dumps(p.layout.describe()),
            "adam_t": int(self.opt.adam.t),
            **({"loss_scale": self.scaler.to_json()} if self.scaler is not None else {}),
            **({"fp8": json.dumps(p.layout.fp8.state(self.world))} if delayed(p.layout.fp8) else {}),
            "data": json.dumps({"step": s, "path": self.train_path, "val": self.val_path,
                                "builtin": self.data_plan.builtin, "batch_size": o.batch_size,
                                "seq_len": o.seq_len, "seed": o.seed}),
            "mpicube_version": __version__,
        }
        axes = p.layout.axes
        blocks = state_blocks(p.store, self.opt.adam, axes.dp.rank + axes.cp.rank)   # writers: dp and cp rank 0
        WAITS.in_phase("checkpoint save")       # its agreement is plain mpi4py, unseen by the watchdog
        self._notify("save_started", s)
        try:
            path = checkpoint.save(self.run_dir, s, blocks, attrs, comm=self.world, keep=o.keep or None,
                                   owner=self.owner)
        except checkpoint.CheckpointError as exc:     # raised by every rank alike: a full disk, most likely
            last = f"the last good checkpoint, {self.last_ckpt}, is intact" if self.last_ckpt else \
                "no checkpoint of this run was written"
            raise RunDirError(f"{exc}; {last}") from exc
        WAITS.in_phase("step")
        self.last_ckpt = path
        self.stop.ckpt_seconds = time.monotonic() - t0
        self.console.say(f"checkpoint {path}")
        return path


def delayed(fp8) -> bool:
    """Whether --fp8's scaling state carries amax histories (the delayed
    recipe), which a checkpoint keeps so that a resumed run scales as the
    uninterrupted one."""
    return fp8 is not None and fp8.recipe.name == "delayed"


def train(opts: TrainOptions, mpi_world=None) -> int:
    """Run ``mpicube train``; the process exit status."""
    return Trainer(opts, mpi_world).run()
