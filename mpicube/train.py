"""The training loop: data, model, optimizer, checkpoints, logging, signals.

One step, on every rank (s is 1-based)::

    x, y = loader.batch(s - 1)                # (B, T) global batch, same on every rank
    loss = forward_backward(parts, x, y, s)   # this replica's rows, in --grad-accum micro-batches
    opt.sync(); norm = opt.grad_norm()       # opt: optim.make_step (--zero 1: zero.ShardedStep)
    opt.step(schedule(s), clip_scale(norm))

Everything a run needs to continue is (parameters, AdamW moments and t, the
step): the loader is random access by step and dropout masks are a function
of the step, so a resumed run repeats the uninterrupted one bit for bit on the
same layout, and follows it up to rounding on any other.

Stopping early (mpicube.stopping) is agreed by all ranks at step boundaries with one tiny
uncounted all-reduce: SIGTERM/SIGUSR1 on any rank or ``--time-limit``
(checkpoint, exit status 75 = EX_TEMPFAIL, "requeue me"), ``--stop-after``
(checkpoint, exit status 0). A non-finite loss or gradient norm stops the run
without saving the bad state (exit status 3).

Files in the run directory (rank 0 writes all but the checkpoint shards)::

    config.json      model, options, layout, world size, version
    metrics.jsonl    one object per step, and one per evaluation
    ckpt/            checkpoints (mpicube.checkpoint)
"""

from __future__ import annotations

import json
import math
import os
import signal
import time
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from typing import Optional

import numpy as np

from . import __version__, checkpoint, data, dataplan, formats, rundir, threads
from .comm import agree_max, on_root
from .config import ModelConfig
from .errors import ConfigError, UserError
from .evaluate import eval_model, evaluate_checkpoint, mean_eval_loss  # noqa: F401 (evaluate_checkpoint: API)
from .accum import forward_backward
from .grid import plan, saved_or_default_batch
from .optim import Schedule, make_step
from .parts import Parts, build_parts, recompute_note  # noqa: F401 (build_parts re-exported for tools and tests)
from .console import Console
from .options import TrainOptions, _dash  # noqa: F401 (TrainOptions re-exported: tests and tools import it here)
from .stopping import SIGNAL, EarlyStop
from .state import attr_dict, describe_layout, load_state, state_blocks

EXIT_PREEMPTED = 75      # EX_TEMPFAIL: stopped by a signal or --time-limit, resume me
EXIT_DIVERGED = 3        # non-finite loss or gradient norm
SHAPE_OPTIONS = ("n_layer", "n_head", "n_embd", "vocab_size")   # what a model file given to a run decides

# Test hook (for tests/test_precision.py): at the step this variable names,
# the last world rank puts an inf into its gradient after the gradient
# synchronisation, as a float16 overflow on one rank would; the step must be
# skipped on every rank alike.
OVERFLOW_HOOK = "MPICUBE_TEST_OVERFLOW_STEP"

# Test hook (for tests/test_train.py, tests/test_ckpt_faults.py): "RANK:STEP:SIGNAL"
# makes that world rank send itself the signal as it starts saving that step.
SIGNAL_HOOK = "MPICUBE_TEST_SIGNAL_IN_SAVE"

# Test hook (for tests/test_cli.py): the world rank named by this
# variable raises an unexpected exception at step 2, to check that an
# exception on one rank ends the whole job instead of leaving it hanging.
CRASH_HOOK = "MPICUBE_TEST_CRASH_RANK"

class DivergedError(UserError):
    """The loss or gradient norm stopped being finite."""

    exit_code = EXIT_DIVERGED


# --------------------------------------------------------------------------- data


def resolve_data(mpi_world, path: Optional[str]):
    """(train path, val path): the given shard and its ``_val`` sibling if
    present (else the train shard itself), or the built-in corpus, which rank
    0 prepares once before the others read it."""
    if path is None:
        return tuple(on_root(mpi_world, lambda: tuple(str(p) for p in data.builtin_corpus())))
    train = Path(path)
    val = dataplan.val_path_for(train)
    return str(train), str(val if val.is_file() else train)


# --------------------------------------------------------------------------- the trainer


class Trainer:
    """Set up once, then ``run()``; returns the process exit status."""

    def __init__(self, opts: TrainOptions, mpi_world=None):
        if mpi_world is None:
            from mpi4py import MPI

            mpi_world = MPI.COMM_WORLD
        self.opts = opts
        self.world = mpi_world
        self.rank = mpi_world.Get_rank()
        self.stop = EarlyStop(mpi_world, opts.time_limit)   # signals and --time-limit, agreed by all ranks
        self.last_ckpt = None           # path of the last checkpoint of this run
        self.console = Console(False, 1, 0, 1)
        self.metrics = None
        self.lock = None                # rank 0: the run directory's lock
        self.owner = None               # this job's name in temporary checkpoint directories
        self.notes = []                 # said once the console is up

    # --- setup ---------------------------------------------------------------
    def setup(self) -> None:
        o = self.opts
        o.validate()
        self.cfg = o.model_config()
        self.batch_note = None                # how a default batch size was chosen, for the console
        # A default batch fits the model, which a model file may decide: then
        # it (and the data plan, which needs it) waits until the file is open.
        wait_for_file = o.batch_size is None and (o.init_from is not None or o.resume)
        if not wait_for_file:
            self._choose_batch()
            if o.init_from is None:           # else the model file says what the model is
                plan(o.layout, self.cfg, o.batch_size, self.world.Get_size(), o.dp, o.depth, o.grad_accum,
                     o.recompute)                                                           # pure
            self._plan_data()

        run_dir, self.owner, said = on_root(self.world, self._prepare_run_dir)
        self.run_dir = Path(run_dir)
        self.notes += said
        self.source, self.full_state = self._model_source()
        self.model_file = None
        if self.source is not None:           # the model's shape and vocabulary come from the file
            self.model_file = formats.open_everywhere(self.world, self.source)
            self.cfg = self._file_config(self.model_file)
        if wait_for_file:
            self._choose_batch()
            self._plan_data()
        on_root(self.world, lambda: data.check_vocab(self.train_tokens, self.cfg.vocab_size, self.train_path))
        if self.eval_batches:
            on_root(self.world, lambda: data.check_vocab(self.val_tokens, self.cfg.vocab_size, self.val_path))
        if self.model_file is not None and o.recompute != "none":   # 1-D row shards split B_dp x --seq-len rows
            plan(o.layout, replace(self.cfg, n_ctx=o.seq_len), o.batch_size, self.world.Get_size(), o.dp, o.depth,
                 o.grad_accum, o.recompute)
        self.parts = build_parts(self.cfg, o.layout, o.batch_size, self.world, o.dp, o.depth, o.dtype, o.device,
                                 o.seed, o.dropout, o.tf32, grad_accum=o.grad_accum, recompute=o.recompute,
                                 zero=o.zero)
        note = recompute_note(self.parts.layout, o.recompute)
        if note:
            self.notes.append(note)
        self.opt = make_step(self.parts.store, self.parts.layout.axes, weight_decay=o.weight_decay)
        self.scaler = o.loss_scaler()                  # float16 only
        self.schedule = Schedule(o.lr, o.warmup, o.steps)
        self.start_step = self._restore() + 1

        if self.rank == 0:
            self._write_config()
            self._open_metrics()
        self.world.Barrier()

    def _choose_batch(self) -> None:
        """Without --batch-size: a resumed run's own batch if this layout
        takes it, else the smallest of at least 8 that the layout accepts
        for this model (grid.default_batch); pure, so every rank agrees."""
        o = self.opts
        if o.batch_size is not None:
            return
        saved = None
        if getattr(self, "full_state", False) and self.model_file is not None:
            saved = attr_dict(getattr(self.model_file, "attrs", {}).get("train")).get("batch_size")
        o.batch_size, kept, why = saved_or_default_batch(saved, o.layout, self.cfg, self.world.Get_size(), o.dp,
                                                         o.depth, o.grad_accum, o.recompute)
        self.batch_note = f"batch {o.batch_size} (the resumed run's)" if kept else why

    def _plan_data(self) -> None:
        """The data plan (rank 0 decides, every rank checks) and the loader."""
        o = self.opts
        self.data_plan, self.train_tokens, self.val_tokens = dataplan.plan_training_data(
            self.world, o.data, o.val_data, o.batch_size, o.seq_len, o.eval_every, o.eval_batches)
        self.train_path, self.val_path = self.data_plan.train, self.data_plan.val
        self.eval_batches = self.data_plan.eval_batches          # 0: no validation
        self.notes += self.data_plan.notes
        self.loader = data.TrainLoader(self.train_tokens, o.batch_size, o.seq_len, o.seed)

    def _prepare_run_dir(self) -> tuple:
        """Rank 0: (run directory, this job's name for its temporary files,
        notes), holding the run directory's lock from here to the end of the
        run, and with the debris of dead jobs cleared."""
        o = self.opts
        if o.out is None:
            if o.resume:
                raise UserError("--resume needs --out RUN_DIR (the run to continue)")
            base = Path("runs") / datetime.now().strftime("%Y%m%d-%H%M%S")
            run_dir, n = base, 1
            while run_dir.exists():
                run_dir, n = base.with_name(f"{base.name}-{n}"), n + 1
        else:
            run_dir = Path(o.out)
        if run_dir.exists() and not run_dir.is_dir():
            raise UserError(f"--out {run_dir}: exists and is not a directory")
        if not o.resume and checkpoint.latest(run_dir) is not None:
            raise UserError(f"{run_dir} already holds checkpoints: pass --resume to continue that run, "
                            "or choose another --out")
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UserError(f"--out {run_dir}: cannot create the run directory ({exc.strerror})") from None
        notes = []
        self.lock = rundir.acquire(run_dir, force=o.force_unlock, notes=notes)
        try:
            notes += [f"note: {line}" for line in checkpoint.recover(run_dir)]
        except OSError as exc:
            notes.append(f"warning: could not tidy {run_dir / checkpoint.CKPT_DIR}: {exc}")
        return str(run_dir), self.lock.token, notes

    def _model_source(self) -> tuple:
        """(model file or None, whether to restore the whole training state)."""
        o = self.opts
        if o.resume:
            own, said = on_root(self.world, self._own_latest)
            self.notes += said
            if own is not None:
                return own, True
            if o.init_from is None:
                self.notes.append(f"no checkpoint in {self.run_dir}: starting a fresh run")
        return o.init_from, False          # --init-from starts this run's own schedule and optimizer

    def _own_latest(self) -> tuple:
        said = []
        return _str_or_none(checkpoint.latest(self.run_dir, said)), said

    def _file_config(self, model_file) -> ModelConfig:
        """The model of ``model_file``, checked against --seq-len; a note
        when the shape options differ from it (they are not used)."""
        o, cfg = self.opts, model_file.config
        if o.seq_len > cfg.n_ctx:
            raise ConfigError(f"--seq-len {o.seq_len} is longer than the context of {model_file.describe()} "
                              f"({cfg.n_ctx} positions)")
        wanted = replace(o.model_config(), n_ctx=cfg.n_ctx)
        differ = [k for k in SHAPE_OPTIONS if getattr(wanted, k) != getattr(cfg, k)]
        given = getattr(o, "given_shape", SHAPE_OPTIONS)     # the CLI says which were typed; API callers mean all
        if any(k in given for k in differ):                  # asked for another model than the file holds
            leave_out = f"(leave out {', '.join('--' + _dash(k) for k in differ)} to take the file's model)"
            wanted_shapes = formats.base.gpt2_shapes(wanted)
            for name, have in model_file.shapes.items():
                if name in wanted_shapes and wanted_shapes[name] != have:
                    label = f"model/{name}" if model_file.kind == "mpicube" else name
                    raise ConfigError(f"{model_file.path}: tensor '{label}' has shape {have} but this model needs "
                                      f"{wanted_shapes[name]} {leave_out}")
            k = differ[0]
            raise ConfigError(f"{model_file.path}: holds a model with {k} {getattr(cfg, k)}, this run asks for "
                              f"{getattr(wanted, k)} {leave_out}")
        if differ:
            differ = [f"--{_dash(k)}" for k in differ]
            self.notes.append(f"note: the model's shape comes from {model_file.path}: n_layer {cfg.n_layer}, "
                              f"n_head {cfg.n_head}, n_embd {cfg.n_embd}, n_ctx {cfg.n_ctx}, vocab {cfg.vocab_size} "
                              f"({', '.join(differ)} not used)")
        return cfg

    def _restore(self) -> int:
        """Load parameters / state as asked; return the last completed step."""
        if self.model_file is None:
            return 0
        full = self.full_state
        with self.model_file as model_file:
            if model_file.kind != "mpicube" or not full:
                formats.load_params(model_file, self.parts.store)
                if full:
                    self.notes.append(f"note: {model_file.path} holds no optimizer state: starting at step 0 "
                                      "with fresh AdamW moments")
                self.notes.append(f"initialized parameters from {model_file.describe()}")
                return 0
            ck = model_file.ck
            load_state(ck, self.parts.store, self.opt.adam, comm=self.world)
            self.opt.adam.t = int(ck.attrs.get("adam_t", ck.step))
            if self.scaler is not None and "loss_scale" in ck.attrs:
                self.scaler.restore(ck.attrs["loss_scale"])     # scale and counters: resume stays exact
            position = attr_dict(ck.attrs.get("data"))
            step = int(position.get("step", ck.step))
            self.notes.append(f"resuming from {ck.path} at step {step}")
            changed = self._changed_options(attr_dict(ck.attrs.get("train")))
            if changed:
                self.notes.append("note: options differ from the checkpoint's run: " + ", ".join(changed))
            self.last_ckpt = ck.path
            return step

    def _changed_options(self, saved: dict) -> list:
        """Options that change the trajectory and differ from a resumed run's."""
        relevant = ("n_layer", "n_head", "n_embd", "seq_len", "batch_size", "steps", "lr", "warmup",
                    "weight_decay", "grad_clip", "dropout", "seed", "dtype", "data")
        now = self.opts.to_dict()
        return [f"--{_dash(k)} {saved[k]} -> {now[k]}" for k in relevant if k in saved and saved[k] != now[k]]

    def _write_config(self) -> None:
        """config.json: the run as this launch sees it, and every launch's
        world, layout, threads, environment and versions (appended)."""
        layout = self.parts.layout
        doc = {
            "mpicube_version": __version__,
            "world_size": self.world.Get_size(),
            "model": self.cfg.to_dict(),
            "n_params": self.cfg.n_params(),
            "train": self.opts.to_dict(),
            "layout": layout.describe(),
            "data": {"train": self.train_path, "val": self.val_path},
            "threads": threads.current().to_dict(),
        }
        launch = {
            "started": datetime.now().astimezone().isoformat(timespec="seconds"),
            "start_step": self.start_step,
            "host": threads.current().host,
            "world_size": self.world.Get_size(),
            "layout": layout.describe(),
            "threads": threads.current().to_dict(),
            "train": self.opts.to_dict(),
            "environment": rundir.environment(),
            "versions": rundir.versions(),
        }
        rundir.record_launch(self.run_dir, doc, launch)

    def _open_metrics(self) -> None:
        """metrics.jsonl, appended to, its records from the step this launch
        starts at cut off (they are repeated); never rewritten."""
        self.metrics = rundir.open_metrics(self.run_dir, self.start_step)

    def _record(self, rec: dict) -> None:
        if self.metrics is not None:
            self.metrics.write(json.dumps(rec) + "\n")
            self.metrics.flush()

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
        crash_rank = os.environ.get(CRASH_HOOK)
        for s in range(first, last + 1):
            if crash_rank is not None and s >= 2 and int(crash_rank) == self.rank:
                raise RuntimeError(f"{CRASH_HOOK}={crash_rank}: deliberate failure at step {s} (test hook)")
            t0 = time.monotonic()
            rec = self.train_step(s)
            self._record(rec)
            self.console.step(rec)
            if self.eval_batches and (s % o.eval_every == 0 or s == o.steps):
                val = self.evaluate(s)
                self._record({"step": s, "val_loss": val})
                say(f"step {s} | val_loss {val:.4f}" if val is not None else f"step {s} | val_loss is not finite")
            self.stop.slowest_step = max(self.stop.slowest_step, time.monotonic() - t0)
            stop = self.stop.agree()
            if s == last or stop or (o.ckpt_every and s % o.ckpt_every == 0):
                self.save(s)
                stop = stop or (s < last and self.stop.agree())    # a signal during the save: stop on it
            if stop:
                why = "a signal" if stop == SIGNAL else f"--time-limit {o.time_limit:g}s"
                say(f"stopped by {why} after step {s}; continue with --resume (exit status {EXIT_PREEMPTED})")
                return EXIT_PREEMPTED
        if last < o.steps:
            say(f"stopped after step {last} (--stop-after); continue with --resume")
        else:
            say(f"done: {last} steps")
        return 0

    def train_step(self, s: int) -> dict:
        """One optimizer step; the metrics record of step ``s``."""
        o, p = self.opts, self.parts
        p.counters.reset()
        p.backend.synchronize()
        t0 = time.perf_counter()
        x, y = self.loader.batch(s - 1)                      # (B, T) each, global
        loss_scale = self.scaler.scale if self.scaler is not None else 1.0
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            p.store.zero_grad()
            loss = forward_backward(p, x, y, s, loss_scale)     # N micro-batches, gradients added up
            self.opt.sync()
            self._inject_overflow(s)
            norm = self.opt.grad_norm() / loss_scale
            # 2: the loss is not finite (diverged); 1: only the gradient is (an
            # overflow: skip the step when loss scaling, else diverged). Agreed
            # by every rank, so all skip or stop together.
            verdict = agree_max(self.world, 2 if not math.isfinite(loss) else int(not math.isfinite(norm)))
            if verdict == 2 or (verdict == 1 and self.scaler is None):
                raise DivergedError(self._diverged_message(s, loss, norm))
            skipped = verdict == 1
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
        if self.scaler is not None:
            rec.update(loss_scale=loss_scale, skipped=skipped)
            if skipped:
                self.console.say(f"step {s}: gradient overflow at loss scale {loss_scale:g}: step skipped, "
                                 f"scale now {self.scaler.scale:g}")
        return rec

    def _inject_overflow(self, s: int) -> None:
        """The OVERFLOW_HOOK test hook: an inf in the last rank's gradient at one step."""
        hook = os.environ.get(OVERFLOW_HOOK)
        if hook is not None and int(hook) == s and self.rank == self.world.Get_size() - 1:
            store = self.parts.store
            store.flat_grad[store.shard.start] = math.inf        # in the part this rank's norm reads

    def _diverged_message(self, s, loss, norm) -> str:
        what = f"loss is {loss}" if not math.isfinite(loss) else f"gradient norm is {norm}"
        last = f"the last checkpoint, {self.last_ckpt}, is intact" if self.last_ckpt else "no checkpoint was written"
        return (f"training diverged at step {s}: the {what}; stopped without saving this state "
                f"({last}; try a lower --lr or a longer --warmup)")

    def evaluate(self, s: int) -> Optional[float]:
        """Mean validation loss over the first ``eval_batches`` evaluation batches (None if not finite)."""
        model = eval_model(self.parts)
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            val = mean_eval_loss(self.parts, model, self.val_tokens, self.opts.seq_len, self.eval_batches)
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
            "data": json.dumps({"step": s, "path": self.train_path, "val": self.val_path,
                                "builtin": self.data_plan.builtin, "batch_size": o.batch_size,
                                "seq_len": o.seq_len, "seed": o.seed}),
            "mpicube_version": __version__,
        }
        blocks = state_blocks(p.store, self.opt.adam, p.layout.axes.dp.rank)
        self._signal_in_save(s)
        path = checkpoint.save(self.run_dir, s, blocks, attrs, comm=self.world, keep=o.keep or None,
                               owner=self.owner)
        self.last_ckpt = path
        self.stop.ckpt_seconds = time.monotonic() - t0
        self.console.say(f"checkpoint {path}")
        return path

    def _signal_in_save(self, s: int) -> None:
        """The SIGNAL_HOOK test hook ("RANK:STEP:SIGNAL"): that rank sends
        itself the signal as it starts saving that step (SIGUSR1: a
        scheduler's warning landing mid-save; SIGSTOP: a rank frozen with
        the save half done, for a test to kill)."""
        hook = os.environ.get(SIGNAL_HOOK)
        if hook:
            rank, step, name = hook.split(":")
            if int(rank) == self.rank and int(step) == s:
                os.kill(os.getpid(), getattr(signal, f"SIG{name}"))


def _str_or_none(path) -> Optional[str]:
    return None if path is None else str(path)


def train(opts: TrainOptions, mpi_world=None) -> int:
    """Run ``mpicube train``; the process exit status."""
    return Trainer(opts, mpi_world).run()
