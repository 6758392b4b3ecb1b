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

torch is imported here only, when a recorder is made: mpicube never
needs it, and ``import mpicube.check.torch`` works without it. Everything
crosses to numpy at once (``detach().cpu().numpy()``), so the name map,
the writer and the comparison are the numpy code of this package.
"""

from __future__ import annotations

import numpy as np

from ..core.errors import UserError
from .namemaps import NameMap
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


class Recorder:
    """Hooks ``model`` and writes its steps to ``path`` in the trace format,
    under ``name_map``'s names; ``reference`` (a ``Reference``) gives the
    config, optimizer, dtype and dropout the trace declares. The modules
    named in ``name_map.acts`` (or ``acts``) give the activations: their
    outputs in the last forward (the first element of a tuple output)."""

    def __init__(self, model, name_map: NameMap, path, reference, layout: dict = None, acts: dict = None):
        torch = _torch()
        self.model, self.map, self.ref = model, name_map, reference
        self.params = dict(model.named_parameters())            # a tied head appears once
        name_map.check_names(self.params)
        layout = layout or {"framework": "torch", "torch": torch.__version__, "map": name_map.name}
        self.writer = TraceWriter(path, reference.config, reference.optimizer, reference.dtype, layout,
                                  reference.dropout, reference.seed)
        self.captured, self.grads = {}, None
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
            self.captured[key] = to_numpy(out)
        return hook

    def _mapped(self, tensors: dict, what: str) -> dict:
        return self.map.to_trace({n: to_numpy(t) for n, t in tensors.items()}, what)

    def load_init(self) -> None:
        """Copy the reference's initial parameters into the model and record them."""
        torch = _torch()
        values = self.map.from_trace(self.ref.init())
        with torch.no_grad():
            for name, value in values.items():
                p = self.params[name]
                if tuple(p.shape) != value.shape:
                    raise UserError(f"name map {self.map.name}: {name} is {tuple(p.shape)} in the model, "
                                    f"{value.shape} from the trace")
                p.copy_(torch.as_tensor(value, dtype=p.dtype, device=p.device))
        self.writer.init(self._mapped(self.params, "model"))

    def gradients(self) -> None:
        """Take the gradients now: after backward, before clipping and the
        optimizer (a parameter backward did not reach has a zero gradient)."""
        torch = _torch()
        grads = {n: (p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in self.params.items()}
        self.grads = self._mapped(grads, "gradients")

    def step(self, s: int, *, loss, lr, grad_norm, logits=None, masks: dict = None, tokens=None) -> None:
        """Write step s: the scalars, the gradients taken by ``gradients``,
        the parameters now (after the update), the activations and
        ``logits`` of the last forward, the keep ``masks`` applied."""
        if self.grads is None:
            raise UserError(f"step {s}: call gradients() after backward, before the optimizer step")
        scalar = lambda v: float(to_numpy(v))                 # noqa: E731 - a tensor or a number
        self.writer.step(s, loss=scalar(loss), lr=scalar(lr), grad_norm=scalar(grad_norm), grads=self.grads,
                         params=self._mapped(self.params, "model"), acts=self.captured,
                         logits=None if logits is None else to_numpy(logits),
                         masks={k: to_numpy(v) for k, v in (masks or {}).items()},
                         tokens=tokens)
        self.grads, self.captured = None, {}

    def close(self) -> None:
        for h in self.hooks:
            h.remove()
        self.writer.close()

    def __enter__(self):
        return self

    def __exit__(self, kind, value, tb):
        for h in self.hooks:
            h.remove()
        if kind is None:
            self.writer.close()
        else:
            self.writer.discard()
        return False
