"""``mpicube trace``: N training steps written tensor by tensor, as full
logical tensors, whatever layout ran them (format: docs/trace-format.md).

A final loss says that two implementations differ, not where. A trace
holds everything a step computes - the batches, the initial parameters,
and per step the activations after every block, the logits, the loss, the
gradients and the updated parameters - so ``mpicube compare`` can name the
first tensor at which another layout, or another framework, went wrong.

Each rank knows which block of every tensor it holds: parameters and
gradients by ``ParamSpec.index`` (what the checkpoint writer uses),
activations by the layout's ``canonical_seqs``/``canonical_cols``, logits
by the embedding's rows and vocabulary block, dropout masks by the indices
the masks were drawn at. Rank 0 gathers the blocks (a plain object gather
outside the counted communicators: a trace never changes the traffic it
would measure) and assembles each tensor, checking that every element
arrived - or, with ``--sharded``, writes every rank's block as it is, with
its global index, replicas included (check.shards), so that ``compare``
checks the replicas too. Traces are for small models; ``--max-bytes``
refuses big ones before anything runs.
"""

from __future__ import annotations

import json
import re
from dataclasses import fields
from pathlib import Path

import numpy as np

from .. import __version__
from ..check import shards
from ..check.names import FORMAT, VERSION
from ..check.writer import StagedFile
from ..core.errors import ConfigError, UserError
from ..files import formats
from ..model.gpt import gpt_params
from ..parallel.comm import on_root
from ..parallel.grid import default_batch
from ..training.hooks import StepHooks
from ..training.optim import Schedule
from ..training.options import TrainOptions
from ..training.train import DivergedError, Trainer
from ..check.placements import mesh_attr
from .trace_collect import Collector, Piece, gather_pieces, mesh_of, record_outputs
from .trace_fp8 import Fp8Recorder

DEFAULT_MAX_BYTES = 2 * 10 ** 9
CLIP_EPS = 1e-6          # clipping scale min(1, max_norm / (norm + CLIP_EPS)), as train does


# --------------------------------------------------------------------------- sizes


def parse_bytes(text) -> int:
    """``2GB``, ``500M``, ``64k`` or a plain number of bytes (decimal units)."""
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([kKmMgGtT]?)[bB]?\s*", str(text))
    scale = {"": 1, "k": 10 ** 3, "m": 10 ** 6, "g": 10 ** 9, "t": 10 ** 12}
    try:
        value = float(m.group(1)) * scale[m.group(2).lower()] if m else -1.0
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ConfigError(f"--max-bytes {text!r} is not a size: use bytes, or a number with K, M or G (2GB)")
    return int(value)


def trace_bytes(cfg, batch: int, seq_len: int, steps: int, dropout: float, itemsize: int) -> int:
    """Bytes of tensor data a trace of these sizes holds (HDF5 adds a little)."""
    B, T, h, L = batch, seq_len, cfg.n_embd, cfg.n_layer
    params = cfg.n_params()
    per_step = (2 * params + (5 * L + 2) * B * T * h + B * T * cfg.vocab_size + 3) * itemsize
    if cfg.moe:                                           # router logits (and scores), weights; int32 chosen experts
        per_step += L * B * T * (2 * cfg.n_experts + cfg.top_k) * itemsize + L * B * T * cfg.top_k * 4
    if dropout > 0:                                       # uint8 keep masks
        per_step += (2 * L + 1) * B * T * h + L * B * cfg.n_head * T * T
    return steps * B * (T + 1) * 4 + params * itemsize + steps * per_step


# --------------------------------------------------------------------------- the file


class TraceFile(StagedFile):
    """Rank 0's trace file, renamed into place when complete (``StagedFile``)."""

    def __init__(self, path: Path, attrs: dict):
        super().__init__(path)
        for key, value in attrs.items():
            self.f.attrs[key] = value

    def write(self, name: str, value) -> None:
        if isinstance(value, shards.Sharded):
            shards.write(self.f, name, value, value.shards[0].data.dtype)
        else:
            self.f.create_dataset(name, data=value)


def _check_out(path: Path) -> str:
    if path.is_dir():
        raise UserError(f"--out {path}: is a directory; give the trace file to write, e.g. {path}/trace.h5")
    if not path.parent.is_dir():
        raise UserError(f"--out {path}: directory {path.parent} does not exist")
    return str(path)


def _check_resumable(run_dir: Path) -> None:
    """--resume: a trace continues a checkpoint or nothing (train would
    start afresh, and a trace of steps 1.. would pass for a resumed one)."""
    from ..files import checkpoint

    if checkpoint.latest(run_dir) is None:
        raise UserError(f"--run-dir {run_dir}: no checkpoint to resume (trace --resume continues one)")


# --------------------------------------------------------------------------- the run


def optimizer_attr(opts, schedule: Schedule, steps: int, decayed: list) -> dict:
    """What another implementation needs to take the same optimizer steps
    (AdamW, or under --optimizer sgd plain SGD: no moments, no decay)."""
    lr = {"schedule": "linear warmup to peak over warmup steps, then cosine decay to min_lr at steps "
                      "(step s is 1-based)",
          "peak": schedule.lr, "warmup": schedule.warmup, "steps": schedule.steps,
          "min_lr": schedule.lr * schedule.min_lr_ratio,
          "values": [schedule(s) for s in range(1, steps + 1)]}
    clip = {"max_norm": opts.grad_clip, "eps": CLIP_EPS,
            "rule": "every gradient scaled by min(1, max_norm / (norm + eps)), norm the global L2 "
                    "norm of all gradients; max_norm 0 = no clipping"}
    if opts.optimizer == "muon":
        from ..training import muon

        return {"name": "Muon", "lr": lr, "momentum": 0.95, "nesterov": True, "ns_steps": muon.NS_STEPS,
                "ns_coefficients": list(muon.NS_COEFFICIENTS), "qkv": opts.muon_qkv, "weight_decay": opts.weight_decay,
                "rule": "hidden matrices (linears' weights): buf = 0.95 buf + 0.05 g; u = 0.05 g + 0.95 buf; "
                        "p = p (1 - lr wd) - lr NS5(u^T)^T sqrt(max(1, out/in)); the rest: AdamW, betas "
                        "[0.9, 0.95], eps 1e-8, decoupled decay on 'decay' (training/muon.py)",
                "decay": decayed, "grad_clip": clip}
    if opts.optimizer == "sgd":
        return {"name": "SGD", "lr": lr, "momentum": 0.0, "weight_decay": 0.0, "decay": [],
                "rule": "p -= lr * g, g the clipped gradient", "grad_clip": clip}
    return {
        "name": "AdamW",
        "lr": lr,
        "betas": [0.9, 0.95],
        "eps": 1e-8,
        "weight_decay": opts.weight_decay,
        "decay": decayed,
        "decay_rule": "decoupled (p -= lr * weight_decay * p) on the tensors in 'decay' only",
        "grad_clip": clip,
    }


class Recorder(StepHooks):
    """The trainer's observer that writes the trace: the initial
    parameters when the run starts; per step the batch, each micro-batch's
    activations, logits and dropout masks after its forward, the summed
    gradients before the update and the updated parameters after it.
    Rank 0 assembles and writes; every rank takes part in the gathers."""

    def __init__(self, mpi_world, writer, store_dtype, say, sharded: bool = False, state: bool = False):
        self.world, self.writer, self.store_dtype, self.say = mpi_world, writer, store_dtype, say
        self.sharded = sharded
        self.state = state               # --state: the moments, loss scale, RNG offset and expert loads too
        self.tokens = []                 # rank 0: (B, T+1) int32 per step

    def run_started(self, trainer) -> None:
        self.collect = Collector(trainer.parts, self.store_dtype, trainer.opts.batch_size, self.sharded)
        self.sink = {}                   # each micro-batch's outputs of the embeddings, blocks and ln_f
        pipe = trainer.parts.pipeline
        models = [pipe.chunk_model(v) for v in range(pipe.V)] if pipe is not None else [trainer.parts.model.model]
        for model in models:
            record_outputs(model, self.sink)
        self.T = trainer.opts.seq_len
        fp8 = trainer.parts.layout.fp8
        self.fp8 = None if fp8 is None else Fp8Recorder(trainer.parts.store, self.collect, self.T)   # --fp8's operands
        if fp8 is not None:
            fp8.observer = self.fp8
            self.fp8.watch(models)                           # where an expert's rows lie among serial's
        self.mesh = None                 # rank 0 under --sharded: (sizes, every rank's coords)
        if self.sharded:
            axes, sizes, coords = mesh_of(trainer.parts.layout)
            everyone = self.world.gather(coords, root=0)
            if self.writer is not None:
                self.mesh = (sizes, everyone)
                self.writer.f.attrs["mesh"] = mesh_attr(axes, sizes)
        _write(self.writer, self.gather(self.collect.params("init")))

    def gather(self, pieces: list):
        return gather_pieces(self.world, pieces, self.sharded, self.mesh)

    def step_started(self, trainer, s, x, y) -> None:
        self.tokens.append(np.concatenate([x, y[:, -1:]], axis=1).astype(np.int32))   # (B, T+1)
        self.forward = []
        self.sink.clear()
        self.biases = router_biases(trainer.parts.store, np.float64)      # {layer site: (E,)} before the step

    def forward_done(self, trainer, s, micro) -> None:
        parts, collect = trainer.parts, self.collect
        collect.at(parts.micro_rows(micro).start)
        self.forward += collect.activations(self.sink, self.T) + collect.router(self.sink, self.T)
        self.forward += collect.logits(self.T)
        self.forward += collect.masks(self.T, s)
        self.sink.clear()                                     # the next micro-batch's

    def gradients_ready(self, trainer, s, loss, norm, loss_scale, skipped) -> None:
        if skipped:
            raise DivergedError(f"trace: step {s}: float16 gradients overflowed at loss scale {loss_scale:g} "
                                "and a trace cannot skip a step: pass a smaller --loss-scale; nothing written")
        self.grads = self.collect.grads(divide=loss_scale)
        self.norm = norm

    def step_done(self, trainer, s, rec) -> None:
        moments = (self.collect.moments(trainer.opt.adam) if self.state and trainer.opts.optimizer != "sgd" else [])
        quantized = self.fp8.take(self.world) if self.fp8 is not None else []
        updates = bias_updates(self.biases, router_biases(trainer.parts.store, np.float64), self.store_dtype)
        tensors = self.gather(self.forward + self.grads + quantized + moments + updates + self.collect.params("param"))
        state = self.state_scalars(trainer, s) if self.state else {}
        if self.writer is not None:
            group = f"step_{s}"
            self.writer.write(f"{group}/loss", np.asarray(rec["loss"], dtype=np.float64))
            self.writer.write(f"{group}/lr", np.asarray(rec["lr"], dtype=np.float64))
            self.writer.write(f"{group}/grad_norm", np.asarray(self.norm, dtype=np.float64))
            for key in ("aux_loss", "z_loss"):                # a mixture of experts' router losses
                if f"router_{key}" in rec:
                    self.writer.write(f"{group}/moe/{key}", np.asarray(rec[f"router_{key}"], dtype=np.float64))
            for key in [k for k in rec if k == "main_loss" or k.startswith("mtp_loss_")]:   # --mtp-depth's
                self.writer.write(f"{group}/mtp/{key[4:] if key.startswith('mtp_') else key}",
                                  np.asarray(rec[key], dtype=np.float64))
            _write(self.writer, {**tensors, **state}, prefix=group + "/")
        self.say(f"step {s}/{trainer.opts.steps}: loss {rec['loss']:.6f}, lr {rec['lr']:.3e}, "
                 f"grad_norm {self.norm:.6f}")


    def state_scalars(self, trainer, s: int) -> dict:
        """Rank 0's {name: value} of the state beside the moments: the loss
        scale after step s's update (float16 runs), the RNG offset (the
        step the next draws are keyed by: mpicube's masks are a function of
        the step, names.STATE_SCALARS) and a mixture's expert loads,
        counted from its chosen experts (every rank takes part in the gather)."""
        chosen = gather_pieces(self.world, [p for p in self.forward if p.name.endswith(".experts")])
        if self.writer is None:
            return {}
        out = {"state/rng_offset": np.asarray(s, dtype=np.int64)}
        if trainer.scaler is not None:
            out["state/loss_scale"] = np.asarray(trainer.scaler.scale, dtype=np.float64)
        for name, experts in chosen.items():                   # moe/h.{i}.experts (B, T, K)
            site = name[len("moe/"):-len(".experts")]
            out[f"state/expert_load/{site}"] = np.bincount(experts.ravel(), minlength=trainer.parts.cfg.n_experts
                                                           ).astype(np.int64)                      # (E,)
        return out


BIAS_SUFFIX = ".moe.router.score_bias"      # a sigmoid router's bias buffer in the store (model/routers.py)


def router_biases(store, dtype) -> dict:
    """{"h.{i}": (E,) host copy} of the sigmoid routers' biases this rank's
    store holds (a pipeline stage: its own layers'), at this moment."""
    return {name[:-len(BIAS_SUFFIX)]: np.array(store.backend.to_host(value), dtype=dtype)      # a copy
            for name, value in store.persistent.items() if name.endswith(BIAS_SUFFIX)}


def bias_updates(before: dict, after: dict, dtype) -> list:
    """Pieces ``moe/h.{i}.bias_update`` (E,): what the step's aux-loss-free
    update added to each bias (after - before, in float64 then the trace's
    dtype). Every rank holds the whole bias and gives its copy: a rank
    that updated from other loads than the others shows as replicas that
    part in a sharded trace."""
    return [Piece(f"moe/{site}.bias_update", bias.shape, (np.arange(bias.shape[0]),),
                  (after[site] - bias).astype(dtype)) for site, bias in sorted(before.items())]


def run_trace(options: dict, mpi_world, say=print) -> dict:
    """``mpicube trace``: ``options`` are the command's (train's names, plus
    ``out`` = the trace file and ``max_bytes``). The steps are the
    trainer's own (``training.train.Trainer`` with a ``Recorder``
    observing it and no run directory), so every training option traces.
    Returns a summary."""
    known = {f.name for f in fields(TrainOptions)}
    opts = TrainOptions(**{k: v for k, v in options.items() if k in known and k != "out"})
    out, max_bytes = Path(options["out"]), parse_bytes(options.get("max_bytes", DEFAULT_MAX_BYTES))
    run_dir = options.get("run_dir")
    if opts.resume and run_dir is None:
        raise UserError("trace --resume continues a run directory's checkpoint: give --run-dir RUN_DIR")
    opts.out = run_dir                          # --run-dir: config, metrics and checkpoints, as train --out
    opts.validate()
    cfg = opts.model_config()
    if opts.init_from is not None:              # the model's shape comes from the file, as in train
        with formats.open_everywhere(mpi_world, opts.init_from) as model_file:
            cfg = model_file.config
    if opts.batch_size is None:                 # train's default: the smallest of at least 8 that fits
        opts.batch_size = default_batch(opts.plan, cfg, mpi_world.Get_size())[0]
    B, T, N = opts.batch_size, opts.seq_len, opts.steps
    store_dtype = np.float64 if opts.dtype == "float64" else np.float32
    size = trace_bytes(cfg, B, T, N, opts.dropout, np.dtype(store_dtype).itemsize)
    if size > max_bytes:
        raise UserError(f"the trace would hold {size / 1e6:,.0f} MB, more than --max-bytes {max_bytes / 1e6:,.0f} MB: "
                        f"trace fewer --steps or a smaller model (traces are for small models)")
    on_root(mpi_world, lambda: _check_out(out))
    if opts.resume:
        on_root(mpi_world, lambda: _check_resumable(Path(run_dir)))
    rank = mpi_world.Get_rank()

    writer = None
    if rank == 0:
        decayed = [d.name for d in gpt_params(cfg) if d.decay]
        schedule = Schedule(opts.lr, opts.warmup, N)
        attrs = {
            "format": FORMAT,
            "version": VERSION,
            "config": json.dumps(cfg.to_dict()),
            "optimizer": json.dumps(optimizer_attr(opts, schedule, N, decayed)),
            "dtype": opts.dtype,
            "steps": N,
            "dropout": opts.dropout,
            "seed": opts.seed,
        }
        recipe = opts.fp8_recipe()
        if recipe is not None:          # what compare's FP8 unit needs (check/fp8_tolerance.py)
            attrs["fp8"] = json.dumps({"recipe": recipe.name, "grad_format": recipe.grad_format,
                                       "accumulate": recipe.accumulate, "block": recipe.block,
                                       "pow2": recipe.power_of_2})
        writer = TraceFile(out, attrs)
    recorder = Recorder(mpi_world, writer, store_dtype, say, sharded=bool(options.get("sharded")),
                        state=bool(options.get("state")))
    trainer = Trainer(opts, mpi_world, hooks=[recorder], keep_files=run_dir is not None)
    try:
        status = trainer.run()
        if status != 0:
            raise UserError(f"trace: stopped early (exit status {status}); nothing written")
        layout, first = trainer.parts.layout, trainer.start_step
        if first > opts.last_step:
            raise UserError(f"trace: --run-dir {run_dir} is already at step {first - 1}: no step left to trace "
                            f"up to {opts.last_step}; nothing written")
        if writer is not None:
            writer.f.attrs["layout"] = json.dumps({**layout.describe(), "world_size": mpi_world.Get_size(),
                                                   "device": opts.device, "producer": f"mpicube {__version__}"})
            if first > 1:                       # a resumed run's: init/ holds the parameters it read back
                writer.f.attrs["first_step"] = first
            writer.write("tokens", np.stack(recorder.tokens))                # (N, B, T+1)
            writer.commit()
    except BaseException:
        if writer is not None:
            writer.discard()
        raise
    size = out.stat().st_size if rank == 0 else 0
    traced = f"{N} steps" if (first, opts.last_step) == (1, N) else f"steps {first} to {opts.last_step} of {N}"
    say(f"wrote {out}: {traced} of {layout.name} on {mpi_world.Get_size()} rank(s), {size / 1e6:.1f} MB")
    return {"path": str(out), "steps": N, "first": first, "last": opts.last_step, "bytes": size,
            "layout": layout.describe()}


def _write(writer, tensors, prefix: str = "") -> None:
    if writer is None:
        return
    for name in sorted(tensors):
        writer.write(prefix + name, tensors[name])
