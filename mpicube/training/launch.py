"""How a run starts: options checked, data planned, the run directory
taken, the model built and initialised, restored or loaded from a file.

``Launch`` is the first half of ``train.Trainer`` (which adds the loop, the
step and the saves); it is its own module because starting is where the
cases are - a fresh run, a resumed one, a model from an mpicube, Hugging
Face or llm.c file, a batch size chosen to fit - and the loop should read
without them. Everything here runs once, before step ``start_step``.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime
from pathlib import Path
from typing import Optional

from ..core.config import DEEPSEEK_MOE, DEEPSEEK_OPTIONS, ModelConfig, family_fields
from ..core.errors import ConfigError, RunDirError, UserError, io_reason
from ..device import threads
from ..files import checkpoint, data, formats
from ..parallel.comm import on_root
from ..parallel.planning import resolve
from . import dataplan, rundir
from .options import _dash
from .optim import Schedule
from .parts import build_parts, recompute_note, require_host_room
from .state import load_state, saved_state
from .step import make_step
from .. import __version__

SHAPE_OPTIONS = ("n_layer", "n_head", "n_embd", "vocab_size")   # what a model file given to a run decides
# The family's options: a model file decides the family (``--arch`` unless given) and these model-defining
# ones; the mixture's training knobs (capacity, the router losses' weights, the sigmoid router's bias update
# and sequence-wise loss) given apply to the file's model.
FAMILY_OPTIONS = ("arch", "n_kv_head", "ffn_hidden", "rope_theta", "rms_eps", "tie_embeddings", "n_experts", "top_k",
                  "no_norm_topk", "capacity_factor", "router_aux_loss_coef", "router_z_loss_coef", "q_lora_rank",
                  "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "rope_interleave",
                  "mtp_depth", "mtp_loss_weight") + DEEPSEEK_OPTIONS
TRAINING_KNOBS = ("capacity_factor", "router_aux_loss_coef", "router_z_loss_coef", "bias_update_rate", "bias_update",
                  "seq_aux_loss_coef", "mtp_loss_weight")
# a model-defining family option -> its value in a ModelConfig, comparable with the file's
MODEL_DEFINING = {"n_kv_head": lambda c: c.kv_heads, "ffn_hidden": lambda c: c.ffn, "rope_theta": lambda c: c.rope_theta,
                  "rms_eps": lambda c: c.rms_eps, "tie_embeddings": lambda c: c.tied,
                  "n_experts": lambda c: c.n_experts, "top_k": lambda c: c.top_k,
                  "no_norm_topk": lambda c: not c.norm_topk,
                  **{k: (lambda c, k=k: getattr(c, k)) for k in ("q_lora_rank", "kv_lora_rank", "qk_rope_head_dim",
                                                                 "qk_nope_head_dim", "v_head_dim", "rope_interleave",
                                                                 "router", "n_groups", "topk_groups",
                                                                 "routed_scaling_factor", "n_shared_experts",
                                                                 "first_k_dense", "mtp_depth")},
                  "moe_ffn_hidden": lambda c: c.moe_ffn}


def family_of(cfg: ModelConfig) -> str:
    """What --arch names this model: gpt2, llama, mixtral (a Llama with experts) or deepseek_v3."""
    return "mixtral" if cfg.moe and cfg.arch == "llama" else cfg.arch


class Launch:
    """The start of a run; ``setup()`` leaves on ``self``: ``cfg``, ``parts``,
    ``opt`` (the optimizer step), ``scaler``, ``schedule``, ``loader``,
    ``start_step``, the data plan and, when the run keeps files, ``run_dir``
    with its lock, ``config.json`` and ``metrics.jsonl`` open. The subclass
    sets ``opts``, ``world``, ``rank``, ``notes``, ``keep_files``,
    ``recorder`` (the profiler's, or None) and ``lock`` / ``metrics`` /
    ``owner`` / ``last_ckpt`` before calling it."""

    def setup(self) -> None:
        o = self.opts
        o.validate()
        self.cfg = None if o.file_decides_family else o.model_config()   # else known once the file is open
        self.batch_note = None                # how a default batch size was chosen, for the console
        self.run = None                       # the resolved plan (parallel/planning.py), once the model is known
        # The plan is resolved once, against the model the run builds: the
        # options' own, now (every size checked before any file or
        # directory is touched), or a model file's, once it is open.
        if o.init_from is None and not o.resume:
            self._resolve()
        if o.batch_size is not None:
            self._plan_data()

        vocab = None                                     # the vocabulary the shards are checked against now
        if o.init_from is not None and not o.resume:     # a model file refused leaves no run directory behind
            file_cfg = on_root(self.world, self._check_init_from)
            vocab = file_cfg.vocab_size
            if o.batch_size is None:                     # the file's model sets the default batch: plan the
                self.cfg = file_cfg                      # data now, so a bad token id leaves no directory either
                self._resolve()
                self._plan_data()
        elif self.cfg is not None and not o.resume:
            vocab = self.cfg.vocab_size
        self.vocab_checked = False
        if vocab is not None and o.batch_size is not None:   # a token past the vocabulary: no run directory either
            self._check_vocab(vocab)
        if self.run is not None:                         # a model too large for the host: no run directory
            require_host_room(self.run, o.numerics, self.world)
        if self.keep_files:
            run_dir, self.owner, said = on_root(self.world, self._prepare_run_dir)
            self.run_dir = Path(run_dir)
            self.notes += said
        elif o.resume:
            raise UserError("--resume needs a run directory, and this run keeps no files")
        self.source, self.full_state = self._model_source()
        self.model_file = None
        if self.source is not None:           # the model's shape and vocabulary come from the file
            self.model_file = formats.open_everywhere(self.world, self.source)
            self.cfg = self._file_config(self.model_file)
        elif self.cfg is None:                # --resume of a run without a checkpoint: the options' model
            self.cfg = o.model_config()
        if self.run is None:
            planned = o.batch_size is not None
            self._resolve()
            if not planned:
                self._plan_data()
        if not self.vocab_checked or vocab != self.cfg.vocab_size:
            self._check_vocab(self.cfg.vocab_size)
        self.parts = build_parts(self.run, self.world, o.numerics, o.seed, o.dropout,
                                 recorder=self.recorder)
        for note in (recompute_note(self.parts.layout, o.recompute), self.run.pipeline_note, self.run.tp_note):
            if note:                                   # e.g. fewer micro-batches than stages: a large bubble
                self.notes.append(note)
        self.opt = make_step(self.parts.store, self.parts.layout.axes, weight_decay=o.weight_decay,
                             optimizer=o.optimizer, muon_qkv=o.muon_qkv)
        self.scaler = o.loss_scaler()                  # float16 only
        self.schedule = Schedule(o.lr, o.warmup, o.steps)
        self.start_step = self._restore() + 1

        if self.keep_files:                  # rank 0; its RunDirError reaches every rank
            self.notes += on_root(self.world, self._write_run_files)
        self.world.Barrier()

    def _resolve(self) -> None:
        """The plan validated, once, for this model on --seq-len positions
        (pure, so every rank agrees). Without --batch-size: a resumed run's
        own batch if the plan takes it, else the smallest of at least 8 that
        it accepts for this model."""
        o = self.opts
        saved = None
        if o.batch_size is None and getattr(self, "full_state", False) and self.model_file is not None:
            saved = saved_state(self.model_file).batch_size
        self.run = resolve(o.plan, self.cfg, o.batch_size, self.world.Get_size(), seq_len=o.seq_len, saved=saved)
        if o.batch_size is None:
            o.batch_size = self.run.batch_size
            kept = f"batch {o.batch_size} (the resumed run's)"
            self.batch_note = kept if self.run.batch_kept else self.run.batch_note

    def _plan_data(self) -> None:
        """The data plan (rank 0 decides, every rank checks) and the loader."""
        o = self.opts
        self.data_plan, self.train_tokens, self.val_tokens = dataplan.plan_training_data(
            self.world, o.data, o.val_data, o.batch_size, o.seq_len, o.eval_every, o.eval_batches)
        self.train_path, self.val_path = self.data_plan.train, self.data_plan.val
        self.eval_batches = self.data_plan.eval_batches          # 0: no validation
        self.notes += self.data_plan.notes
        self.loader = data.TrainLoader(self.train_tokens, o.batch_size, o.seq_len, o.seed)

    def _check_vocab(self, vocab_size: int) -> None:
        """Every token id of the training and validation shards inside the
        model's vocabulary (rank 0 scans; its DataError reaches every rank)."""
        on_root(self.world, lambda: data.check_vocab(self.train_tokens, vocab_size, self.train_path))
        if self.eval_batches:
            on_root(self.world, lambda: data.check_vocab(self.val_tokens, vocab_size, self.val_path))
        self.vocab_checked = True

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
            raise RunDirError(f"--out {run_dir}: cannot create the run directory ({io_reason(exc)})") from None
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
        # the options' sizes in the file's family (its family options: _file_family)
        wanted = replace(cfg, vocab_size=o.vocab_size, n_layer=o.n_layer, n_head=o.n_head, n_embd=o.n_embd)
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
        cfg = self._file_family(model_file.path, cfg)
        if differ:
            differ = [f"--{_dash(k)}" for k in differ]
            self.notes.append(f"note: the model's shape comes from {model_file.path}: n_layer {cfg.n_layer}, "
                              f"n_head {cfg.n_head}, n_embd {cfg.n_embd}, n_ctx {cfg.n_ctx}, vocab {cfg.vocab_size} "
                              f"({', '.join(differ)} not used)")
        return cfg

    def _check_init_from(self) -> ModelConfig:
        """Rank 0: --init-from's file opens and its model is the one the
        options ask for (shape and family), before the run directory is
        made; returns the model it holds under this run's options (its
        vocabulary checks the shards; its shape sets a default batch)."""
        with formats.open_model(self.opts.init_from, verify=False) as model_file:
            said = list(self.notes)
            cfg = self._file_config(model_file)
            self.notes[:] = said                   # said again when the run opens the file
            return cfg

    def _file_family(self, path, cfg: ModelConfig) -> ModelConfig:
        """The file's model under this run's family options: the file
        decides the family (``--arch`` given must name it) and its
        model-defining settings (each given must agree, one line naming it,
        as a differing --n-embd); the mixture's training knobs given
        (--capacity-factor, --router-aux-loss-coef, --router-z-loss-coef)
        replace the file's."""
        o = self.opts
        if not hasattr(o, "given_shape"):                   # an API caller: the file's model, as always
            return cfg
        given = set(o.given_shape)
        leave_out = "to take the file's model"
        if "arch" in given:
            asked = family_of(ModelConfig(**family_fields(**o.family())))
            if asked != family_of(cfg):
                raise ConfigError(f"{path}: holds a {family_of(cfg)} model, this run asks for --arch {o.arch} "
                                  f"(leave out --arch {leave_out})")
        options = {**o.family(), "arch": family_of(cfg)}
        if cfg.moe:                                          # the file's experts unless given
            options["n_experts"] = options["n_experts"] if options["n_experts"] is not None else cfg.n_experts
            options["top_k"] = options["top_k"] if options["top_k"] is not None else cfg.top_k
            for key, default in DEEPSEEK_MOE.items():       # the file's DeepSeekMoE settings unless given
                if options.get(key) is None and getattr(cfg, key) != default:
                    options[key] = getattr(cfg, key)
        try:
            wanted = replace(cfg, **family_fields(**options))
        except ConfigError as exc:
            raise ConfigError(f"{path} holds a {family_of(cfg)} model: {exc}") from None
        self.fresh_depths = ()
        if "mtp_depth" in given and wanted.mtp_depth > cfg.mtp_depth and not getattr(self, "full_state", False):
            # --init-from a model with fewer MTP depths: those it lacks start fresh (a resume stays refused)
            self.fresh_depths = tuple(range(cfg.mtp_depth, wanted.mtp_depth))
            self._fresh_note(path, cfg.mtp_depth, wanted.mtp_depth)
            cfg = replace(cfg, mtp_depth=wanted.mtp_depth)
        for option, value in MODEL_DEFINING.items():
            if option in given and value(wanted) != value(cfg):
                raise ConfigError(f"{path}: holds a model with {option} {value(cfg)}, this run asks for "
                                  f"{value(wanted)} (leave out --{_dash(option)} {leave_out})")
        return replace(cfg, **{k: getattr(wanted, k) for k in TRAINING_KNOBS if k in given})

    def _fresh_note(self, path, held: int, asked: int) -> None:
        """The one line saying which MTP depths start fresh (``fresh_depths``)."""
        new = f"depth {asked}" if asked - held == 1 else f"depths {held + 1}-{asked}"
        what = "no multi-token prediction depths" if not held else f"{held} multi-token prediction depth" + \
            ("s" * (held > 1))
        verb = "starts" if asked - held == 1 else "start"
        self.notes.append(f"note: {path} holds {what}: MTP {new} of --mtp-depth {asked} {verb} fresh (initialised "
                          f"as a fresh run with --seed {self.opts.seed} initialises {'it' if asked - held == 1 else 'them'})")

    def fresh_prefixes(self) -> tuple:
        """The parameter name prefixes of the MTP depths --init-from's file lacks."""
        L = self.cfg.n_layer
        return tuple(p for k in getattr(self, "fresh_depths", ()) for p in (f"mtp.{k}.", f"h.{L + k}."))

    def _restore(self) -> int:
        """Load parameters / state as asked; return the last completed step."""
        if self.model_file is None:
            return 0
        full = self.full_state
        with self.model_file as model_file:
            if model_file.kind != "mpicube" or not full:
                formats.load_params(model_file, self.parts.store, fresh=self.fresh_prefixes(), seed=self.opts.seed)
                if full:
                    self.notes.append(f"note: {model_file.path} holds no optimizer state: starting at step 0 "
                                      "with fresh AdamW moments")
                self.notes.append(f"initialized parameters from {model_file.describe()}")
                return 0
            ck = model_file.ck
            saved = saved_state(model_file)             # every value checked before any is used
            load_state(ck, self.parts.store, self.opt.adam, comm=self.world)
            self.opt.adam.t = saved.adam_t
            if self.scaler is not None and saved.loss_scale is not None:
                self.scaler.restore(saved.loss_scale)   # scale and counters: resume stays exact
            fp8 = self.parts.layout.fp8
            if fp8 is not None and fp8.recipe.name == "delayed":
                if saved.fp8 is not None:
                    fp8.restore(saved.fp8)              # the amax histories: delayed's scales resume exactly
                else:
                    self.notes.append(f"note: {ck.path} holds no --fp8 delayed amax history: it starts empty")
            step = saved.step
            self.notes.append(f"resuming from {ck.path} at step {step}")
            changed = self._changed_options(saved.train)
            if changed:
                self.notes.append("note: options differ from the checkpoint's run: " + ", ".join(changed))
            self.last_ckpt = ck.path
            return step

    def _changed_options(self, saved: dict) -> list:
        """Options that change the trajectory and differ from a resumed run's."""
        relevant = ("n_layer", "n_head", "n_embd", "seq_len", "batch_size", "steps", "lr", "warmup",
                    "weight_decay", "grad_clip", "optimizer", "muon_qkv", "dropout", "seed", "dtype", "data")
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

    def _write_run_files(self) -> list:
        """Rank 0: config.json written, metrics.jsonl opened; what to say
        about the metrics (lines passed over or cut)."""
        self._write_config()
        said = []
        # appended to, its records from the step this launch starts at cut
        # off (they are repeated); never rewritten
        self.metrics = rundir.open_metrics(self.run_dir, self.start_step, said)
        return said



def _str_or_none(path) -> Optional[str]:
    return None if path is None else str(path)
