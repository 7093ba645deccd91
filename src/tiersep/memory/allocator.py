"""A model of PyTorch's CUDA caching allocator, replayed over a traced allocation timeline.

`torch.cuda.max_memory_allocated` counts allocator *blocks*, not tensor bytes: a request is rounded
up to 512 B, and a cached block that is reused for a smaller request is only split when the rest is
worth keeping (>= 512 B in the small pool, > 1 MiB in the large pool), so the unsplit rest counts
as allocated. `max_memory_reserved` counts the segments obtained from cudaMalloc: 2 MiB segments for
requests up to 1 MiB, 20 MiB for requests under 10 MiB, larger requests rounded up to 2 MiB; freed
blocks stay cached and are reused best-fit. Replaying the trace through these rules (the defaults of
c10/cuda/CUDACachingAllocator.cpp, no PYTORCH_CUDA_ALLOC_CONF) predicts both counters.

Not modelled: several streams, allocator config options (expandable_segments,
roundup_power2_divisions, max_split_size_mb), and the release-and-retry on cudaMalloc failure (so
the reserved figure is what an unconstrained GPU would show).
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

MIB = 2**20
MIN_BLOCK = 512            # kMinBlockSize
SMALL_SIZE = 1 * MIB       # kSmallSize: requests up to this use the small pool
SMALL_BUFFER = 2 * MIB     # kSmallBuffer: segment size of the small pool
MIN_LARGE_ALLOC = 10 * MIB  # kMinLargeAlloc: requests below this get a kLargeBuffer segment
LARGE_BUFFER = 20 * MIB    # kLargeBuffer
ROUND_LARGE = 2 * MIB      # kRoundLarge: larger segments are rounded up to this


def segment_size(block: int) -> int:
    if block <= SMALL_SIZE:
        return SMALL_BUFFER
    if block < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-block // ROUND_LARGE) * ROUND_LARGE


class _Block:
    __slots__ = ("addr", "size", "small", "prev", "next", "free")

    def __init__(self, addr, size, small):
        self.addr, self.size, self.small = addr, size, small
        self.prev = self.next = None
        self.free = True


@dataclass
class AllocatorStats:
    peak_allocated: int = 0
    peak_reserved: int = 0
    allocated: int = 0
    reserved: int = 0
    segments: int = 0


class CachingAllocatorModel:
    """Best-fit block allocator with the CUDA caching allocator's pool, split and merge rules."""

    def __init__(self):
        self._free = {True: [], False: []}   # small? -> sorted [(size, addr, block)]
        self._live: dict[int, _Block] = {}   # key -> block
        self._next_addr = 0
        self.stats = AllocatorStats()

    def malloc(self, key: int, nbytes: int) -> None:
        size = max(MIN_BLOCK, -(-nbytes // MIN_BLOCK) * MIN_BLOCK)
        small = size <= SMALL_SIZE
        pool = self._free[small]
        i = bisect.bisect_left(pool, (size, -1))
        if i < len(pool):
            block = pool.pop(i)[2]
        else:
            seg = segment_size(size)
            block = _Block(self._next_addr, seg, small)
            self._next_addr += seg + MIB     # gaps keep segments from ever looking adjacent
            self.stats.reserved += seg
            self.stats.segments += 1
            self.stats.peak_reserved = max(self.stats.peak_reserved, self.stats.reserved)
        rest = block.size - size
        if (small and rest >= MIN_BLOCK) or (not small and rest > SMALL_SIZE):
            tail = _Block(block.addr + size, rest, small)
            tail.prev, tail.next = block, block.next
            if block.next is not None:
                block.next.prev = tail
            block.next = tail
            block.size = size
            self._insert(tail)
        block.free = False
        self._live[key] = block
        self.stats.allocated += block.size
        self.stats.peak_allocated = max(self.stats.peak_allocated, self.stats.allocated)

    def free(self, key: int) -> None:
        block = self._live.pop(key)
        self.stats.allocated -= block.size
        block.free = True
        for neighbour in (block.prev, block.next):
            if neighbour is not None and neighbour.free:
                self._remove(neighbour)
                if neighbour is block.prev:
                    neighbour.size += block.size
                    neighbour.next = block.next
                    if block.next is not None:
                        block.next.prev = neighbour
                    block = neighbour
                else:
                    block.size += neighbour.size
                    block.next = neighbour.next
                    if neighbour.next is not None:
                        neighbour.next.prev = block
        self._insert(block)

    def _insert(self, block: _Block) -> None:
        bisect.insort(self._free[block.small], (block.size, block.addr, block))

    def _remove(self, block: _Block) -> None:
        pool = self._free[block.small]
        i = bisect.bisect_left(pool, (block.size, block.addr))
        assert pool[i][2] is block, "allocator model: free list out of order"
        pool.pop(i)


def replay(timeline, exclude: set[int] = frozenset(), repeat_from: int | None = None,
           keep: set[int] = frozenset()) -> AllocatorStats:
    """Run a tracker Timeline through the allocator model.

    With `repeat_from` (an event index), the events from there on are replayed a second time,
    after freeing what the first pass left live except `keep` (weights, optimizer state): this is
    the steady state of training, where step 2 finds step 1's cached segments.
    """
    model = CachingAllocatorModel()
    sizes = {k: a.nbytes for k, a in timeline.allocations.items()}

    def run(events, offset):
        for key, sign in events:
            if key in exclude:
                continue
            if sign > 0:
                model.malloc(key + offset, sizes[key])
            elif key + offset in model._live:
                model.free(key + offset)

    run(timeline.events, 0)
    if repeat_from is not None:
        step = timeline.events[repeat_from:]
        born = {k for k, s in step if s > 0}
        for key in [k for k in model._live if k in born and k not in keep]:
            model.free(key)
        offset = max(sizes, default=0) + 1
        # Keys that outlive step 1 and are kept (e.g. optimizer state created in step 1) must not
        # be allocated twice.
        run([(k, s) for k, s in step if k not in keep], offset)
    return model.stats
