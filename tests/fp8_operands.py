"""FP8's quantized operands on a layout against the serial model's, bit
for bit (issue 45: "quantized operands and scales of every linear are
bitwise identical across serial, 1-D, 2-D, 2.5-D and 3-D"), for
tests/combo_matrix_check.py's FP8 cases, in their launches: the trace's
own recorder (``analysis.trace_fp8.Fp8Recorder``) watches step 1 of
the reference and of the case, and the pieces are assembled to the
logical tensors as ``trace --fp8`` writes them.

Step 1 only, and not quite every bit: the float64 sums of two layouts
differ in their last bits (their order differs), so an operand whose
exact value is zero (causal attention's first query's gradient: dP - D
with D summed another way) comes out as rounding noise (~1e-22) that
differs between layouts, and so do its FP8 codes and, for a tile of it,
its scale. Those elements, and only those (both sides within ``NOISE``
of the tensor's largest value), may differ (docs/fp8.md)."""

from __future__ import annotations

import numpy as np

from mpicube.analysis.trace_collect import Collector, gather_pieces
from mpicube.analysis.trace_fp8 import Fp8Recorder


def watch(parts, batch: int, seq: int) -> Fp8Recorder:
    """Attach a recorder to ``parts``' FP8 layout (its observer) for one step."""
    recorder = Fp8Recorder(parts.store, Collector(parts, np.float64, batch), seq)
    parts.layout.fp8.observer = recorder
    return recorder


def collected(parts, recorder: Fp8Recorder, micro_batches: int, comm) -> dict:
    """Detach ``recorder``; rank 0 of ``comm``: {name: logical tensor} of the
    step's last micro-batch (the one a trace keeps), others None."""
    parts.layout.fp8.observer = None
    recorder.collect.at(parts.micro_rows(micro_batches - 1).start)
    return gather_pieces(comm, recorder.take())


NOISE = 1e-10      # of a tensor's largest |value|: float64 rounding noise of an exact zero, not a quantization


def values(name: str, tensors: dict, recipe) -> np.ndarray:
    """The operand ``name`` (``fp8/<linear>/<role>.<gemm>/bytes``) as its
    GEMM multiplies it, in float64: its FP8 codes over (times, for MX)
    its scales, each scale spread over its group."""
    role, gemm = name.split("/")[-2].split(".")
    group = recipe.group(role, gemm)
    q = tensors[name].view(recipe.format(role).dtype).astype(np.float64)              # (rows, K)
    scale = tensors[name[:-len("bytes")] + "scale"]
    if isinstance(group, tuple):
        b = group[1]
        scale = np.repeat(scale, b, axis=1)[:, :q.shape[1]]
        if group[0] == "block":
            scale = np.repeat(scale, b, axis=0)[:q.shape[0]]
    if isinstance(group, tuple) and group[0] == "mx":
        return q * np.exp2(scale.astype(np.float64) - 127)                          # E8M0: 2^(e - 127)
    return q / scale.astype(np.float64)


def linear_of(name: str) -> str:
    """``fp8/<linear>/<role>.<gemm>/...`` -> <linear>."""
    return name.split("/")[1]


def unrouted(name: str, ran: set) -> bool:
    """Whether ``name`` is an operand of an expert that serial never ran
    (no token was routed to it: serial skips it, while a layout whose
    experts' amaxes span ranks runs every expert, with no rows too, and
    quantizes its W for nothing)."""
    return ".moe.experts." in name and linear_of(name) not in ran


def differences(got: dict, want: dict, recipe) -> list:
    """What differs between a layout's operands and serial's: names one
    side lacks, then tensors whose bytes or scales are not the same bits,
    except where both sides' values lie within ``NOISE`` of the tensor's
    largest (a tile of rounding noise around an exact zero: its scale
    comes from the noise, and so differs too); an expert serial never ran
    may appear on the layout only (``unrouted``). A case whose linears record
    no x or dy bytes is a failure too (the check would hold nothing)."""
    out = [f"missing on the layout: {n}" for n in sorted(set(want) - set(got))]
    ran = {linear_of(n) for n in want}
    out += [f"not in serial: {n}" for n in sorted(set(got) - set(want)) if not unrouted(n, ran)]
    for name in sorted(n for n in set(got) & set(want) if n.endswith("/bytes")):
        scale = name[:-len("bytes")] + "scale"
        if got[name].shape != want[name].shape or got[scale].shape != want[scale].shape:
            out.append(f"{name}: shape {got[name].shape}, serial's {want[name].shape}")
            continue
        if got[name].tobytes() == want[name].tobytes() and got[scale].tobytes() == want[scale].tobytes():
            continue
        a, b = values(name, got, recipe), values(name, want, recipe)
        off = (a != b) & (np.maximum(abs(a), abs(b)) > NOISE * abs(b).max())
        if off.any():
            out.append(f"{name} or its scale differs (at {np.argwhere(off)[0].tolist()}: {a[off][0]!r} vs "
                       f"serial's {b[off][0]!r})")
    if not any(n.endswith("/x.forward/bytes") for n in want) or not any("/dy." in n and n.endswith("/bytes")
                                                                      for n in want):
        out.append("no x or dy bytes recorded")
    return out
