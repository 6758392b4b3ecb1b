"""FP8's quantized operands on a layout against the serial model's, bit
for bit (issue 45: "quantized operands and scales of every linear are
bitwise identical across serial, 1-D, 2-D, 2.5-D and 3-D"), for
tests/combo_matrix_check.py's FP8 cases, in their launches: the trace's
own recorder (``analysis.trace_fp8.Fp8Recorder``) watches step 1 of
the reference and of the case, and the pieces are assembled to the
logical tensors as ``trace --fp8`` writes them.

Step 1, every byte and scale, with one reading: FP8's two zeros (0x00
and 0x80) are the same number. The float64 sums of two layouts differ in
their last bits (their order differs), and rounding into FP8 hides that
everywhere but at the sign of a value that rounds to zero (a GELU of a
large negative input, a gradient that is an exact zero computed as a
difference). Causal attention's first-query gradient, such a zero in every
sequence, is made an exact zero on every layout
(ops/attention_blocks.first_query_exact), so under a tile scale its tile
is not a block of noise with a scale of its own (docs/fp8.md, "Across
layouts")"""

from __future__ import annotations

import re

import numpy as np

from mpicube.analysis.trace_collect import Collector, gather_pieces
from mpicube.analysis.trace_fp8 import Fp8Recorder


def watch(parts, batch: int, seq: int) -> Fp8Recorder:
    """Attach a recorder to ``parts``' FP8 layout (its observer) for one step."""
    recorder = Fp8Recorder(parts.store, Collector(parts, np.float64, batch), seq)
    parts.layout.fp8.observer = recorder
    pipe = parts.pipeline
    recorder.watch([pipe.chunk_model(v) for v in range(pipe.V)] if pipe is not None else [parts.model.model])
    return recorder


def collected(parts, recorder: Fp8Recorder, micro_batches: int, comm) -> dict:
    """Detach ``recorder``; rank 0 of ``comm``: {name: logical tensor} of the
    step's last micro-batch (the one a trace keeps), others None."""
    parts.layout.fp8.observer = None
    recorder.unwatch()
    recorder.collect.at(parts.micro_rows(micro_batches - 1).start)
    return gather_pieces(comm, recorder.take(comm))


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


def folded(codes: np.ndarray) -> np.ndarray:
    """FP8 codes with negative zero (0x80) read as 0x00: both formats'
    sign-and-magnitude zeros are one number, and which of them a value that
    rounds to zero lands on is the sign of its float64 rounding noise."""
    return np.where(codes == 0x80, np.uint8(0), codes)


EXPERT_ROWS = re.compile(r"(^|/)fp8/h\.\d+\.moe\.experts\.\d+\.\w+/(x|dy)\.")   # an expert's x and dy


def differences(got: dict, want: dict, recipe, noise: float = 0.0) -> list:
    """What differs between a layout's operands and serial's: names one
    side lacks, then tensors whose scales are not the same bits or whose
    codes are not the same numbers (``folded``), with the first element
    that differs. A case whose linears record no x or dy bytes is a
    failure too (the check would hold nothing), and so is one with experts
    that records none of theirs (serial places every expert's rows).

    ``noise`` > 0 (a fraction of a tensor's largest value) lets elements
    differ where both sides' values lie below it, scales included: for two
    implementations of attention (the GPU path's array code against the
    CPU's numba kernels) that sum in different orders, an exact zero that is
    a difference of sums (a sequence that repeats a token has equal value
    rows, so a query's score gradients cancel) is rounding noise on one and
    zero on the other, and a tile of it gets a scale of its own."""
    experts = any(".moe.experts." in n for n in want)
    if experts and not any(EXPERT_ROWS.search(n) and n.endswith("/bytes") for n in want):
        return ["no expert's x or dy bytes recorded by serial"]
    out = [f"missing on the layout: {n}" for n in sorted(set(want) - set(got))]
    out += [f"not in serial: {n}" for n in sorted(set(got) - set(want))]
    for name in sorted(n for n in set(got) & set(want) if n.endswith("/bytes")):
        scale = name[:-len("bytes")] + "scale"
        if got[name].shape != want[name].shape or got[scale].shape != want[scale].shape:
            out.append(f"{name}: shape {got[name].shape}, serial's {want[name].shape}")
            continue
        bits = [np.ascontiguousarray(side[scale]) for side in (got, want)]
        scales_off = np.argwhere(bits[0].view(f"u{bits[0].itemsize}") != bits[1].view(f"u{bits[1].itemsize}"))
        codes_off = np.argwhere(folded(got[name]) != folded(want[name]))
        if not len(scales_off) and not len(codes_off):
            continue
        a, b = values(name, got, recipe), values(name, want, recipe)
        if noise > 0:
            off = (a != b) & (np.maximum(abs(a), abs(b)) > noise * abs(b).max())
            if off.any():
                at = tuple(np.argwhere(off)[0])
                out.append(f"{name} or its scale differs (at {list(at)}: {a[at]!r} vs serial's {b[at]!r})")
        elif len(scales_off):
            at = tuple(scales_off[0])
            out.append(f"{scale} differs (at {list(at)}: {bits[0][at]!r} vs serial's {bits[1][at]!r})")
        else:
            at = tuple(codes_off[0])
            out.append(f"{name} differs (at {list(at)}: {a[at]!r} vs serial's {b[at]!r})")
    if not any(n.endswith("/x.forward/bytes") for n in want) or not any("/dy." in n and n.endswith("/bytes")
                                                                      for n in want):
        out.append("no x or dy bytes recorded")
    return out
