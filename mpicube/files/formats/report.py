"""``mpicube inspect`` for Hugging Face directories and llm.c files: what
the file holds, in mpicube's terms, and a read of every tensor (these
formats carry no checksums, so non-finite values are the damage to look
for)."""

from __future__ import annotations

import numpy as np

from . import open_model


def inspect_model(path) -> tuple:
    """(ok, report) for a foreign model file; a file that cannot be opened
    raises its FormatError (one line, exit 2) instead."""
    lines, problems = [], []
    with open_model(path, verify=True) as model:
        cfg = model.config
        model.require_memory(whole=False)        # one tensor at a time
        lines.append(model.describe())
        lines.append(f"  model: n_layer {cfg.n_layer}, n_head {cfg.n_head}, n_embd {cfg.n_embd}, "
                     f"n_ctx {cfg.n_ctx}, vocab {cfg.vocab_size}; {cfg.n_params():,} parameters")
        lines.append(f"tensors ({len(model.names())}, by mpicube name, weights (in, out)):")
        total = 0
        for name in model.names():
            data = model.read(name)
            total += data.nbytes
            bad = int(data.size - np.count_nonzero(np.isfinite(data)))
            if bad:
                problems.append(f"tensor {name!r}: {bad} non-finite values")
            shape = "(" + ", ".join(map(str, data.shape)) + ")"
            lines.append(f"  {name:<32s} {shape:<14s} {str(model.dtype(name)):<8s} "
                         f"mean|x| {float(np.abs(data, dtype=np.float64).mean()):.4g}")
        lines.append(f"  total {total / 2 ** 20:.1f} MiB")
    lines += [f"PROBLEM: {p}" for p in problems]
    lines.append("result: OK" if not problems else f"result: FAILED ({len(problems)} problem(s))")
    return not problems, "\n".join(lines)
