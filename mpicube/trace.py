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
import math
import os
import re
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np

from . import __version__, data
from .comm import agree_max, on_root
from .errors import ConfigError, UserError
from .grid import default_batch, plan
from .model import gpt_params
from .optim import AdamW, Schedule, global_grad_norm, sync_gradients

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
    activation, logit, mask and parameter blocks."""

    def __init__(self, parts, store_dtype):
        self.parts = parts
        self.layout, self.store, self.model = parts.layout, parts.store, parts.model
        self.dtype = np.dtype(store_dtype)
        cfg, layout = parts.cfg, parts.layout
        first = layout.axes.dp.rank * layout.local_batch     # this replica's first global sequence
        self.B = layout.batch_size
        self.canonical_seqs = first + np.asarray(layout.canonical_seqs)
        self.mid_seqs = first + np.asarray(layout.mid_seqs)
        self.logit_seqs = first + np.asarray(self.model.embedding.logit_seqs)
        self.cols = np.asarray(layout.canonical_cols)
        self.heads = np.asarray(layout.head_ids)
        self.cfg = cfg
        self.param_writer = layout.axes.dp.rank == 0

    def host(self, a, dtype=None) -> np.ndarray:
        return np.asarray(self.parts.backend.to_host(a)).astype(dtype or self.dtype)

    def canonical(self, name, block, T, dtype=None) -> Piece:
        """(B_c, T, C_c) block -> piece of the (B, T, h) tensor."""
        return Piece(name, (self.B, T, self.cfg.n_embd), (self.canonical_seqs, np.arange(T), self.cols),
                     self.host(block, dtype))

    def activations(self, capture: dict, T: int) -> list:
        return [self.canonical(f"act/{key}", block, T) for key, block in capture.items()]

    def logits(self, T: int) -> Piece:
        """(B_l, T, V_l) -> piece of (B, T, V); padded vocabulary dropped."""
        emb = self.model.embedding
        local = self.model.logits                              # (B_l, T, V_l)
        vocab = emb.vocab_start + np.arange(local.shape[-1])
        return Piece("logits", (self.B, T, self.cfg.vocab_size), (self.logit_seqs, np.arange(T), vocab),
                     self.host(local))

    def masks(self, T: int) -> list:
        """Keep masks (1 kept, 0 dropped) as uint8, none without dropout."""
        model = self.model
        if model.keep_emb is None:
            return []
        keep = lambda m: self.host(m != 0, np.uint8)           # noqa: E731 - scaled masks to 0/1
        pieces = [Piece("dropout/emb", (self.B, T, self.cfg.n_embd),
                        (self.canonical_seqs, np.arange(T), self.cols), keep(model.keep_emb))]
        for block in model.blocks:
            shape = (self.B, self.cfg.n_head, T, T)
            index = (self.mid_seqs, self.heads, np.arange(T), np.arange(T))
            pieces.append(Piece(f"dropout/{block.site}.attn", shape, index, keep(block.keep_attn)))
            for site, mask in (("resid_attn", block.keep_resid_attn), ("resid_mlp", block.keep_resid_mlp)):
                pieces.append(Piece(f"dropout/{block.site}.{site}", (self.B, T, self.cfg.n_embd),
                                    (self.canonical_seqs, np.arange(T), self.cols), keep(mask)))
        return pieces

    def params(self, prefix: str, which: str, divide: float = 1.0) -> list:
        """One copy of every parameter (``which`` = "data") or gradient
        ("grad", ``divide`` = the loss scale it carries)."""
        views = getattr(self.store, which)
        return [Piece(f"{prefix}/{spec.name}", tuple(spec.decl.shape), spec.index,
                      self.host(views[spec.name]) / divide if divide != 1.0 else self.host(views[spec.name]))
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


def run_trace(options: dict, mpi_world, say=print) -> dict:
    """``mpicube trace``: ``options`` are the command's (train's names, plus
    ``out`` = the trace file and ``max_bytes``). Returns a summary."""
    from .train import DivergedError, TrainOptions, build_parts, resolve_data

    known = {f.name for f in fields(TrainOptions)}
    opts = TrainOptions(**{k: v for k, v in options.items() if k in known and k != "out"})
    out, max_bytes = Path(options["out"]), parse_bytes(options.get("max_bytes", DEFAULT_MAX_BYTES))
    opts.validate()
    cfg = opts.model_config()
    model_file = None
    if opts.init_from is not None:              # the model's shape comes from the file, as in train
        from . import formats

        model_file = formats.open_everywhere(mpi_world, opts.init_from)
        cfg = model_file.config
        if opts.seq_len > cfg.n_ctx:
            raise ConfigError(f"--seq-len {opts.seq_len} is longer than the context of {model_file.describe()} "
                              f"({cfg.n_ctx} positions)")
    if opts.batch_size is None:                 # train's default: the smallest of at least 8 that fits
        opts.batch_size = default_batch(opts.layout, cfg, mpi_world.Get_size(), opts.dp, opts.depth)[0]
    B, T, N = opts.batch_size, opts.seq_len, opts.steps
    plan(opts.layout, cfg, B, mpi_world.Get_size(), opts.dp, opts.depth)
    store_dtype = np.float64 if opts.dtype == "float64" else np.float32
    size = trace_bytes(cfg, B, T, N, opts.dropout, np.dtype(store_dtype).itemsize)
    if size > max_bytes:
        raise UserError(f"the trace would hold {size / 1e6:,.0f} MB, more than --max-bytes {max_bytes / 1e6:,.0f} MB: "
                        f"trace fewer --steps or a smaller model (traces are for small models)")
    on_root(mpi_world, lambda: _check_out(out))
    rank = mpi_world.Get_rank()

    train_path, _ = resolve_data(mpi_world, opts.data)
    loader = data.TrainLoader(data.read_shard(train_path), B, T, opts.seed)
    tokens = np.stack([np.concatenate([x, y[:, -1:]], axis=1) for x, y in (loader.batch(s) for s in range(N))])
    tokens = tokens.astype(np.int32)                            # (N, B, T+1)
    if tokens.max() >= cfg.vocab_size:
        raise UserError(f"{train_path}: holds token {int(tokens.max())}, outside the model's vocabulary "
                        f"of {cfg.vocab_size}")

    parts = build_parts(cfg, opts.layout, B, mpi_world, opts.dp, opts.depth, opts.dtype, opts.device,
                        opts.seed, opts.dropout, opts.tf32)
    if model_file is not None:
        from . import formats

        with model_file:
            formats.load_params(model_file, parts.store)
    opt = AdamW(parts.store, weight_decay=opts.weight_decay)
    scaler = opts.loss_scaler()                                 # float16 only: dynamic loss scaling
    schedule = Schedule(opts.lr, opts.warmup, N)
    collect = Collector(parts, store_dtype)
    layout = parts.layout

    writer = None
    if rank == 0:
        decayed = [d.name for d in gpt_params(cfg) if d.decay]
        attrs = {
            "format": FORMAT,
            "version": VERSION,
            "config": json.dumps(cfg.to_dict()),
            "optimizer": json.dumps(optimizer_attr(opts, schedule, N, decayed)),
            "dtype": opts.dtype,
            "layout": json.dumps({**layout.describe(), "world_size": mpi_world.Get_size(), "device": opts.device,
                                  "producer": f"mpicube {__version__}"}),
            "steps": N,
            "dropout": opts.dropout,
            "seed": opts.seed,
        }
        writer = TraceFile(out, attrs)
    try:
        if writer is not None:
            writer.write("tokens", tokens)
        _write(writer, gather_pieces(mpi_world, collect.params("init", "data")))
        rows = parts.rows
        for s in range(1, N + 1):
            x, y = tokens[s - 1, :, :-1], tokens[s - 1, :, 1:]       # (B, T) each
            with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
                parts.store.zero_grad()
                parts.model.capture = {}
                loss = parts.model.forward(x[rows], y[rows], step=s)
                forward = collect.activations(parts.model.capture, T) + [collect.logits(T)] + collect.masks(T)
                parts.model.capture = None
                loss_scale = scaler.scale if scaler is not None else 1.0
                parts.model.backward(loss_scale=loss_scale)
                sync_gradients(parts.store, layout.axes.dp)
                norm = global_grad_norm(parts.store, layout.axes.tp) / loss_scale
                if agree_max(mpi_world, not (math.isfinite(loss) and math.isfinite(norm))):
                    hint = (f"; float16 gradients overflowed at loss scale {loss_scale:g} and a trace cannot skip "
                            "a step: pass a smaller --loss-scale") if scaler is not None else ""
                    raise DivergedError(f"trace: step {s}: the loss is {loss} and the gradient norm {norm}{hint}; "
                                        "nothing written")
                grads = collect.params("grad", "grad", divide=loss_scale)
                scale = min(1.0, opts.grad_clip / (norm + CLIP_EPS)) if opts.grad_clip > 0 else 1.0
                lr = schedule(s)
                opt.step(lr, scale / loss_scale)
                if scaler is not None:
                    scaler.update(True)
            step_pieces = forward + grads + collect.params("param", "data")
            tensors = gather_pieces(mpi_world, step_pieces)
            if writer is not None:
                group = f"step_{s}"
                writer.write(f"{group}/loss", np.asarray(loss, dtype=np.float64))
                writer.write(f"{group}/lr", np.asarray(lr, dtype=np.float64))
                writer.write(f"{group}/grad_norm", np.asarray(norm, dtype=np.float64))
                _write(writer, tensors, prefix=group + "/")
            say(f"step {s}/{N}: loss {loss:.6f}, lr {lr:.3e}, grad_norm {norm:.6f}")
        if writer is not None:
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
