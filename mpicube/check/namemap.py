"""The machinery of a name map (``namemaps``): a ``Rule`` says how one
trace parameter is made from a framework's tensors (as they are, a
transposed nn.Linear, q/k/v side by side, Megatron's rows per head, one
expert of a fused experts tensor), both ways and on a rank's shard; a
``NameMap`` is a model's rules plus the framework names that map to no
trace parameter. Why apart from the maps themselves: each family's maps
(``namemaps``, ``namemaps_deepseek``) build on these, and a family's
module must not import another's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..core.errors import UserError
from .shards import Shard, Sharded


@dataclass
class Rule:
    """How one trace parameter is made from framework tensors ``sources``:
    ``kind`` "same", "transpose" (an (out, in) linear), "concat" (separate
    q, k, v linears, each (out, in): transposed and side by side),
    "heads" (Megatron's fused q/k/v, rows (n_head, 3, head_dim)) or
    "expert" (slice ``expert`` of a fused (E, out, in) experts tensor,
    transposed: several rules read one source, NameMap.from_trace stacks
    their slices back)."""

    sources: tuple
    kind: str = "same"
    n_head: int = 0
    widths: tuple = ()            # "concat": each source's output width, when they differ (GQA's q, k, v)
    expert: int = -1              # "expert": which (E, out, in) slice of a fused experts tensor, transposed

    def offset(self, k: int, width: int) -> int:
        """Where source k's outputs start among the concatenated columns."""
        return sum(self.widths[:k]) if self.widths else k * width

    def to_trace(self, parts: list) -> np.ndarray:
        if self.kind == "same":
            return parts[0]
        if self.kind == "transpose":
            return parts[0].T
        if self.kind == "expert":                           # (E, out, in) -> expert's (in, out)
            return parts[0][self.expert].T
        if self.kind == "concat":                           # [q | k | v]: weights (in, 3h), biases (3h,)
            return np.concatenate([p.T for p in parts], axis=-1)
        if self.kind == "heads":                            # (nh*3*hd, ...) -> (3*nh*hd, ...) -> weights (in, out)
            w = parts[0]
            rows = w.shape[0]
            regrouped = w.reshape(self.n_head, 3, rows // (3 * self.n_head), *w.shape[1:]).swapaxes(0, 1)
            return regrouped.reshape(w.shape).T
        raise ValueError(self.kind)

    def shard_to_trace(self, k: int, index: tuple, block: np.ndarray, shape: tuple) -> tuple:
        """(trace index, trace block) of a block of source ``k`` (logical
        ``shape``) held at global ``index`` (one integer array per
        dimension): the same conversion as ``to_trace``, done on the
        indices, so a rank's shard maps without the whole tensor."""
        index = tuple(np.asarray(ix, dtype=np.int64) for ix in index)
        if self.kind == "same":
            return index, block
        if self.kind == "transpose":
            return index[::-1], block.T
        if self.kind == "expert":                           # this expert's rows of a (E, out, in) block
            at = np.flatnonzero(index[0] == self.expert)     # none: an empty block (dropped by shards_to_trace)
            return (index[2], index[1][:len(index[1]) * at.size]), (block[at[0]] if at.size else block[0, :0]).T
        if self.kind == "concat":                           # part k's outputs start after the parts before it
            out = index[0] + self.offset(k, shape[0])
            return ((index[1], out) if block.ndim == 2 else (out,)), block.T
        if self.kind == "heads":                            # row (j*3 + p)*hd + d -> column p*h + j*hd + d
            hd = shape[0] // (3 * self.n_head)
            r = index[0]
            col = (r // hd) % 3 * (self.n_head * hd) + r // (3 * hd) * hd + r % hd
            return ((index[1], col) if block.ndim == 2 else (col,)), block.T
        raise ValueError(self.kind)

    def from_trace(self, value: np.ndarray) -> list:
        if self.kind == "same":
            return [value]
        if self.kind in ("transpose", "expert"):
            return [value.T]
        if self.kind == "concat":
            cuts = np.cumsum(self.widths)[:-1] if self.widths else len(self.sources)
            return [p.T for p in np.split(value, cuts, axis=-1)]
        if self.kind == "heads":
            w = value.T                                     # (3*nh*hd, ...) trace order
            rows = w.shape[0]
            regrouped = w.reshape(3, self.n_head, rows // (3 * self.n_head), *w.shape[1:]).swapaxes(0, 1)
            return [np.ascontiguousarray(regrouped.reshape(w.shape))]
        raise ValueError(self.kind)


@dataclass
class NameMap:
    """{trace name: Rule} over a model config, plus the framework names that
    alias another (a tied LM head) and so map to nothing, and those of
    buffers (``buffers``: present or not, never a parameter) and those of
    stored copies of a shared tensor (``copies``: present or not, equal
    to it where present). ``acts`` names the modules whose outputs are
    the trace's activations."""

    name: str
    rules: dict
    aliases: tuple = ()
    acts: dict = field(default_factory=dict)          # {"emb": module path, "h.0": ..., "ln_f": ...}
    # {framework name: the trace's per-step record} of tensors that are state, not parameters: a sigmoid
    # router's bias (HF's ``mlp.gate.e_score_correction_bias`` -> ``moe/h.{i}.bias``), recorded each step
    buffers: dict = field(default_factory=dict)
    # {framework name: the framework name it copies} of stored duplicates of a shared tensor (a DeepSeek-V3 file's
    # MTP layer holds its own embed_tokens and shared_head.head, copies of the shared embedding and head): optional,
    # but where present they must equal what they copy (to_trace checks), and from_trace writes them
    copies: dict = field(default_factory=dict)

    def sources(self, names=None) -> set:
        """The framework names the rules of ``names`` (default: all) read,
        e.g. to put the trace's ``decay`` list into an optimizer's groups."""
        return {s for n, rule in self.rules.items() if names is None or n in names for s in rule.sources}

    def check_names(self, framework_names, what: str = "model") -> None:
        """Every framework tensor used by exactly the rules; bad input naming the first that is not."""
        have = set(framework_names)
        missing = sorted(self.sources() - have)
        if missing:
            raise UserError(f"name map {self.name}: the {what} has no {missing[0]!r}")
        unused = sorted(have - self.sources() - set(self.aliases) - set(self.buffers) - set(self.copies))
        if unused:
            raise UserError(f"name map {self.name}: the {what}'s {unused[0]!r} maps to no trace tensor")

    def to_trace(self, tensors: dict, what: str = "model") -> dict:
        """{framework name: array} -> {trace name: array}, declaration order;
        bad input naming a stored copy that differs from what it copies."""
        self.check_names(tensors, what)
        for copy, of in self.copies.items():
            if copy in tensors and not np.array_equal(np.asarray(tensors[copy]), np.asarray(tensors[of])):
                raise UserError(f"name map {self.name}: the {what}'s {copy!r} differs from {of!r}, the shared "
                                f"tensor it should copy")
        return {name: rule.to_trace([np.asarray(tensors[s]) for s in rule.sources])
                for name, rule in self.rules.items()}

    def shards_to_trace(self, shards: dict, shapes: dict, what: str = "model") -> dict:
        """{framework name: [Shard]} with their logical ``shapes`` -> {trace
        name: Sharded}: each rank's blocks under the trace's names and
        indices, for compare to put together (shards.py). Stored copies
        (``copies``) are not read: one rank's block of each is not the
        whole tensor to check."""
        self.check_names(shards, what)
        out = {}
        for name, rule in self.rules.items():
            pieces = []
            for k, source in enumerate(rule.sources):
                for s in shards[source]:
                    index, block = rule.shard_to_trace(k, s.index, np.asarray(s.data), tuple(shapes[source]))
                    if block.size or not np.asarray(s.data).size:     # a fused tensor's block of other experts: none
                        pieces.append(Shard(s.rank, index, block, s.placement, s.coords))
            full = [np.asarray(shapes[s]) for s in rule.sources]
            out[name] = Sharded(tuple(rule.to_trace([np.empty(tuple(f)) for f in full]).shape), pieces)
        return out

    def from_trace(self, tensors: dict) -> dict:
        """{trace name: array} -> {framework name: array} (to load initial parameters)."""
        out, fused = {}, {}
        for name, rule in self.rules.items():
            if name not in tensors:
                raise UserError(f"name map {self.name}: no trace tensor {name!r} to load")
            parts = rule.from_trace(np.asarray(tensors[name]))
            if rule.kind == "expert":                       # one slice of a fused experts tensor
                fused.setdefault(rule.sources[0], {})[rule.expert] = parts[0]
                continue
            out.update(zip(rule.sources, parts))
        for source, slices in fused.items():                # (E, out, in), experts in order
            out[source] = np.stack([slices[e] for e in range(len(slices))])
        return {**out, **{copy: out[of] for copy, of in self.copies.items()}}
