"""``mpicube trace --envelope N --dtype DTYPE``: the float64 reference
trace, with per-tensor tolerances measured from N reruns at DTYPE whose
reduction orders differ (check/envelope.py says what is measured and how
``compare --tolerance envelope`` uses it).

On one rank the orders that can vary without changing the mathematics are
the accumulation chunking (``--grad-accum``: the step's gradient summed
over 1, 2, 4, ... micro-batches, so every gradient sum and the loss's are
added in other groupings) and the attention's summation order (blockwise
online softmax or the full matrix: ``attention``). The reruns take them
in turn, (1, blocks), (1, full), (2, blocks), ...; N may not exceed what
the batch allows. Each rerun is a trace of its own, in a temporary folder
beside the output, read back and removed.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from ..check import envelope
from ..core.errors import UserError
from .trace import run_trace

ATTENTION = ("blocks", "full")


# FP8 recipes whose quantized operands do not depend on how the batch is cut into micro-batches: delayed
# scales from the history of whole steps; the others' amaxes (tensorwise's of x and dy, rowwise's, a tile's or
# a block's along the tokens of wgrad) are a micro-batch's, so --grad-accum changes what is computed, not only
# the order of its sums, and their envelope varies the attention's order alone
FP8_ACCUM_FREE = ("delayed",)


def orders(batch: int, fp8=None) -> list:
    """[(grad_accum, attention)] a one-rank rerun can vary, in the order
    taken; under an FP8 recipe whose scales follow the micro-batch, the
    attention's order only."""
    accums = [g for g in range(1, batch + 1) if batch % g == 0]
    if fp8 is not None and fp8 not in FP8_ACCUM_FREE:
        accums = [1]
    return [(g, a) for g in accums for a in ATTENTION]


def _tensors(path) -> dict:
    import h5py

    found = {}
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, obj: found.__setitem__(name, obj[()]) if hasattr(obj, "shape") else None)
    return found


def run_envelope(options: dict, mpi_world, say=print) -> dict:
    """The reference trace at ``options["out"]`` (float64) with the
    envelope of ``options["envelope"]`` reruns at ``options["dtype"]``."""
    n, dtype = int(options["envelope"]), options.get("dtype") or "float32"
    if mpi_world.Get_size() != 1:
        raise UserError(f"--envelope runs on one rank (as a reference trace), not {mpi_world.Get_size()}")
    if options.get("sharded"):
        raise UserError("--envelope writes a reference trace: leave out --sharded")
    if dtype == "float64":
        raise UserError("--envelope: give the candidate's --dtype (bfloat16, float16 or float32): the reference "
                        "itself is float64")
    batch = options.get("batch_size")
    if not batch:
        raise UserError("--envelope needs --batch-size (the reruns split the batch into micro-batches)")
    fp8 = options.get("fp8")
    chosen = orders(int(batch), fp8)
    if not 1 <= n <= len(chosen):
        why = (f" under --fp8 {fp8} (its scales follow the micro-batch: --grad-accum changes what is computed, "
               "so only the attention's order varies)" if fp8 is not None and fp8 not in FP8_ACCUM_FREE else "")
        raise UserError(f"--envelope {n}: a batch of {batch} allows 1 to {len(chosen)} reduction orders on one "
                        f"rank{why}")
    chosen = chosen[:n]
    out = Path(options["out"])
    scratch = out.parent / f".{out.name}.envelope"
    quiet = lambda *args, **kwargs: None                         # noqa: E731 - the reruns' step lines
    try:
        scratch.mkdir(parents=True, exist_ok=True)
        runs = []
        for k, (accum, attention) in enumerate(chosen):
            path = scratch / f"run{k}.h5"
            run_trace({**options, "dtype": dtype, "grad_accum": accum, "attention": attention, "out": str(path),
                       "state": options.get("state")}, mpi_world, say=quiet)
            runs.append(_tensors(path))
            say(f"rerun {k + 1}/{n}: {dtype}, --grad-accum {accum}, attention {attention}")
        summary = run_trace({**options, "dtype": "float64"}, mpi_world, say=say)
        reference = _tensors(out)
        measured = envelope.measure(reference, runs)
        import h5py

        with h5py.File(out, "r+") as f:
            f.attrs[envelope.ATTR] = json.dumps({
                "k": envelope.K, "runs": n, "dtype": dtype, **({"fp8": fp8} if fp8 else {}),
                "orders": [{"grad_accum": g, "attention": a} for g, a in chosen],
                "tensors": measured})
    except BaseException:
        out.unlink(missing_ok=True)
        raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    widest = max(measured.items(), key=lambda kv: kv[1][0])
    say(f"envelope of {n} {dtype} reruns over {len(measured)} tensors: widest {widest[0]} "
        f"(rel fro {widest[1][0]:.2e}); compare --tolerance envelope fails beyond {envelope.K:g} x")
    return {**summary, "envelope": n}
