"""A faithful model of PyTorch's CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp, torch 2.11).

`torch.cuda.max_memory_allocated` counts allocator *blocks*, `max_memory_reserved` counts device memory
the allocator holds (cudaMalloc'd segments, or pages mapped into expandable segments). The model
replays malloc/free through the allocator's own rules, one stream, one device:

- request rounding: at least 512 B, a multiple of 512 B, or `roundup_power2_divisions`;
- pools: requests <= 1 MiB use the small pool, the rest the large pool;
- native segments (`get_allocation_size`): 2 MiB for small requests, 20 MiB for 1-10 MiB requests,
  larger ones rounded up to 2 MiB;
- best fit: each pool's free blocks ordered by (stream, size, address); the first that fits wins;
- `should_split`: a small-pool block (or any block with expandable segments) is split when >= 512 B
  would remain, a large-pool block when > 1 MiB would remain and the request is below
  `max_split_size`; blocks >= `max_split_size` only serve requests >= `max_split_size` that are at
  most `max_non_split_rounding` (20 MiB) smaller;
- a freed block merges with free neighbours of its segment;
- expandable segments: one virtual segment per pool (and stream), of 1 1/8 the GPU's memory, mapped
  in pages (2 MiB small pool, 20 MiB large pool) from its lowest free address as needed.
  `max_memory_reserved` then counts mapped pages.

Not modelled (documented limits): several streams and record_stream, CUDA graph pools, the
release-and-retry on cudaMalloc failure and empty_cache (so segments are never freed or unmapped:
the figures are those of a GPU that never runs out of memory), garbage_collection_threshold.
"""
from __future__ import annotations

import bisect
import gzip
import json
from dataclasses import dataclass, field
from pathlib import Path

MIB = 2**20
MIN_BLOCK = 512                 # kMinBlockSize
SMALL_SIZE = 1 * MIB            # kSmallSize: requests up to this use the small pool
SMALL_BUFFER = 2 * MIB          # kSmallBuffer: small segments, and small expandable pages
MIN_LARGE_ALLOC = 10 * MIB      # kMinLargeAlloc: requests below this get a large_segment_size segment
LARGE_BUFFER = 20 * MIB         # large_segment_size default: segment for 1-10 MiB, large expandable page
ROUND_LARGE = 2 * MIB           # kRoundLarge: larger segments are rounded up to this
H100_80GB_BYTES = 85_017_493_504  # H100 80GB HBM3 total memory as CUDA reports it (measurements.jsonl)
UNLIMITED = 2**64 - 1           # max_split_size default (SIZE_MAX)


@dataclass(frozen=True)
class AllocatorConfig:
    """The PYTORCH_CUDA_ALLOC_CONF options the model follows (torch's defaults)."""

    expandable_segments: bool = False
    max_split_size: int = UNLIMITED                 # bytes (max_split_size_mb)
    max_non_split_rounding: int = LARGE_BUFFER      # bytes (max_non_split_rounding_mb)
    roundup_power2_divisions: tuple = ()           # 16 per-interval divisions (1 MiB..64 GiB), or ()
    large_segment_size: int = LARGE_BUFFER          # bytes (large_segment_size_mb)
    device_total_bytes: int = H100_80GB_BYTES       # sizes the expandable segments' address space

    @staticmethod
    def power2_divisions(spec) -> tuple:
        """`roundup_power2_divisions` as torch parses it: an int for every interval, or a dict
        {size_mb (a power of two) or ">": divisions} where the first key also covers smaller sizes
        and ">" every interval after the last key."""
        if isinstance(spec, int):
            return (spec,) * 16
        out, last = [0] * 16, 0
        for key, val in spec.items():
            if key == ">":
                out[last:] = [val] * (16 - last)
                continue
            if key <= 0 or key & (key - 1):
                raise ValueError(f"roundup_power2_divisions: {key} MB is not a power of two")
            index = min(key.bit_length() - 1, 15)
            if last == 0:
                out[:index] = [val] * index
            out[index], last = val, index
        return tuple(out)


def _power2_division(size: int, divisions: int) -> int:
    """roundup_power2_next_division: round up to the next 1/divisions step between powers of two."""
    if size & (size - 1) == 0:
        return size
    floor = 1 << (size.bit_length() - 1)
    step = floor >> (divisions.bit_length() - 1)
    if step == 0:
        return floor << 1
    return size if size % step == 0 else (size & ~(step - 1)) + step


def round_size(nbytes: int, config: AllocatorConfig = AllocatorConfig()) -> int:
    """The block size the allocator books for a request (round_size)."""
    if nbytes < MIN_BLOCK:
        return MIN_BLOCK
    if config.roundup_power2_divisions:
        # Interval index: log2(size) - log2(1 MiB), clamped to the 16 intervals 1 MiB..64 GiB.
        index = min(max(nbytes.bit_length() - 1 - 20, 0), 15)
        divisions = config.roundup_power2_divisions[index]
        if divisions > 1 and nbytes > MIN_BLOCK * divisions:
            return _power2_division(nbytes, divisions)
    return -(-nbytes // MIN_BLOCK) * MIN_BLOCK


def segment_size(block: int, large_segment_size: int = LARGE_BUFFER) -> int:
    """Size of the segment cudaMalloc'd for a rounded request no cached block fits (get_allocation_size)."""
    if block <= SMALL_SIZE:
        return SMALL_BUFFER
    if block < MIN_LARGE_ALLOC:
        return large_segment_size
    return -(-block // ROUND_LARGE) * ROUND_LARGE


class _Block:
    __slots__ = ("addr", "size", "pool", "prev", "next", "allocated", "mapped", "segment")

    def __init__(self, addr, size, pool, segment=None, mapped=True):
        self.addr, self.size, self.pool, self.segment, self.mapped = addr, size, pool, segment, mapped
        self.prev = self.next = None
        self.allocated = False


class _ExpandableSegment:
    __slots__ = ("base", "page", "size")

    def __init__(self, base, page, size):
        self.base, self.page, self.size = base, page, size


class _Pool:
    """One BlockPool: free mapped blocks by (size, address), unmapped ones by address."""

    __slots__ = ("small", "blocks", "unmapped")

    def __init__(self, small):
        self.small = small
        self.blocks: list = []     # sorted [(size, addr, block)]
        self.unmapped: list = []   # sorted [(addr, block)]

    def insert(self, block):
        bisect.insort(self.blocks, (block.size, block.addr, block))

    def remove(self, block):
        i = bisect.bisect_left(self.blocks, (block.size, block.addr))
        assert self.blocks[i][2] is block, "allocator model: free list out of order"
        del self.blocks[i]

    def insert_unmapped(self, block):
        bisect.insort(self.unmapped, (block.addr, block))

    def remove_unmapped(self, block):
        i = bisect.bisect_left(self.unmapped, (block.addr,))
        assert self.unmapped[i][1] is block, "allocator model: unmapped list out of order"
        del self.unmapped[i]


@dataclass
class AllocatorStats:
    peak_allocated: int = 0
    peak_reserved: int = 0
    allocated: int = 0
    reserved: int = 0
    segments: int = 0     # device allocations: cudaMalloc calls, or page mappings when expandable
    skipped_events: int = 0   # events of repeated copies not replayed, their outcome known (replay)


class CachingAllocatorModel:
    """malloc(key, nbytes) / free(key) through the CUDA caching allocator's rules, with its counters.

    `segment_addresses`: addresses for the native segments, in order (e.g. the ones cudaMalloc gave a
    recorded run; best fit breaks size ties by address). Without it, segments get increasing
    addresses. `device_allocs` lists (address, bytes) of every cudaMalloc / page mapping, in order.
    """

    def __init__(self, expandable_segments: bool = False, *, config: AllocatorConfig | None = None,
                 segment_addresses=None):
        if config is None:
            config = AllocatorConfig(expandable_segments=expandable_segments)
        elif expandable_segments and not config.expandable_segments:
            raise ValueError("expandable_segments=True contradicts config.expandable_segments=False")
        self.config = config
        self._pools = {True: _Pool(True), False: _Pool(False)}
        self._live: dict = {}                  # key -> allocated block
        self._addresses = iter(segment_addresses) if segment_addresses is not None else None
        self._next_addr = 1 << 40
        self.stats = AllocatorStats()
        self.device_allocs: list[tuple[int, int]] = []

    # -- public API -------------------------------------------------------------------------------
    def malloc(self, key, nbytes: int) -> int:
        """Allocate `nbytes` for `key`; returns the block's address."""
        if key in self._live:
            raise KeyError(f"allocator model: key {key!r} is already allocated")
        size = round_size(nbytes, self.config)
        pool = self._pools[size <= SMALL_SIZE]
        block = self._get_free_block(pool, size)
        if block is None:
            block = (self._alloc_expandable(pool, size) if self.config.expandable_segments
                     else self._alloc_segment(pool, size))
        if self._should_split(block, size):
            # The allocated front keeps the address; the rest stays cached as a free block.
            front = _Block(block.addr, size, pool, block.segment)
            front.prev, front.next = block.prev, block
            if block.prev is not None:
                block.prev.next = front
            block.prev = front
            block.addr += size
            block.size -= size
            pool.insert(block)
            block = front
        block.allocated = True
        self._live[key] = block
        st = self.stats
        st.allocated += block.size
        if st.allocated > st.peak_allocated:
            st.peak_allocated = st.allocated
        return block.addr

    def free(self, key) -> None:
        block = self._live.pop(key)
        self.stats.allocated -= block.size
        block.allocated = False
        pool = block.pool
        self._merge(block, block.prev, pool)
        self._merge(block, block.next, pool)
        pool.insert(block)

    # -- rules ------------------------------------------------------------------------------------
    def _should_split(self, block: _Block, size: int) -> bool:
        remaining = block.size - size
        if block.pool.small or self.config.expandable_segments:
            return remaining >= MIN_BLOCK
        return size < self.config.max_split_size and remaining > SMALL_SIZE

    def _get_free_block(self, pool: _Pool, size: int):
        blocks = pool.blocks
        i = bisect.bisect_left(blocks, (size,))
        if i == len(blocks):
            return None
        block = blocks[i][2]
        if block.segment is not None:
            # Best fit over the size a block can grow to: a free block followed by unmapped pages of
            # its expandable segment counts as that large, so it is chosen last.
            def grows_to(b):
                return b.size + (b.next.size if b.next is not None and not b.next.mapped else 0)
            while i + 1 < len(blocks) and grows_to(blocks[i + 1][2]) < grows_to(block):
                i += 1
                block = blocks[i][2]
        cfg = self.config
        if size < cfg.max_split_size and block.size >= cfg.max_split_size:
            return None        # an oversize cached block does not serve a smaller request
        if size >= cfg.max_split_size and block.size >= size + cfg.max_non_split_rounding:
            return None        # nor a much smaller oversize one
        del blocks[i]
        return block

    def _alloc_segment(self, pool: _Pool, size: int) -> _Block:
        nbytes = segment_size(size, self.config.large_segment_size)
        addr = next(self._addresses, None) if self._addresses is not None else None
        if addr is None:       # no (more) given addresses
            addr = self._next_addr
            self._next_addr += nbytes + ROUND_LARGE   # a gap: segments never look adjacent
        self._count_device_alloc(addr, nbytes)
        return _Block(addr, nbytes, pool)

    def _count_device_alloc(self, addr: int, nbytes: int) -> None:
        st = self.stats
        st.reserved += nbytes
        st.segments += 1
        if st.reserved > st.peak_reserved:
            st.peak_reserved = st.reserved
        self.device_allocs.append((addr, nbytes))

    # -- expandable segments ----------------------------------------------------------------------
    def _alloc_expandable(self, pool: _Pool, size: int) -> _Block:
        """try_allocate_expandable_block: map pages from the lowest address with room for `size`."""
        candidate = self._find_expandable_block(pool, size)
        if not candidate.mapped:
            self._map(candidate, min(candidate.size, size))
        while candidate.size < size:
            # candidate is free and mapped, its next is unmapped: map what is missing; the newly
            # mapped block absorbs candidate.
            nxt = candidate.next
            self._map(nxt, min(size - candidate.size, nxt.size))
            candidate = nxt
        pool.remove(candidate)
        return candidate

    def _find_expandable_block(self, pool: _Pool, size: int) -> _Block:
        def free_run(b):
            total = 0
            while total < size and b is not None and not b.allocated:
                total += b.size
                b = b.next
            return total >= size

        for _, block in pool.unmapped:
            if block.prev is not None and not block.prev.allocated:
                block = block.prev
            if free_run(block):
                return block
        page = SMALL_BUFFER if pool.small else self.config.large_segment_size
        total = self.config.device_total_bytes
        span = -(-(total + total // 8) // page) * page     # address space: 1 1/8 the GPU memory
        base = -(-self._next_addr // page) * page
        self._next_addr = base + span + page
        block = _Block(base, span, pool, _ExpandableSegment(base, page, span), mapped=False)
        pool.insert_unmapped(block)
        return block

    def _map(self, block: _Block, nbytes: int) -> None:
        """map_block: back [block.addr, block.addr + nbytes) with whole pages, split off the rest."""
        seg, pool = block.segment, block.pool
        first = (block.addr - seg.base) // seg.page
        end = -(-(block.addr + nbytes - seg.base) // seg.page)
        mapped = (end - first) * seg.page
        pool.remove_unmapped(block)
        block.mapped = True
        if mapped < block.size:
            rest = _Block(block.addr + mapped, block.size - mapped, pool, seg, mapped=False)
            rest.prev, rest.next = block, block.next
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            pool.insert_unmapped(rest)
            block.size = mapped
        self._merge(block, block.prev, pool)
        self._merge(block, block.next, pool)
        pool.insert(block)
        self._count_device_alloc(block.addr, mapped)

    def state(self, name) -> tuple:
        """Everything the model's next steps depend on, its keys named by `name(key)`: every block
        (address, size, allocated to whom, mapped, its segment's ends) and the counters but the peaks."""
        owner = {id(b): name(k) for k, b in self._live.items()}
        blocks = list(self._live.values())
        for pool in self._pools.values():
            blocks += [b for _, _, b in pool.blocks] + [b for _, b in pool.unmapped]
        st = self.stats
        return (st.allocated, st.reserved, st.segments, self._next_addr,
                tuple(sorted((b.addr, b.size, b.pool.small, b.mapped, b.prev is None, b.next is None,
                              owner.get(id(b))) for b in blocks)))

    def rename(self, name) -> None:
        """Give every allocated block the key `name(key)`."""
        self._live = {name(k): b for k, b in self._live.items()}

    def _merge(self, dst: _Block, src: _Block | None, pool: _Pool) -> None:
        """try_merge_blocks: absorb a free neighbour in the same mapped state."""
        if src is None or src.allocated or src.mapped != dst.mapped:
            return
        if src is dst.prev:
            dst.addr = src.addr
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size
        if src.mapped:
            pool.remove(src)
        else:
            pool.remove_unmapped(src)


# The longest cycle of states a run of repeated copies is looked at for (replay): a leftover block
# that alternates between two free holes makes a cycle of 2.
STEADY_PERIODS = 4


def replay(timeline, exclude: set[int] = frozenset(), repeat_from: int | None = None,
           keep: set[int] = frozenset(), expandable_segments: bool = False,
           skip_steady: bool = True) -> AllocatorStats:
    """Run a tracker Timeline through the allocator model.

    With `repeat_from` (an event index), the events from there on are replayed a second time,
    after freeing what the first pass left live except `keep` (weights, optimizer state): this is
    the steady state of training, where step 2 finds step 1's cached segments.
    With `skip_steady`, a run of repeated copies (timeline.repeats: gradient accumulation's
    micro-batches) stops being replayed once the model's state (`state`, the copies' keys named
    relative to the copy) comes back to one it had a few copies before: the later copies would
    cycle through the same states again, so the peaks stand and only the keys move on (the figures
    are those of a full replay: tests/test_memory_cuda_model.py).
    """
    model = CachingAllocatorModel(expandable_segments)
    sizes = {k: a.nbytes for k, a in timeline.allocations.items()}

    def run(events, offset=0):
        live = model._live
        for key, sign in events:
            if key in exclude:
                continue
            if sign > 0:
                model.malloc(key + offset, sizes[key])
            elif key + offset in live:
                model.free(key + offset)

    done = 0
    for start, length, count, shift, base in sorted(timeline.repeats) if skip_steady else ():
        run(timeline.events[done:start])
        seen, copy = [], 0
        while copy < count:
            def relative(key, copy=copy):   # a copy's keys by (copies back from this one, which)
                return key if key < base else (copy - (key - base) // shift, (key - base) % shift)

            if not seen or seen[-1] is not None:
                now = model.state(relative)
                period = next((p for p in range(1, len(seen) + 1) if seen[-p] == now), None)
                seen = seen[-(STEADY_PERIODS - 1):] + [now]
                if period:   # the last `period` copies came back to where they began: skip their repeats
                    skip = (count - copy) // period * period
                    model.rename(lambda key: key if key < base else key + skip * shift)
                    model.stats.skipped_events += skip * length
                    copy += skip
                    seen.append(None)   # the rest (fewer than a period) is replayed
                    continue
            run(timeline.events[start + copy * length:start + (copy + 1) * length])
            copy += 1
        done = start + count * length
    run(timeline.events[done:])
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


# -- recorded allocator event logs (torch.cuda.memory._record_memory_history) ---------------------

ACTIONS = ("alloc", "free_requested", "free_completed", "segment_alloc", "segment_free")


class EventLogError(ValueError):
    """A log that cannot be replayed; the message is one line naming the file and the field."""


@dataclass
class EventLog:
    path: str
    name: str
    config: dict
    result: dict
    events: list                 # [(action, address, size)]
    segments_at_end: list        # [(address, total_size, pool)]

    @property
    def recorded_segments(self) -> list[tuple[int, int]]:
        return [(a, s) for act, a, s in self.events if act == "segment_alloc"]

    def prelog_blocks(self) -> list[tuple[int, int, int, bool]]:
        """What the allocator held before the log began: [(segment address, segment size,
        allocated bytes at its start, small pool)].

        A segment that exists at the end but was not allocated in the log predates it. The part of
        it below the lowest address the log ever allocates there was allocated before the log and
        stays so (best fit would otherwise have used it): for these logs, the cuBLAS workspace
        filling a 32 MiB large segment, and one 256 KiB block (a 256x256 fp32 GEMM operand) at the
        start of a 2 MiB small segment whose rest is free.
        """
        created = {a for a, _ in self.recorded_segments}
        out = []
        for addr, total, pool in self.segments_at_end:
            if addr in created:
                continue
            used = [a for act, a, _ in self.events if act == "alloc" and addr <= a < addr + total]
            out.append((addr, total, (min(used) if used else addr + total) - addr, pool == "small"))
        return out


def _fail(path, field_name, why):
    raise EventLogError(f"{path}: {field_name}: {why}")


def load_event_log(path) -> EventLog:
    """Read a `*.events.json.gz` (or plain JSON) allocator event log, validating every field used."""
    path = Path(path)
    try:
        raw = path.read_bytes()
        data = json.loads(gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw)
    except (OSError, EOFError, ValueError) as exc:
        raise EventLogError(f"{path}: not a readable (gzipped) JSON file: "
                            f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
    if not isinstance(data, dict):
        _fail(path, "(top level)", "expected an object")
    for key, kind in (("events", list), ("segments_at_end", list), ("result", dict)):
        if not isinstance(data.get(key), kind):
            _fail(path, key, f"missing or not a {kind.__name__}")
    events = []
    for i, ev in enumerate(data["events"]):
        if (not isinstance(ev, list) or len(ev) != 3 or ev[0] not in ACTIONS
                or not all(isinstance(x, int) and x >= 0 for x in ev[1:])):
            _fail(path, f"events[{i}]", f"expected [action in {'/'.join(ACTIONS)}, address, size], "
                                        f"got {json.dumps(ev)[:60]}")
        events.append((ev[0], ev[1], ev[2]))
    segments = []
    for i, seg in enumerate(data["segments_at_end"]):
        if (not isinstance(seg, list) or len(seg) != 3 or seg[2] not in ("small", "large")
                or not all(isinstance(x, int) and x > 0 for x in seg[:2])):
            _fail(path, f"segments_at_end[{i}]", f"expected [address, size, small|large], "
                                                 f"got {json.dumps(seg)[:60]}")
        segments.append((seg[0], seg[1], seg[2]))
    result = data["result"]
    name = result.get("name") or path.name.split(".")[0]
    return EventLog(str(path), name, data.get("config") or {}, result, events, segments)


@dataclass
class LogReplay:
    reserved_peak: int
    allocated_peak: int
    segments: list[int]                  # bytes of each cudaMalloc / page mapping, in order
    address_mismatches: int = 0          # allocs placed elsewhere than recorded (native, recorded addresses)
    prelog: list = field(default_factory=list)


def replay_events(log: EventLog, expandable_segments: bool = False,
                  recorded_addresses: bool = True) -> LogReplay:
    """Replay the log's alloc / free_completed sequence (requested sizes; the model rounds them).

    The allocator's state at the start of the log (see EventLog.prelog_blocks) is rebuilt first by
    allocating the pre-log blocks. In native mode with `recorded_addresses`, segments get the
    addresses cudaMalloc gave the recorded run, in order, so that best fit breaks ties the same way
    and every alloc can be checked to land at its recorded address.
    """
    prelog = log.prelog_blocks()
    addresses = None
    if recorded_addresses and not expandable_segments:
        addresses = [a for a, _, _, _ in prelog] + [a for a, _ in log.recorded_segments]
    model = CachingAllocatorModel(expandable_segments, segment_addresses=addresses)
    for i, (addr, total, used, small) in enumerate(prelog):
        # A pre-log segment the log allocates from its start was cached free: create it, free it.
        request = used or (MIN_BLOCK if small else total)
        model.malloc(("prelog", i), request)
        if not expandable_segments and model.device_allocs[-1][1] != total:
            _fail(log.path, f"segments_at_end ({addr:#x})",
                  f"a {request} B pre-log block gives a {model.device_allocs[-1][1]} B segment, not {total}")
        if not used:
            model.free(("prelog", i))
    skip = len(model.device_allocs)
    mismatches = 0
    for i, (action, addr, size) in enumerate(log.events):
        if action == "alloc":
            got = model.malloc(addr, size)
            mismatches += addresses is not None and got != addr
        elif action == "free_completed":
            if addr not in model._live:
                _fail(log.path, f"events[{i}]", f"free_completed of {addr:#x}, which is not allocated")
            model.free(addr)
    return LogReplay(model.stats.peak_reserved, model.stats.peak_allocated,
                     [n for _, n in model.device_allocs[skip:]], mismatches, prelog)


def load_expandable_reference(path, name: str) -> dict:
    """The entry `name` of an expandable_segments.jsonl (max_memory_reserved/allocated measured with
    expandable_segments:True)."""
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise EventLogError(f"{path}: cannot read: {exc.strerror}") from None
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except ValueError:
            _fail(path, f"line {i}", "not JSON")
        if isinstance(entry, dict) and entry.get("name") == name:
            for key in ("max_memory_reserved", "max_memory_allocated"):
                if not isinstance(entry.get(key), int):
                    _fail(path, f"line {i}: {key}", "missing or not an integer")
            return entry
    _fail(path, "name", f"no entry named {name!r}")


def _rel(model: int, recorded: int | None):
    return None if not recorded else model / recorded - 1


def replay_report(log: EventLog, expandable_segments: bool = False, reference: dict | None = None,
                  recorded_addresses: bool = True) -> dict:
    """Replay `log` and compare with what was recorded: the log's own segments and counters in
    native mode, the `reference` entry (load_expandable_reference) in expandable mode."""
    r = replay_events(log, expandable_segments, recorded_addresses)
    out = {"log": log.path, "name": log.name, "mode": "expandable" if expandable_segments else "native",
           "reserved_peak_bytes": r.reserved_peak, "allocated_peak_bytes": r.allocated_peak,
           "segments": r.segments, "prelog_blocks": [[a, t, u, "small" if s else "large"]
                                                     for a, t, u, s in r.prelog]}
    if expandable_segments:
        rec_reserved = reference["max_memory_reserved"] if reference else None
        rec_allocated = reference["max_memory_allocated"] if reference else None
        out["recorded"] = {"source": "expandable_segments reference" if reference else None,
                           "reserved_peak_bytes": rec_reserved, "allocated_peak_bytes": rec_allocated}
    else:
        recorded = [s for _, s in log.recorded_segments]
        rec_reserved, rec_allocated = log.result.get("reserved"), log.result.get("alloc")
        out["recorded"] = {"source": "event log", "reserved_peak_bytes": rec_reserved,
                           "allocated_peak_bytes": rec_allocated, "segments": recorded}
        out["segments_match"] = r.segments == recorded
        out["segment_count_error"] = len(r.segments) - len(recorded)
        out["segment_bytes_error"] = _rel(sum(r.segments), sum(recorded))
        out["address_mismatches"] = r.address_mismatches if recorded_addresses else None
    out["reserved_peak_error"] = _rel(r.reserved_peak, rec_reserved)
    out["allocated_peak_error"] = _rel(r.allocated_peak, rec_allocated)
    return out
