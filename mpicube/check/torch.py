"""Recording a PyTorch model's training steps as a trace.

    from mpicube.check.reference import Reference
    from mpicube.check.namemaps import nanogpt
    from mpicube.check.torch import Recorder

    ref = Reference("ref.h5")
    with Recorder(model, nanogpt(ref.config), "mine.h5", ref) as rec:
        rec.load_init()                            # the reference's initial parameters, mapped
        for s in ref.step_numbers():
            x, y = (torch.as_tensor(t) for t in ref.batch(s))
            logits, loss = model(x, y)
            loss.backward()
            rec.gradients()                        # before clipping and the optimizer
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step(); opt.zero_grad()
            rec.step(s, loss=loss, lr=ref.lr(s), grad_norm=norm, logits=logits, tokens=ref.tokens[s - 1])

Under ``torch.distributed`` (more than one process) every rank makes the
same calls: each records its own blocks - a DTensor's local shard at the
global index its placements give, a plain tensor as a full replica - and
rank 0 gathers them and writes one sharded trace (shards.py), so that
``compare`` checks the replicas against each other as well as the
logical tensors against the reference.

torch is imported here only, when a recorder is made: mpicube never
needs it, and ``import mpicube.check.torch`` works without it. Everything
crosses to numpy at once, so the name map, the writer and the comparison
are the numpy code of this package.
"""

from __future__ import annotations

import numpy as np

from ..core.errors import UserError
from . import placements
from .namemaps import NameMap
from .shards import Shard, Sharded
from .writer import TraceWriter


def _torch():
    try:
        import torch
    except ImportError:
        raise UserError("mpicube.check.torch needs torch (an optional extra: pip install torch)") from None
    return torch


def to_numpy(t) -> np.ndarray:
    """A copy: on the CPU ``.numpy()`` shares the tensor's memory, and a
    gradient taken before clipping must not be clipped with it afterwards."""
    return np.array(t.detach().cpu().numpy(), copy=True) if hasattr(t, "detach") else np.asarray(t)


def block(t) -> tuple:
    """(local block, global index per dimension, logical shape) of a tensor:
    a DTensor's local shard where its placements put it (``Shard(d)``
    splits dimension d as ``torch.chunk`` does, mesh dimension by mesh
    dimension; ``Replicate`` keeps it whole), any other tensor whole."""
    shape = tuple(t.shape)
    if not hasattr(t, "placements"):
        return to_numpy(t), tuple(np.arange(n) for n in shape), shape
    start, length = [0] * len(shape), list(shape)
    for mesh_dim, placement in enumerate(t.placements):
        if placement.is_shard():
            d, size = placement.dim, t.device_mesh.size(mesh_dim)
            chunk = -(-length[d] // size)                  # ceil
            lo = min(t.device_mesh.get_local_rank(mesh_dim) * chunk, length[d])
            start[d], length[d] = start[d] + lo, min(chunk, length[d] - lo)
    return to_numpy(t.to_local()), tuple(np.arange(s, s + n) for s, n in zip(start, length)), shape


def declared(t, n_axes: int):
    """Per mesh axis ``P`` where a DTensor is ``Partial`` (a pending sum:
    its local tensor is one part), None elsewhere - ``Replicate`` and
    ``Shard(d)`` are inferred from the indices once the name map has put
    them in the trace's dimensions (placements.infer); None for a plain
    tensor or a DTensor on another mesh."""
    kinds = getattr(t, "placements", None)
    if kinds is None or len(kinds) != n_axes:
        return None
    return tuple(placements.PARTIAL if k.is_partial() else None for k in kinds)


def mesh_of(params: dict, dist) -> tuple:
    """(axis names, sizes, this rank's coordinates) of the first DTensor
    parameter's device mesh; a 1-D ``world`` mesh when none is a DTensor."""
    for p in params.values():
        mesh = getattr(p, "device_mesh", None)
        if mesh is not None:
            names = mesh.mesh_dim_names or tuple(f"mesh{i}" for i in range(mesh.ndim))
            return tuple(names), tuple(int(n) for n in mesh.shape), tuple(int(c) for c in mesh.get_coordinate())
    return ("world",), (dist.get_world_size(),), (dist.get_rank(),)


class Recorder:
    """Hooks ``model`` and writes its steps to ``path`` in the trace format,
    under ``name_map``'s names; ``reference`` (a ``Reference``) gives the
    config, optimizer, dtype and dropout the trace declares. The modules
    named in ``name_map.acts`` (or ``acts``) give the activations: their
    outputs in the last forward (the first element of a tuple output).
    ``act_index(key, output)``, when given, says where a plain tensor that
    is one rank's block of an activation lies, as ``(global index per
    dimension, logical shape)``, or None for a whole one: a sequence-parallel
    rank's rows (a DTensor output says it itself). A run resumed from the
    framework's own checkpoint records from ``first_step`` on, after
    ``record_init`` (``mpicube check-resume --compare-only``)."""

    def __init__(self, model, name_map: NameMap, path, reference, layout: dict = None, acts: dict = None,
                 act_index=None, first_step: int = 1):
        torch = _torch()
        self.model, self.map, self.ref = model, name_map, reference
        self.params = dict(model.named_parameters())            # a tied head appears once
        name_map.check_names(self.params)
        dist = torch.distributed
        self.dist = dist if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 else None
        self.rank = self.dist.get_rank() if self.dist else 0
        layout = layout or {"framework": "torch", "torch": torch.__version__, "map": name_map.name,
                            "world_size": self.dist.get_world_size() if self.dist else 1}
        self.writer = None
        if self.rank == 0:
            self.writer = TraceWriter(path, reference.config, reference.optimizer, reference.dtype, layout,
                                      reference.dropout, reference.seed, first_step)
        self.mesh = mesh_of(self.params, self.dist) if self.dist else None      # (axes, sizes, my coords)
        if self.writer is not None and self.mesh is not None:
            self.writer.f.attrs["mesh"] = placements.mesh_attr(*self.mesh[:2])
        self.captured, self.grads, self.act_index = {}, None, act_index
        self.hooks = []
        for key, module in (acts or name_map.acts).items():
            try:
                target = model.get_submodule(module)
            except AttributeError:
                raise UserError(f"name map {name_map.name}: the model has no module {module!r} "
                                f"for activation {key!r}") from None
            self.hooks.append(target.register_forward_hook(self._keep(key)))

    def _keep(self, key):
        def hook(module, inputs, output):
            out = output[0] if isinstance(output, (tuple, list)) else output
            where = self.act_index(key, out) if self.act_index and not hasattr(out, "placements") else None
            self.captured[key] = block(out) if where is None else (to_numpy(out), where[0], tuple(where[1]))
        return hook

    def _gather(self, mine):
        """Every rank's ``mine`` on rank 0 (a list, by rank); [mine] alone."""
        if not self.dist:
            return [mine]
        everyone = [None] * self.dist.get_world_size() if self.rank == 0 else None
        self.dist.gather_object(mine, everyone, dst=0)
        return everyone

    def _sharded(self, blocks: dict, tensors: dict = None) -> dict:
        """{name: (block, index, shape)} of every rank -> rank 0's {name:
        Sharded}, others {}; each block with its rank's mesh coordinates
        and the placements ``tensors`` (the torch tensors) declare."""
        n_axes = len(self.mesh[0])
        mine = {n: (*b, declared((tensors or {}).get(n), n_axes)) for n, b in blocks.items()}
        out = {}
        for rank, (coords, theirs) in enumerate(self._gather((self.mesh[2], mine)) or []):
            for name, (data, index, shape, decl) in theirs.items():
                out.setdefault(name, Sharded(shape, [])).shards.append(Shard(rank, index, data, decl, coords))
        return out

    def _placed(self, tensors: dict) -> dict:
        """Rank 0's Sharded tensors with every block's placement inferred."""
        return {n: placements.infer(t, self.mesh[1]) if isinstance(t, Sharded) else t for n, t in tensors.items()}

    def _mapped(self, tensors: dict, what: str) -> dict:
        """{framework name: tensor} -> {trace name: array, or Sharded under torch.distributed}."""
        if not self.dist:
            return self.map.to_trace({n: to_numpy(t) for n, t in tensors.items()}, what)
        gathered = self._sharded({n: block(t) for n, t in tensors.items()}, tensors)
        if self.rank != 0:
            return {}
        return self._placed(self.map.shards_to_trace({n: s.shards for n, s in gathered.items()},
                                                     {n: s.shape for n, s in gathered.items()}, what))

    def load_init(self) -> None:
        """Copy the reference's initial parameters into the model (each
        rank its own block of them) and record them."""
        torch = _torch()
        values = self.map.from_trace(self.ref.init())
        with torch.no_grad():
            for name, value in values.items():
                p = self.params[name]
                if tuple(p.shape) != value.shape:
                    raise UserError(f"name map {self.map.name}: {name} is {tuple(p.shape)} in the model, "
                                    f"{value.shape} from the trace")
                _, index, _ = block(p)
                local = p.to_local() if hasattr(p, "to_local") else p
                local.copy_(torch.as_tensor(value[np.ix_(*index)] if index else value, dtype=p.dtype))
        mapped = self._mapped(self.params, "model")
        if self.writer is not None:
            self.writer.init(mapped)

    def record_init(self) -> None:
        """Record the model's parameters as they are, as ``init/``: a
        resumed run's, read back from the framework's own checkpoint
        (check-resume holds them to the ones saved, bit for bit)."""
        mapped = self._mapped(self.params, "model")
        if self.writer is not None:
            self.writer.init(mapped)

    def gradients(self) -> None:
        """Take the gradients now: after backward, before clipping and the
        optimizer (a parameter backward did not reach has a zero gradient)."""
        torch = _torch()
        grads = {n: (p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in self.params.items()}
        self.grads = self._mapped(grads, "gradients")

    def step(self, s: int, *, loss, lr, grad_norm, logits=None, masks: dict = None, tokens=None,
             moe: dict = None, optimizer=None, loss_scale=None, rng_offset=None, expert_load: dict = None) -> None:
        """Write step s: the scalars, the gradients taken by ``gradients``,
        the parameters now (after the update), the activations and
        ``logits`` of the last forward (or this rank's block of them, as a
        mask's below: a data-parallel rank's rows), the keep ``masks`` applied, by site
        (``emb``, ``h.{i}.attn``, ...): a whole mask, or the block this rank
        applied as ``(block, global index per dimension, logical shape)``
        (a rank's heads of an attention mask), so that a rank that applied
        another rank's mask is named at the mask. Under torch.distributed
        the loss, the norm, the activations, the logits and the masks are
        every rank's, so replicas that part are found too. ``moe``: a
        mixture of experts' router tensors by their ``moe/`` names (whole
        tensors, rank 0's: TraceWriter.step). The training state after
        the update, when given (what ``mpicube trace --state`` writes):
        ``optimizer`` an AdamW whose ``exp_avg``/``exp_avg_sq`` of every
        parameter are recorded as the parameters are (zeros for one it
        has not stepped), ``loss_scale`` (a GradScaler's ``get_scale()``),
        ``rng_offset`` (the counter your next step's draws start from),
        ``expert_load`` {``h.{i}``: (E,) tokens routed to each expert}."""
        if self.grads is None:
            raise UserError(f"step {s}: call gradients() after backward, before the optimizer step")
        params = self._mapped(self.params, "model")
        scalar = lambda v: np.asarray(float(to_numpy(v)), dtype=np.float64)       # noqa: E731 - tensor or number
        forward = {"act/" + k: v for k, v in self.captured.items()}
        forward.update({"loss": (scalar(loss), (), ()), "grad_norm": (scalar(grad_norm), (), ())})
        forward.update({"mask/" + k: (v if isinstance(v, tuple) else block(v)) for k, v in (masks or {}).items()})
        if logits is not None:
            forward["logits"] = logits if isinstance(logits, tuple) else block(logits)
        if self.dist:
            forward = self._placed(self._sharded(forward))
        else:
            forward = {k: v[0] for k, v in forward.items()}
        state = self._state(optimizer, loss_scale, rng_offset, expert_load)
        if self.writer is not None:
            part = lambda kind: {k[len(kind):]: v for k, v in forward.items() if k.startswith(kind)}  # noqa: E731
            self.writer.step(s, loss=forward.pop("loss"), lr=float(to_numpy(lr)),
                             grad_norm=forward.pop("grad_norm"), grads=self.grads, params=params,
                             logits=forward.pop("logits", None), acts=part("act/"), masks=part("mask/"),
                             tokens=tokens, moe={k: to_numpy(v) for k, v in (moe or {}).items()}, state=state)
        self.grads, self.captured = None, {}

    def _state(self, optimizer, loss_scale, rng_offset, expert_load) -> dict:
        """{state name: value} for TraceWriter.step's ``state`` (every rank
        takes part in the moments' gather)."""
        torch = _torch()
        state = {}
        if optimizer is not None:
            for key in ("exp_avg", "exp_avg_sq"):
                held = {n: optimizer.state.get(p, {}).get(key) for n, p in self.params.items()}
                state[key] = self._mapped({n: (v if v is not None else torch.zeros_like(self.params[n]))
                                           for n, v in held.items()}, "optimizer state")
        if loss_scale is not None:
            state["loss_scale"] = np.asarray(float(to_numpy(loss_scale)), dtype=np.float64)
        if rng_offset is not None:
            state["rng_offset"] = np.asarray(int(to_numpy(rng_offset)), dtype=np.int64)
        for site, load in (expert_load or {}).items():
            state[f"expert_load/{site}"] = np.asarray(to_numpy(load), dtype=np.int64)
        return state

    def close(self) -> None:
        self.__exit__(None, None, None)

    def __enter__(self):
        return self

    def __exit__(self, kind, value, tb):
        for h in self.hooks:
            h.remove()
        self.hooks = []
        if self.writer is not None:
            self.writer.close() if kind is None else self.writer.discard()
            self.writer = None
        return False
