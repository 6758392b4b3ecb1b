"""What a disagreeing tensor's values say about the bug, beyond that it
disagrees: a pending sum consumed as replicated (placements.py), an
update that was never applied (the parameter after step s is the one
before it), which part of MLA's kv_down differs (the kv latent's columns
or the rotary key k_pe's, which every head shares: a k_pe gradient not
summed over the heads' ranks shows in the latter only), and a bias update
of the opposite sign. Called by compare.py for rows that already fail; a note here
never turns a row that agrees into a divergence."""

from __future__ import annotations

import re

import numpy as np

from .blocks import stored_shape
from .measure import equal
from .names import step_of
from .placements import placement_notes
from .tracefile import reader


def notes(name: str, sets: dict, paths: dict, readers: list, shape: tuple, rtol: float, atol: float,
          cfg: dict = None) -> str:
    """The notes for a failing row ("" when none applies): ``readers`` are
    A's and B's ``read(block)`` of the tensor (None for a side whose shards
    hold too little to put it together), ``shape`` the shape both hold,
    ``cfg`` the traces' model config."""
    found = [placement_notes(name, sets, paths, readers, shape, rtol, atol),
             unapplied(name, sets, paths, readers, shape),
             latent_parts(name, readers, shape, cfg or {}, rtol, atol), negated(name, readers, shape, rtol, atol)]
    return "; ".join(n for n in found if n)


def _whole(readers: list, shape: tuple):
    """(A, B) whole, or None where a side cannot be read (only small tensors are asked)."""
    if any(r is None for r in readers):
        return None
    block = tuple(slice(None) for _ in shape)
    return [np.asarray(r(block), dtype=np.float64) for r in readers]


def _close(a, b, rtol: float, atol: float) -> bool:
    return bool(np.all(np.abs(a - b) <= rtol * np.abs(a).max(initial=0.0) + atol))


def latent_parts(name: str, readers: list, shape: tuple, cfg: dict, rtol: float, atol: float) -> str:
    """For MLA's ``kv_down`` (a gradient or parameter, (h, rkv + dr)): which
    of its two parts differs, the kv latent's columns [:rkv] or the rotary
    key's [rkv:] (HF's kv_a_proj_with_mqa holds both: namemaps_deepseek)."""
    r = cfg.get("kv_lora_rank")
    if not r or not re.fullmatch(r"step_\d+/(grad|param)/h\.\d+\.attn\.kv_down\.weight", name) or len(shape) != 2:
        return ""
    both = _whole(readers, shape)
    if both is None:
        return ""
    a, b = both
    latent, rope = _close(a[:, :r], b[:, :r], rtol, atol), _close(a[:, r:], b[:, r:], rtol, atol)
    if latent and not rope:
        return f"only the rotary key's columns differ ([{r}:], k_pe: every head's, summed over the heads' ranks)"
    if rope and not latent:
        return f"only the kv latent's columns differ ([:{r}]); the rotary key's (k_pe) agree"
    return ""


def negated(name: str, readers: list, shape: tuple, rtol: float, atol: float) -> str:
    """For a router bias's update (``moe/h.{i}.bias_update``): B's is A's
    with the opposite sign, the bias moved away from balance."""
    if not re.fullmatch(r"step_\d+/moe/h\.\d+\.bias_update", name):
        return ""
    both = _whole(readers, shape)
    if both is None or not np.abs(both[0]).max(initial=0.0) > 0:
        return ""
    if _close(both[0], -both[1], rtol, atol):
        return "B is A negated: the bias update has the wrong sign (an overloaded expert's bias rose)"
    return ""


def unapplied(name: str, sets: dict, paths: dict, readers: list, shape: tuple) -> str:
    """For ``step_s/param/X``: which side's X is exactly what it was before
    step s (``init/X`` or ``step_{s-1}/param/X``) while the other's moved:
    gradients computed and never applied. Read block by block."""
    s = step_of(name)
    if not s or not name.startswith(f"step_{s}/param/"):
        return ""
    param = name.split("/", 2)[2]
    before = f"init/{param}" if s == 1 else f"step_{s - 1}/param/{param}"
    out = []
    for side, mine, theirs in (("A", *readers), ("B", *readers[::-1])):
        if before not in sets[side] or mine is None or theirs is None:
            continue
        if stored_shape(sets[side][before], paths[side]) != shape:
            continue
        old = reader(sets[side][before], paths[side], np.inf, np.inf)[0]
        if old is not None and equal(old, mine, shape) and not equal(old, theirs, shape):
            out.append(f"{side}: {param} is exactly what it was before step {s}: its update was not applied")
    return "; ".join(out)
