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
arrived. Traces are for small models; ``--max-bytes`` refuses big ones
before anything runs.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np

from .. import __version__
from ..core.errors import ConfigError, UserError
from ..files import formats
from ..model.gpt import gpt_params
from ..parallel import context
from ..parallel.comm import on_root
from ..parallel.grid import default_batch
from ..training.driver import rank_positions
from ..training.hooks import StepHooks
from ..training.optim import Schedule
from ..training.options import TrainOptions
from ..training.train import DivergedError, Trainer

FORMAT = "mpicube-trace"
VERSION = 1
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
    per_step = (2 * params + (L + 2) * B * T * h + B * T * cfg.vocab_size + 3) * itemsize
    if dropout > 0:                                       # uint8 keep masks
        per_step += (2 * L + 1) * B * T * h + L * B * cfg.n_head * T * T
    return steps * B * (T + 1) * 4 + params * itemsize + steps * per_step


# --------------------------------------------------------------------------- gathering blocks


@dataclass
class Piece:
    """One rank's block of a logical tensor: ``local[i0, i1, ...]`` is the
    element at ``(index[0][i0], index[1][i1], ...)``; indices at or past
    ``shape`` (vocabulary padding) are dropped."""

    name: str             # dataset path in the trace, e.g. "act/h.1"
    shape: tuple          # global logical shape
    index: tuple          # per dimension: global indices of the local block
    local: np.ndarray     # host array


def gather_pieces(mpi_world, pieces: list):
    """Rank 0: {name: full tensor} assembled from every rank's pieces; other
    ranks: None. Replicated blocks simply arrive more than once; an element
    no rank sent is a bug in a layout's bookkeeping, and raises."""
    received = mpi_world.gather(pieces, root=0)
    if received is None:
        return None
    full, seen = {}, {}
    for piece in (p for rank_pieces in received for p in rank_pieces):
        if piece.name not in full:
            full[piece.name] = np.zeros(piece.shape, dtype=piece.local.dtype)
            seen[piece.name] = np.zeros(piece.shape, dtype=bool)
        real = [np.flatnonzero(ix < n) for ix, n in zip(piece.index, piece.shape)]
        target = np.ix_(*[np.asarray(ix)[r] for ix, r in zip(piece.index, real)])
        full[piece.name][target] = piece.local[np.ix_(*real)]
        seen[piece.name][target] = True
    for name, mask in seen.items():
        if not mask.all():
            raise RuntimeError(f"trace: {int((~mask).sum())} elements of {name} were held by no rank")
    return full


class Collector:
    """Turns one rank's model state into pieces: global indices of its
    activation, logit, mask and parameter blocks. ``at(first)`` points it
    at a micro-batch whose first sequence is global sequence ``first``."""

    def __init__(self, parts, store_dtype, batch_size: int):
        self.parts = parts
        self.layout, self.store = parts.layout, parts.store
        self.dtype = np.dtype(store_dtype)
        self.B = batch_size                                  # global sequences per step
        self.cfg = parts.cfg
        self.cols = np.asarray(self.layout.canonical_cols)
        self.heads = np.asarray(self.layout.head_ids)
        self.param_writer = self.layout.axes.dp.rank == 0 and self.layout.axes.cp.rank == 0
        self.at(parts.micro_rows(0).start)

    @property
    def current(self):
        """(GPT, tape) of the forward that ran last: the model's, or under
        pipeline stages the chunk's (training.pipeline.Pipeline.current);
        each chunk gives the pieces of the tensors it computes, so rank 0
        assembles the same names as without stages."""
        pipe = self.parts.pipeline
        if pipe is not None:
            return pipe.current
        return self.parts.model.model, self.parts.model.tape

    def at(self, first: int) -> None:
        layout = self.layout
        self.first = first
        self.canonical_seqs = first + np.asarray(layout.canonical_seqs)
        self.mid_seqs = first + np.asarray(layout.mid_seqs)

    def positions(self, T: int) -> np.ndarray:
        """(T_l,) the global positions of this rank's rows of a T-long
        sequence: all of them, or a cp rank's two chunks."""
        ring = self.layout.axes.cp
        return context.local_positions(T, ring.size, ring.rank)

    def canonical_positions(self, T: int) -> np.ndarray:
        """(T_c,) the global positions of this rank's canonical rows: the
        step driver's (``driver.rank_positions``: a run of T/tp under
        --sequence-parallel, of the cp rank's positions under --cp too),
        else ``positions``."""
        pos = rank_positions(self.layout, T)
        return np.arange(T) if pos is None else pos

    def host(self, a, dtype=None) -> np.ndarray:
        return np.asarray(self.parts.backend.to_host(a)).astype(dtype or self.dtype)

    def canonical(self, name, block, T, dtype=None) -> Piece:
        """(B_c, T, C_c) block -> piece of the (B, T, h) tensor."""
        return Piece(name, (self.B, T, self.cfg.n_embd), (self.canonical_seqs, self.canonical_positions(T),
                                                             self.cols), self.host(block, dtype))

    def activations(self, capture: dict, T: int) -> list:
        return [self.canonical(f"act/{key}", block, T) for key, block in capture.items()]

    def logits(self, T: int) -> list:
        """(B_l, T, V_l) -> piece of (B, T, V); padded vocabulary dropped
        (none from a pipeline chunk without the head)."""
        model, tape = self.current
        if not model.last:
            return []
        emb = model.embedding
        local = tape.back[0][1][0]                             # (B_l, T, V_l): the loss head's saved logits
        vocab = emb.vocab_start + np.arange(local.shape[-1])
        seqs = self.first + np.asarray(emb.logit_seqs)
        return [Piece("logits", (self.B, T, self.cfg.vocab_size), (seqs, self.positions(T), vocab),
                      self.host(local))]

    def masks(self, T: int, step: int) -> list:
        """Keep masks (1 kept, 0 dropped) as uint8, none without dropout.
        Drawn again from the micro-batch's context: they are a function of
        (seed, step, site, global index), so the second draw is the one
        forward applied (and a block that let go of its masks, under
        --recompute blocks, needs no special case)."""
        model, tape = self.current
        drop, ctx = model.dropout, tape.ctx
        if not drop.on(ctx):
            return []
        keep = lambda m: self.host(m != 0, np.uint8)           # noqa: E731 - scaled masks to 0/1
        pieces = []
        pos, rows = self.positions(T), self.canonical_positions(T)          # attention rows, canonical rows
        if model.first:
            pieces.append(Piece("dropout/emb", (self.B, T, self.cfg.n_embd),
                                (self.canonical_seqs, rows, self.cols), keep(drop.canonical(ctx, "emb", len(rows)))))
        for block in model.blocks:
            site = block.site
            by_blocks = drop.attention_blocks(ctx, site + ".attn", T)
            c = len(pos) // 2 if len(pos) != T else T          # rows: two contiguous chunks on a cp rank
            attn = np.concatenate([self.host(by_blocks(slice(int(p0), int(p0) + c), slice(0, T)))
                                   for p0 in pos[::c]], axis=2)
            shape = (self.B, self.cfg.n_head, T, T)
            index = (self.mid_seqs, self.heads, pos, np.arange(T))
            pieces.append(Piece(f"dropout/{site}.attn", shape, index, keep(attn)))
            for name in ("resid_attn", "resid_mlp"):
                mask = drop.canonical(ctx, f"{site}.{name}", len(rows))
                pieces.append(Piece(f"dropout/{site}.{name}", (self.B, T, self.cfg.n_embd),
                                    (self.canonical_seqs, rows, self.cols), keep(mask)))
        return pieces

    def params(self, prefix: str) -> list:
        """One copy of every parameter. ``full_master`` serves every mode
        (under a sharded 16-bit master it all-gathers over dp, so every
        rank calls this)."""
        return self._pieces(prefix, self.store.views(self.store.full_master()))

    def grads(self, divide: float = 1.0) -> list:
        """One copy of every summed gradient, ``divide`` = the loss scale it
        carries. Under --zero 1 a rank holds only its chunk of the sum, so
        the chunks are put together here with an uncounted object
        all-gather over dp (every rank calls this)."""
        store = self.store
        flat = self.host(store.flat_grad)                                    # (P_pad,)
        if store.partition.sharded:
            chunks = self.layout.axes.dp.mpi.allgather(flat[store.shard])   # dp x (C,)
            flat = store.partition.assemble(np, np.concatenate(chunks))     # (P_pad,) in buffer order
        if divide != 1.0:
            flat = flat / divide
        return self._pieces("grad", store.views(flat))

    def _pieces(self, prefix: str, views: dict) -> list:
        return [Piece(f"{prefix}/{spec.name}", tuple(spec.decl.shape), spec.index, self.host(views[spec.name]))
                for spec in self.store.specs if spec.writer and self.param_writer]


# --------------------------------------------------------------------------- the file


class TraceFile:
    """Rank 0's HDF5 file, written under a temporary name and renamed into
    place when complete, so a failed run never leaves a partial trace."""

    def __init__(self, path: Path, attrs: dict):
        import h5py

        self.path = path
        self.tmp = path.with_name(f".{path.name}.tmp")
        self.f = h5py.File(self.tmp, "w")
        for key, value in attrs.items():
            self.f.attrs[key] = value

    def write(self, name: str, value) -> None:
        self.f.create_dataset(name, data=value)

    def commit(self) -> None:
        self.f.close()
        os.replace(self.tmp, self.path)

    def discard(self) -> None:
        try:
            self.f.close()
        finally:
            self.tmp.unlink(missing_ok=True)


def _check_out(path: Path) -> str:
    if path.is_dir():
        raise UserError(f"--out {path}: is a directory; give the trace file to write, e.g. {path}/trace.h5")
    if not path.parent.is_dir():
        raise UserError(f"--out {path}: directory {path.parent} does not exist")
    return str(path)


# --------------------------------------------------------------------------- the run


def optimizer_attr(opts, schedule: Schedule, steps: int, decayed: list) -> dict:
    """What another implementation needs to take the same optimizer steps."""
    return {
        "name": "AdamW",
        "lr": {"schedule": "linear warmup to peak over warmup steps, then cosine decay to min_lr at steps "
                           "(step s is 1-based)",
               "peak": schedule.lr, "warmup": schedule.warmup, "steps": schedule.steps,
               "min_lr": schedule.lr * schedule.min_lr_ratio,
               "values": [schedule(s) for s in range(1, steps + 1)]},
        "betas": [0.9, 0.95],
        "eps": 1e-8,
        "weight_decay": opts.weight_decay,
        "decay": decayed,
        "decay_rule": "decoupled (p -= lr * weight_decay * p) on the tensors in 'decay' only",
        "grad_clip": {"max_norm": opts.grad_clip, "eps": CLIP_EPS,
                      "rule": "every gradient scaled by min(1, max_norm / (norm + eps)), norm the global L2 "
                              "norm of all gradients; max_norm 0 = no clipping"},
    }


class Observed:
    """A model piece whose output is copied into ``sink[name]`` after each
    forward: how a trace sees the activations between blocks without the
    model knowing it is watched. Everything else passes to the piece."""

    def __init__(self, inner, name: str, sink: dict):
        self.inner, self.name, self.sink = inner, name, sink

    def forward(self, x, *args):
        y, saved = self.inner.forward(x, *args)
        self.sink[self.name] = y.copy()                     # (B_c, T_c, C_c)
        return y, saved

    def __getattr__(self, attr):
        return getattr(self.inner, attr)


def record_outputs(model, sink: dict) -> None:
    """Wrap ``model``'s embeddings, blocks and final norm in ``Observed``:
    their outputs land in ``sink`` as "emb", "h.{i}" and "ln_f", in the
    order computed."""
    model.front = [Observed(piece, "emb", sink) for piece in model.front]
    model.blocks = [Observed(block, block.site, sink) for block in model.blocks]
    for head in model.back:
        head.ln_f = Observed(head.ln_f, "ln_f", sink)


class Recorder(StepHooks):
    """The trainer's observer that writes the trace: the initial
    parameters when the run starts; per step the batch, each micro-batch's
    activations, logits and dropout masks after its forward, the summed
    gradients before the update and the updated parameters after it.
    Rank 0 assembles and writes; every rank takes part in the gathers."""

    def __init__(self, mpi_world, writer, store_dtype, say):
        self.world, self.writer, self.store_dtype, self.say = mpi_world, writer, store_dtype, say
        self.tokens = []                 # rank 0: (B, T+1) int32 per step

    def run_started(self, trainer) -> None:
        self.collect = Collector(trainer.parts, self.store_dtype, trainer.opts.batch_size)
        self.sink = {}                   # each micro-batch's outputs of the embeddings, blocks and ln_f
        pipe = trainer.parts.pipeline
        for model in [pipe.chunk_model(v) for v in range(pipe.V)] if pipe is not None else [trainer.parts.model.model]:
            record_outputs(model, self.sink)
        self.T = trainer.opts.seq_len
        _write(self.writer, gather_pieces(self.world, self.collect.params("init")))

    def step_started(self, trainer, s, x, y) -> None:
        self.tokens.append(np.concatenate([x, y[:, -1:]], axis=1).astype(np.int32))   # (B, T+1)
        self.forward = []
        self.sink.clear()

    def forward_done(self, trainer, s, micro) -> None:
        parts, collect = trainer.parts, self.collect
        collect.at(parts.micro_rows(micro).start)
        self.forward += collect.activations(self.sink, self.T) + collect.logits(self.T)
        self.forward += collect.masks(self.T, s)
        self.sink.clear()                                     # the next micro-batch's

    def gradients_ready(self, trainer, s, loss, norm, loss_scale, skipped) -> None:
        if skipped:
            raise DivergedError(f"trace: step {s}: float16 gradients overflowed at loss scale {loss_scale:g} "
                                "and a trace cannot skip a step: pass a smaller --loss-scale; nothing written")
        self.grads = self.collect.grads(divide=loss_scale)
        self.norm = norm

    def step_done(self, trainer, s, rec) -> None:
        tensors = gather_pieces(self.world, self.forward + self.grads + self.collect.params("param"))
        if self.writer is not None:
            group = f"step_{s}"
            self.writer.write(f"{group}/loss", np.asarray(rec["loss"], dtype=np.float64))
            self.writer.write(f"{group}/lr", np.asarray(rec["lr"], dtype=np.float64))
            self.writer.write(f"{group}/grad_norm", np.asarray(self.norm, dtype=np.float64))
            _write(self.writer, tensors, prefix=group + "/")
        self.say(f"step {s}/{trainer.opts.steps}: loss {rec['loss']:.6f}, lr {rec['lr']:.3e}, "
                 f"grad_norm {self.norm:.6f}")


def run_trace(options: dict, mpi_world, say=print) -> dict:
    """``mpicube trace``: ``options`` are the command's (train's names, plus
    ``out`` = the trace file and ``max_bytes``). The steps are the
    trainer's own (``training.train.Trainer`` with a ``Recorder``
    observing it and no run directory), so every training option traces.
    Returns a summary."""
    known = {f.name for f in fields(TrainOptions)}
    opts = TrainOptions(**{k: v for k, v in options.items() if k in known and k != "out"})
    out, max_bytes = Path(options["out"]), parse_bytes(options.get("max_bytes", DEFAULT_MAX_BYTES))
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
        writer = TraceFile(out, attrs)
    recorder = Recorder(mpi_world, writer, store_dtype, say)
    trainer = Trainer(opts, mpi_world, hooks=[recorder], keep_files=False)
    try:
        status = trainer.run()
        if status != 0:
            raise UserError(f"trace: stopped early (exit status {status}); nothing written")
        layout = trainer.parts.layout
        if writer is not None:
            writer.f.attrs["layout"] = json.dumps({**layout.describe(), "world_size": mpi_world.Get_size(),
                                                   "device": opts.device, "producer": f"mpicube {__version__}"})
            writer.write("tokens", np.stack(recorder.tokens))                # (N, B, T+1)
            writer.commit()
    except BaseException:
        if writer is not None:
            writer.discard()
        raise
    size = out.stat().st_size if rank == 0 else 0
    say(f"wrote {out}: {N} steps of {layout.name} on {mpi_world.Get_size()} rank(s), {size / 1e6:.1f} MB")
    return {"path": str(out), "steps": N, "bytes": size, "layout": layout.describe()}


def _write(writer, tensors, prefix: str = "") -> None:
    if writer is None:
        return
    for name in sorted(tensors):
        writer.write(prefix + name, tensors[name])
