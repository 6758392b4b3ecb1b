"""What one micro-batch carries through the model: its context (``Micro``)
and its saved activations (``Tape``).

Why apart from the modules: llm.c keeps parameters and activations in two
structs, and so does mpicube. Modules hold parameter views only; a forward
returns its output and what its backward will need, and the model files
those under the micro-batch's ``Tape``. So one model serves every
micro-batch in flight at once (a pipeline stage holds a tape per (chunk,
micro-batch)), evaluation is the same model with ``Micro.train`` off,
recompute is a wrapper whose tape keeps only a block's input, and the
memory a rank holds for backward is read off the tapes (``saved_buffers``).

What one module keeps for its backward is a small dataclass deriving
from ``Saved`` (the block's ``BlockTape``, attention's ``AttentionTape``,
the MLP's ``MLPTape``, ...): named fields, never a positional tuple of
eight or nine items, so a reader (or a memory probe) knows what each
buffer is, as llm.c names its saved activations.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from ..device import precision
from ..parallel.layouts.modules import Panel


class Saved:
    """Base of the dataclasses a module's forward returns for its backward:
    ``saved_buffers`` walks their fields (and nothing else that merely
    happens to be a dataclass, such as ``Micro``'s router ledger)."""


@dataclass(frozen=True)
class Micro:
    """One micro-batch's context: the small value every forward is given.

    ``positions`` are the global positions (within the sequence) of the
    canonical rows this rank holds, when they are not simply 0 .. T-1: the
    step driver cuts tokens and targets to them (a context-parallel rank's
    two chunks, a sequence-parallel rank's run), and dropout masks and the
    position table are read at them; ``gathered`` are the positions of
    the rows the tp ranks hold together under --sequence-parallel (what
    attention and rotary embeddings see: the cp rank's under --cp).
    ``n_tokens`` is the whole step's token
    count (every replica and micro-batch), the loss's divisor; each
    multi-token prediction depth has its own (``mtp_counts``)."""

    step: int = 0
    micro: int = 0                     # which micro-batch of the step (dropout masks follow its rows)
    positions: np.ndarray = None       # (T_l,) global positions of the canonical rows, or None: 0 .. T-1
    gathered: np.ndarray = None        # (T/cp,) those of the rows a sequence-parallel linear gathers over tp
                                       # (the cp rank's), when they differ from 0 .. T-1, or None
    n_tokens: int = 1                  # N of the whole step
    train: bool = True                 # dropout on (training) or off (evaluation, generation)
    router: object = None              # a mixture of experts' router.RouterLedger for this micro-batch, or None
    mtp: tuple = ()                    # per MTP depth k: (ids, targets, valid) (B_dp, T_l) each (model/mtp.py)
    mtp_counts: tuple = ()             # per MTP depth k: its token count over the whole step, B (T - k)


class Tape:
    """One micro-batch's activations, in the order the model computed them:
    ``front`` (the embeddings'), ``blocks`` (one entry per block), ``back``
    (the final norm and loss head's), and ``panel``, the embedding weight a
    layout gathered once for both the lookup and the head (``head_panel``:
    an untied model's LM head's own). Backward reads it in reverse and lets
    each entry go as it is used."""

    __slots__ = ("ctx", "targets", "panel", "head_panel", "front", "blocks", "back")

    def __init__(self, ctx: Micro, targets=None):
        self.ctx, self.targets = ctx, targets        # targets (B_dp, T_l) on a chunk with the head
        self.panel, self.head_panel = Panel(), Panel()
        self.front, self.blocks, self.back = [], [], []


def saved_buffers(tape, exclude=()) -> list:
    """The distinct floating-point buffers a tape (or any nest of tuples,
    lists, tapes and ``Saved`` records) holds, parameters (``exclude``) left out: what a rank
    keeps for backward, to check the analytic memory model against."""
    seen = {}
    params = {id(p) for p in exclude}

    def visit(value):
        if isinstance(value, (tuple, list)):
            for item in value:
                visit(item)
        elif isinstance(value, (Tape, Panel)):
            for name in value.__slots__:
                visit(getattr(value, name))
        elif isinstance(value, Saved):
            for field in fields(value):
                visit(getattr(value, field.name))
        elif hasattr(value, "dtype") and hasattr(value, "base") and precision.is_float(value.dtype):
            owner = value
            while owner.base is not None:
                owner = owner.base
            if id(owner) not in params:
                seen[id(owner)] = owner

    visit(tape)
    return list(seen.values())
