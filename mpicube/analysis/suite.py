"""``mpicube trace --suite edge --out DIR``: reference traces of the
configurations that have broken frameworks, one file each, for a
framework's CI to compare against on every change (docs/checking-a-framework.md,
"3c").

Each is a serial float64 trace of two steps with the training state
(``--state``), of a model small enough to trace in seconds. The
reference itself is ordinary; what makes a case an edge is what the
candidate must do to match it:

- ``ragged-batch``: 6 sequences, so 4 data-parallel ranks hold 2, 2, 1
  and 1 (or one pads), and the loss must still be the mean over tokens;
- ``vocab-257``: a vocabulary no tensor-parallel size divides (257 is
  prime): padded columns must stay out of the softmax and the gradients;
- ``idle-experts``: a mixture of 8 experts, top-1, over 4 tokens a step:
  at least 4 experts receive none, and their gradients must be zeros
  (``state/expert_load`` shows which);
- ``tp-cp``: T = 16 and 4 heads, shapes that tensor parallelism 2 with
  context parallelism 2 splits (each cp rank two chunks of T / 4);
- ``pipeline-ragged``: 3 micro-batches of 2, a count that 2 pipeline
  stages (or 2 virtual stages) do not divide.
"""

from __future__ import annotations

from pathlib import Path

from ..core.errors import UserError
from .trace import run_trace

BASE = {"layout": "serial", "n_layer": 2, "n_head": 4, "n_embd": 16, "seq_len": 8, "batch_size": 8,
        "dtype": "float64", "dropout": 0.1, "steps": 2, "state": True, "sharded": False}
MIXTRAL = {"arch": "mixtral", "n_experts": 8, "top_k": 1, "n_kv_head": 2, "ffn_hidden": 24, "dropout": 0.0}
SUITES = {"edge": {
    "ragged-batch": {"batch_size": 6},
    "vocab-257": {"vocab_size": 257},
    "idle-experts": {**MIXTRAL, "batch_size": 1, "seq_len": 4},
    "tp-cp": {"seq_len": 16, "batch_size": 4},
    "pipeline-ragged": {"batch_size": 6, "grad_accum": 3},
}}


def run_suite(options: dict, mpi_world, say=print) -> list:
    """Write every case of ``options["suite"]`` as ``DIR/CASE.h5``
    (``options["out"]`` the folder, made if absent); returns the paths."""
    name = options["suite"]
    if name not in SUITES:
        raise UserError(f"--suite {name!r}: one of {', '.join(SUITES)}")
    if mpi_world.Get_size() != 1:
        raise UserError(f"--suite writes serial reference traces on one rank, not {mpi_world.Get_size()}")
    folder = Path(options["out"])
    if folder.suffix == ".h5" or folder.is_file():
        raise UserError(f"--out {folder}: with --suite, give a folder to write the suite's traces into")
    made = not folder.exists()
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    try:
        for case, overrides in SUITES[name].items():
            out = folder / f"{case}.h5"
            run_trace({**options, **BASE, **overrides, "out": str(out)}, mpi_world, say=lambda *a, **k: None)
            paths.append(out)
            say(f"wrote {out}")
    except BaseException:
        for p in paths:
            p.unlink(missing_ok=True)
        if made:
            folder.rmdir()
        raise
    return paths
