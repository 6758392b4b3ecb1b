"""``--zero 1``: the optimizer state sharded over the data-parallel replicas
(stage 1 of ZeRO, Rajbhandari et al. 2020).

Why: every data-parallel replica of a tensor-parallel position holds the
same parameters, computes the same update and, with ``--zero 0``, keeps
the same AdamW moments (and, under mixed precision, the same float32
master weights): 8 to 12 bytes per local parameter, repeated dp times.
Here replica r keeps only chunk r of them and updates only that chunk.

Partition: the rank's flat buffer (``ParamStore``, P elements) is padded
with zeros to P_pad = dp * C and cut into dp contiguous chunks of C; replica
r owns ``[r C, (r + 1) C)``. Chunks cut through tensors; nothing outside
the step needs to know, because the step hands back complete parameters.

One step, per rank (``training.step.ShardedStep``; the same calls as ``ReplicatedStep``)::

    sync:      partial gradients summed over the tensor-parallel replica
               groups (as --zero 0), then reduce-scattered over dp: the
               rank's chunk of flat_grad holds the summed gradient, the
               rest of flat_grad is stale
    grad_norm: each rank's chunk, blocks replicated inside the tensor-
               parallel group weighted by 1/replicas, summed by one
               all-reduce over the world (every chunk of every position
               exactly once)
    step:      AdamW on the chunk (moments of C elements), then the
               parameters all-gathered over dp: the updated master chunk
               into the full buffer, or under mixed precision its 16-bit
               rounding into the full working copy (half the bytes; the
               master itself stays sharded)

Communication over dp is (dp-1)/dp P_pad gradient elements reduce-scattered
plus (dp-1) C gathered, where --zero 0 all-reduces 2 (dp-1)/dp P: the same
elements when P_pad = P, fewer bytes under mixed precision (the gathered
parameters are 16-bit words; so, under bfloat16, are the gradients both
steps sum, ``precision.gradient_wire``, and then the elements are equal
whatever P: comm_wire's all-reduce pads to dp C too).

Checkpoints keep format version 1 (full logical tensors): the sharded state
is gathered for a save and scattered (each replica keeps its chunk) on a
load, see ``ParamStore.full_master`` / ``writing_master`` and
``AdamW.full_moments`` / ``writing_moments``.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.errors import ConfigError

CHOICES = (0, 1)


def validate(zero: int, dp: int) -> None:
    """ConfigError for a --zero setting that cannot apply (pure: every rank
    runs it before any collective)."""
    if zero not in CHOICES:
        raise ConfigError(f"--zero must be 0 or 1, got {zero}")
    if zero and dp < 2:
        raise ConfigError(f"--zero {zero} shards the optimizer state over data-parallel replicas and needs "
                          f"--dp 2 or more (got --dp {dp})")


@dataclass(frozen=True)
class Partition:
    """A flat buffer of ``size`` elements in ``parts`` equal contiguous
    chunks (the last padded with zeros); this replica owns chunk ``rank``.
    With one part the rank owns the unpadded whole."""

    size: int        # P: elements the parameters occupy
    parts: int = 1   # dp when sharded, else 1
    rank: int = 0

    @property
    def sharded(self) -> bool:
        return self.parts > 1

    @property
    def padded(self) -> int:
        """P_pad: the buffer length, a multiple of ``parts``."""
        return -(-self.size // self.parts) * self.parts

    @property
    def chunk(self) -> int:
        """C = P_pad / parts: elements each replica owns."""
        return self.padded // self.parts

    @property
    def own(self) -> slice:
        """This replica's chunk of the padded buffer."""
        return slice(self.rank * self.chunk, (self.rank + 1) * self.chunk)

    def local(self, slices) -> list:
        """``slices`` of the whole buffer cut to the owned chunk, in the
        chunk's own coordinates (empty intersections dropped)."""
        own, out = self.own, []
        for s in slices:
            lo, hi = max(s.start, own.start), min(s.stop, own.stop)
            if lo < hi:
                out.append(slice(lo - own.start, hi - own.start))
        return out


def sizes(size: int, dp: int, zero: int) -> tuple:
    """(P_pad, C) for a rank's P parameters: what the cost model predicts."""
    p = Partition(size, dp if zero else 1)
    return p.padded, p.chunk
