"""Which data a job reads, decided once by rank 0 and checked by every rank.

Why: whether a validation shard exists and how many evaluation batches it
holds decide how many forward passes - how many collectives - every rank
runs. Decided by each rank from its own view of the files, a stale copy on
one node's local disk makes the ranks run different numbers of
collectives and the job hangs. So rank 0 resolves the paths, reads the
shard sizes and counts the batches, and broadcasts them; every rank then
opens the same paths and compares what it sees (token count and a sample
checksum) with rank 0's figures, and any difference stops every rank with
one message naming the rank and the file.

A training shard without a ``<stem>_val<suffix>`` sibling has no
validation data: validation is switched off with one warning (or
``--val-data`` names the shard), never run on the training data.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np

from ..files import data
from ..parallel.comm import on_root

SAMPLE = 1 << 16        # tokens at each end of a shard that go into its fingerprint


def fingerprint(tokens) -> list:
    """[token count, crc32 of the first and last SAMPLE tokens]: cheap, and
    different for a stale copy unless it differs only in the middle."""
    n = len(tokens)
    head = np.asarray(tokens[:SAMPLE]).tobytes()
    tail = np.asarray(tokens[max(0, n - SAMPLE):]).tobytes()
    return [n, zlib.crc32(head), zlib.crc32(tail)]


def val_path_for(train_path: Path) -> Path:
    """The validation shard ``<stem>_val<suffix>`` beside a train shard."""
    train_path = Path(train_path)
    return train_path.with_name(f"{train_path.stem}_val{train_path.suffix}")


@dataclass
class DataPlan:
    """Rank 0's decisions, the same on every rank."""

    train: str
    val: Optional[str]                  # None: no validation data
    eval_batches: int = 0               # batches per validation (0: validation off)
    prints: dict = field(default_factory=dict)     # path -> fingerprint as rank 0 saw it
    notes: list = field(default_factory=list)      # said once by rank 0
    builtin: bool = False               # the built-in corpus (its cache path differs between machines)


def _decide(path, val_path, batch_size, seq_len, eval_every, eval_batches) -> DataPlan:
    """Rank 0: the plan (DataError for a shard that cannot serve)."""
    if path is None:
        train, val = (str(p) for p in data.builtin_corpus())
        plan = DataPlan(train, val, builtin=True)
    else:
        plan = DataPlan(str(path), None)
        if val_path is not None:
            plan.val = str(val_path)
        elif val_path_for(path).is_file():
            plan.val = str(val_path_for(path))
    plan.prints[plan.train] = fingerprint(data.read_shard(plan.train))
    if not eval_every:
        return plan
    if plan.val is None:
        plan.notes.append(f"warning: no validation shard {val_path_for(path)} beside {path}: validation is off "
                          f"(--eval-every {eval_every} ignored; name one with --val-data)")
        return plan
    tokens = data.read_shard(plan.val)
    plan.prints[plan.val] = fingerprint(tokens)
    available = data.eval_batch_count(tokens, batch_size, seq_len)
    if available == 0:
        raise data.DataError(f"{plan.val}: too small for one evaluation batch of "
                             f"{batch_size} x {seq_len + 1} tokens")
    plan.eval_batches = min(eval_batches, available)
    if plan.eval_batches < eval_batches:
        plan.notes.append(f"note: {plan.val} holds {available} evaluation batches; "
                          f"validating on {available}, not --eval-batches {eval_batches}")
    return plan


def plan_training_data(world, path, val_path, batch_size, seq_len, eval_every, eval_batches) -> tuple:
    """(plan, train tokens, validation tokens or None): decided by rank 0,
    opened and checked by every rank. Collective over ``world``."""
    plan = on_root(world, lambda: _decide(path, val_path, batch_size, seq_len, eval_every, eval_batches))
    shards = [plan.train] + ([plan.val] if plan.eval_batches else [])
    opened = agree_on_shards(world, plan.prints, shards)
    return plan, opened[0], (opened[1] if plan.eval_batches else None)


def agree_on_shards(world, prints: dict, paths: list) -> list:
    """Every rank opens ``paths`` and compares them with rank 0's
    fingerprints; a difference on any rank is a DataError on every rank."""
    opened, problem = [], None
    for p in paths:
        try:
            tokens = data.read_shard(p)
        except data.DataError as e:
            problem = f"{e} (rank 0 has it)"
            break
        seen = fingerprint(tokens)
        if seen != list(prints[p]):
            what = (f"{seen[0]:,} tokens where rank 0 has {prints[p][0]:,}" if seen[0] != prints[p][0]
                    else "other tokens than rank 0's copy")
            problem = f"{p}: holds {what} (a stale or partial copy on this node?)"
            break
        opened.append(tokens)
    problems = world.allgather(problem)
    for rank, problem in enumerate(problems):
        if problem is not None:
            raise data.DataError(f"rank {rank}: {problem}")
    return opened


def plan_eval_data(world, path, recorded: dict, batch_size: int, seq_len: int, batches: int) -> tuple:
    """(path, tokens, number of batches) for ``mpicube eval``: ``path``, or
    else the validation shard of the data the checkpoint was trained on
    (``recorded``: its ``data`` attribute), or else the built-in corpus's.
    Rank 0 decides; every rank checks its copy."""
    def decide():
        chosen, why = path, None
        if chosen is None:
            trained = recorded.get("path")
            if recorded.get("builtin") or not trained:
                chosen = str(data.builtin_corpus()[1])
            else:
                val = recorded.get("val") or str(val_path_for(trained))
                if not Path(val).is_file():
                    raise data.DataError(f"the checkpoint was trained on {trained}, whose validation shard {val} "
                                         f"is not here: name the data with --data")
                chosen, why = val, f"note: evaluating on {val}, the validation shard of the training data"
        tokens = data.read_shard(chosen)
        available = data.eval_batch_count(tokens, batch_size, seq_len)
        n = available if batches == 0 else batches
        if n == 0 or n > available:
            raise data.DataError(f"{chosen}: holds {available} evaluation batches of {batch_size} x {seq_len + 1} "
                                 f"tokens, {n} requested")
        return str(chosen), fingerprint(tokens), n, why

    chosen, prints, n, why = on_root(world, decide)
    [tokens] = agree_on_shards(world, {chosen: prints}, [chosen])
    return chosen, tokens, n, why
