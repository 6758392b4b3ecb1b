"""The walk of a ``--zero 2/3`` pass over a model's blocks: which slot
holds each segment (``slot_key``: each end segment its own, blocks
alternating between two), the stream a forward or backward pass walks
(``BlockStream``: around each block it asks the store to fetch, prefetch,
clear and reduce), and how many block gathers such walks cost
(``pass_gathers``, ``block_gathers``: the store's behaviour replayed
without arrays, for the cost model, which finds them as ``fsdp.*``).

The store itself (``fsdp.SegmentedStore``) owns the buffers and the
collectives; this module only decides when each happens, through the
store's ``fetch``, ``prefetch``, ``clear_slot``, ``reduce_slot`` and
``wait_gradients``.
"""

from __future__ import annotations

from .params import ResidentLayers
from .zero import is_end


def block_gathers(n_blocks: int, passes_per_step: int) -> int:
    """Block all-gathers per step under --zero 3 (the cost model's count of
    what ``SegmentedStore`` does; ``passes_per_step`` = 2 N for N micro-
    batches): every block in the step's first forward, then L - 2 in each
    later pass (the two slots still hold the last two blocks of the pass
    before at each turn); only the first forward's when all fit in two."""
    L = n_blocks
    if L <= 2:
        return L
    return L + (passes_per_step - 1) * (L - 2)


def pass_gathers(passes, blocks: list) -> int:
    """Block all-gathers of one step under --zero 3 whose passes walk
    ``passes`` (each the block segments of one forward or backward, in the
    order it runs them; a pipeline stage's schedule walks its chunks one
    at a time, in any order) over a store holding ``blocks``: a block is
    gathered unless its slot (``slot_key``) still holds it. This is what
    ``SegmentedStore.fetch`` does, replayed without arrays (the cost model's
    count; ``block_gathers`` is its closed form for one chunk)."""
    return sum(gathers_by_block(passes, blocks).values())


def gathers_by_block(passes, blocks: list) -> dict:
    """{block segment: its all-gathers} of ``pass_gathers``' walk: what
    each block costs, where blocks differ (DeepSeek-V3's first dense
    blocks beside its mixtures)."""
    held, count = {}, {}
    for walk in passes:
        for segment in walk:
            key = slot_key(segment, blocks)
            if held.get(key) != segment:
                held[key], count[segment] = segment, count.get(segment, 0) + 1
    return count


def slot_key(segment: str, blocks: list):
    """Which slot holds ``segment``: each end segment (outside, the tied wte)
    its own, block segments alternate between two (by position among this
    store's blocks)."""
    return segment if is_end(segment) else blocks.index(segment) % 2


class BlockStream(ResidentLayers):
    """One forward or backward pass over a model's blocks under --zero 2/3:
    ``enter(i)`` before block i runs (its parameters gathered, the next
    block's gather started; in backward its gradient slot cleared),
    ``leave(i)`` after (in backward its gradients sent on their way),
    ``finish()`` after backward's last step (the end segments' gradients,
    then every reduce-scatter landed). ``blocks`` are the sites ("h.{i}")
    in the order the model holds them; ``ends`` the end segments (outside,
    the tied wte) the model runs: none for a pipeline chunk between the
    embeddings and the head, so its passes neither clear nor send them."""

    def __init__(self, store, direction: str, blocks: list, ends: list = ()):   # store: an fsdp.SegmentedStore
        self.store, self.backward = store, direction == "backward"
        self.order = list(reversed(blocks)) if self.backward else list(blocks)
        self.step = -1 if self.backward else 1
        self.blocks, self.ends = blocks, list(ends)
        for segment in self.ends:
            store.fetch(segment)
            if self.backward:
                store.clear_slot(segment)
        if self.order:
            store.prefetch(self.order[0])

    def enter(self, i: int) -> None:
        site = self.blocks[i]
        self.store.fetch(site)
        nxt = i + self.step
        self.store.prefetch(self.blocks[nxt] if 0 <= nxt < len(self.blocks) else None)
        if self.backward:
            self.store.clear_slot(site)

    def leave(self, i: int) -> None:
        if self.backward:
            self.store.reduce_slot(self.blocks[i])

    def finish(self) -> None:
        for segment in self.ends:
            self.store.reduce_slot(segment)
        self.store.wait_gradients()
