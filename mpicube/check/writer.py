"""A trace from plain numpy arrays, in the documented format.

What a framework's recorder (``check.torch``, or one of your own) hands
over are dicts of arrays by trace name; ``TraceWriter`` checks them against
the model config - every parameter present, under its name, in its (in,
out) shape - casts them to the format's dtypes, and writes the file under
a temporary name that is renamed into place only when complete, so a run
that fails never leaves a trace that looks whole. A name map that misses
or misnames a parameter is found here, before the trace is compared,
as bad input naming the item (exit 2 where a command reports it).

Any tensor may be given as ``shards.Sharded(shape, [Shard(rank, index,
block), ...])`` instead of an array: each rank's block with its global
index, so a replicated tensor's copies are all kept and ``compare`` can
check that they agree (shards.py).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from ..core.errors import UserError
from . import shards
from .names import FORMAT, MASK_SITES, MOE_SCALARS, MOMENTS, ROUTER_PARTS, STATE_SCALARS, VERSION, config_of, param_shapes
from .shards import Sharded

FLOAT_DTYPES = ("float64", "float32", "float16", "bfloat16")


class StagedFile:
    """An HDF5 file written under a temporary name beside ``path`` and
    renamed into place by ``commit``, so a failed writer never leaves a
    partial trace; ``discard`` removes the temporary file."""

    def __init__(self, path):
        import h5py

        self.path = Path(path)
        self.tmp = self.path.with_name(f".{self.path.name}.tmp")
        self.f = h5py.File(self.tmp, "w")

    def commit(self) -> None:
        self.f.close()
        os.replace(self.tmp, self.path)

    def discard(self) -> None:
        try:
            self.f.close()
        finally:
            self.tmp.unlink(missing_ok=True)


def fp8_attr(fp8: dict, path) -> dict:
    """The ``fp8`` root attribute (docs/trace-format.md): the recipe, the
    gradients' format and the accumulation format, checked."""
    want = {"recipe": str, "grad_format": ("e4m3", "e5m2"), "accumulate": ("float32", "float64")}
    for key, kind in want.items():
        value = fp8.get(key) if isinstance(fp8, dict) else None
        if not (isinstance(value, kind) if isinstance(kind, type) else value in kind):
            allowed = kind.__name__ if isinstance(kind, type) else " or ".join(kind)
            raise UserError(f"{path}: fp8 needs {key} ({allowed}), got {value!r}")
    return dict(fp8)


class TraceWriter(StagedFile):
    """Write one trace: ``init`` once, ``step`` for steps 1, 2, ... in
    order, then ``close`` (or use it as a context manager, which discards
    the file when the block raises). A resumed run's trace starts at
    ``first_step`` (its ``init`` the parameters it read back; the root
    attribute ``first_step``), for ``mpicube check-resume --compare-only``
    to put after the trace of the steps before the checkpoint."""

    def __init__(self, path, config: dict, optimizer: dict, dtype: str, layout: dict,
                 dropout: float = 0.0, seed=None, first_step: int = 1, fp8: dict = None):
        if dtype not in FLOAT_DTYPES:
            raise UserError(f"{path}: dtype {dtype!r} is not one of {', '.join(FLOAT_DTYPES)}")
        try:
            self.cfg = config_of(config)
        except ValueError as exc:
            raise UserError(f"{path}: config {exc}") from None
        declared_fp8 = None if fp8 is None else json.dumps(fp8_attr(fp8, path))     # checked before any file
        self.shapes = param_shapes(self.cfg)
        self.store = np.float64 if dtype == "float64" else np.float32
        self.dropout = float(dropout)
        super().__init__(path)
        attrs = {"format": FORMAT, "version": VERSION, "config": json.dumps(self.cfg),
                 "optimizer": json.dumps(optimizer), "dtype": dtype, "layout": json.dumps(layout),
                 "dropout": self.dropout, "steps": 0}
        if seed is not None:
            attrs["seed"] = int(seed)
        if fp8 is not None:             # a framework's FP8 recipe: compare's FP8 unit needs it (fp8_tolerance.py)
            attrs["fp8"] = declared_fp8
        if int(first_step) < 1:
            raise UserError(f"{path}: first_step {first_step}: steps are numbered from 1")
        if int(first_step) > 1:
            attrs["first_step"] = int(first_step)
        self.f.attrs.update(attrs)
        self.steps = int(first_step) - 1
        self.tokens = []

    # ---- what a step holds

    def init(self, params: dict) -> None:
        """The parameters before step 1, {trace name: array}."""
        self._params("init", params)

    def step(self, s: int, *, loss, lr, grad_norm, grads: dict, params: dict, acts: dict = None,
             logits=None, masks: dict = None, tokens=None, moe: dict = None, state: dict = None) -> None:
        """Step ``s`` (1-based, in order): the scalars, the gradients before
        clipping and the parameters after the update; ``acts`` under their
        ``act/`` names (``emb``, ``h.0``, ..., ``ln_f``), ``masks`` the keep
        masks applied (``emb``, ``h.{i}.attn``, ...; 0/1), ``tokens`` the
        (B, T+1) batch; a mixture of experts' ``moe`` tensors under their
        ``moe/`` names (``h.{i}.logits``, ``h.{i}.experts``, ``h.{i}.weights``,
        ``aux_loss``, ``z_loss``; names.ROUTER_PARTS); ``state`` the training
        state after the update under its ``state/`` names (``exp_avg``
        and ``exp_avg_sq``: {parameter: moment}, every parameter;
        ``loss_scale``, ``rng_offset``, ``expert_load/h.{i}``;
        names.MOMENTS, STATE_SCALARS)."""
        if s != self.steps + 1:
            raise UserError(f"{self.path}: step {s} written after step {self.steps}; steps go 1, 2, ... in order")
        for key in moe or {}:                               # before anything of the step is written
            site, _, part = key.rpartition(".")
            if "moe/" + key not in MOE_SCALARS and not (site.startswith("h.") and part in ROUTER_PARTS):
                raise UserError(f"{self.path}: moe tensor {key!r} is not one of h.{{i}}.{{{','.join(ROUTER_PARTS)}}}, "
                                f"aux_loss, z_loss")
        state = dict(state or {})
        for key in state:
            if key not in MOMENTS and "state/" + key not in STATE_SCALARS and not key.startswith("expert_load/h."):
                raise UserError(f"{self.path}: state {key!r} is not one of {', '.join(MOMENTS)}, loss_scale, "
                                f"rng_offset, expert_load/h.{{i}}")
        g = f"step_{s}/"
        for key, value in (("loss", loss), ("lr", lr), ("grad_norm", grad_norm)):
            self.put(g + key, value if isinstance(value, Sharded) else float(value), np.float64)
        for key, value in (acts or {}).items():
            self.put(g + "act/" + key, value, self.store)
        if logits is not None:
            self.put(g + "logits", logits, self.store)
        for key, value in (moe or {}).items():
            kind = (np.float64 if "moe/" + key in MOE_SCALARS else
                    np.int32 if key.endswith(".experts") else self.store)
            self.put(g + "moe/" + key, value, kind)
        for key, value in (masks or {}).items():
            site = key.rsplit(".", 1)[-1]
            if key != "emb" and site not in MASK_SITES:
                raise UserError(f"{self.path}: dropout site {key!r} is not one of emb, "
                                f"h.{{i}}.{{{','.join(MASK_SITES)}}}")
            self.put(g + "dropout/" + key, value, np.uint8)
        self._params(g + "grad", grads)
        for key in MOMENTS:
            if key in state:
                self._params(g + "state/" + key, state.pop(key))
        for key, value in state.items():
            self.put(g + "state/" + key, value if isinstance(value, Sharded) else np.asarray(value),
                     np.float64 if key == "loss_scale" else np.int64)
        self._params(g + "param", params)
        if tokens is not None:
            self.tokens.append(np.asarray(tokens, dtype=np.int32))
        self.steps = s

    def _params(self, group: str, tensors: dict) -> None:
        """Every parameter, by name and shape, or bad input naming the first that is not."""
        missing = [n for n in self.shapes if n not in tensors]
        unknown = [n for n in tensors if n not in self.shapes]
        if unknown or missing:
            what = f"unknown parameter {unknown[0]!r}" if unknown else f"no {missing[0]!r}"
            raise UserError(f"{self.path}: {group}: {what} (a name map that misses or misnames a parameter)")
        for name, shape in self.shapes.items():
            value = tensors[name]
            got = tuple(value.shape) if isinstance(value, Sharded) else np.shape(value)
            if got != shape:
                raise UserError(f"{self.path}: {group}/{name} has shape {got}, the format {shape} "
                                f"(weights are (in, out): transpose an nn.Linear's)")
            self.put(f"{group}/{name}", value, self.store)

    def put(self, name: str, value, dtype) -> None:
        """One tensor: an array, or a ``Sharded`` one written as its shards
        (each rank's block with its global index, shards.py); masks as 0/1."""
        if dtype == np.uint8:
            value = (Sharded(value.shape, [shards.Shard(s.rank, s.index, np.asarray(s.data) != 0)
                                           for s in value.shards])
                     if isinstance(value, Sharded) else np.asarray(value) != 0)
        if isinstance(value, Sharded):
            shards.write(self.f, name, value, dtype)
        else:
            self.f.create_dataset(name, data=np.asarray(value, dtype=dtype))

    # ---- the file

    def close(self) -> None:
        """Write ``tokens`` and ``steps``, then rename the file into place."""
        if self.tokens:
            self.f.create_dataset("tokens", data=np.stack(self.tokens))        # (N, B, T+1)
        self.f.attrs["steps"] = self.steps
        self.commit()

    def __enter__(self):
        return self

    def __exit__(self, kind, value, tb):
        if kind is None:
            self.close()
        else:
            self.discard()
        return False
