"""A deep preset's step from a trace of a few of its blocks: the same timeline, event for event.

TF-Locoformer's blocks are identical, so a step's events repeat block by block. record_step traces a
deep preset with TRACED_BLOCKS blocks, tagging each event with the block whose work made it
(`BlockTagger`), then `extend` copies block `TEMPLATE`'s events for the blocks it left out.
bench/depth_extension.py compares the result with the trace at full depth, event by event, and
tests/test_memory_depth.py checks it on the seed tiers' variants.

How an event is tagged:
- in a block's forward, and in its recomputation under checkpointing: that block (module hooks);
- in the backward: the block whose forward created the running autograd node (the nodes' sequence
  numbers between that block's forward hooks);
- elsewhere (the weights arriving, AdamW's setup and update, clipping): the block of the tensor the
  op works on; a foreach op's output i: the block of its list's element i. What AdamW allocates from
  no tensor (a parameter's step counter) takes the tag of the allocation right after it.
A key's owner is the tag of its allocation; an untagged event counts as its key owner's.

How a timeline of D blocks becomes one of N: each maximal run of the template block's events gets
N - D copies, after it where blocks ascend (forward, the per-parameter lists), before it where they
descend (backward). An event of block t that refers to a key of block o refers, in the copy for
block v, to block v + (o - t)'s key in the same role (its index among its block's allocations). The
copies' keys are new; the blocks after them keep their keys and move up by N - D. An op over a list
of every block's tensors (clipping's stack of per-parameter norms) grows by the template's share.

Anything else raises CannotExtend, and record_step traces the whole depth instead: blocks that do not
allocate alike, a run of the template between two untagged runs, another op over many blocks' tensors.
"""
from __future__ import annotations

import bisect
import contextlib
from dataclasses import dataclass, field

import torch
from torch.utils._pytree import tree_flatten

from .tracker import Allocation, StorageTracker, Timeline, cuda_block_bytes

TRACED_BLOCKS = 5    # the template's neighbours must allocate as it does: the first and last blocks do not
TEMPLATE = 2


class CannotExtend(ValueError):
    """The traced blocks do not repeat in a way `extend` can copy (module docstring)."""


class BlockTagger(StorageTracker):
    """A StorageTracker that also records which block's work made each event (module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.tags: list = []             # per event: its block, or None
        self.owner: dict = {}            # key -> the block of its allocation, or None
        self.aggregates: dict = {}       # key -> (op, each list element's block, shape, element size)
        self.blocks: list[int] = []      # blocks whose forward runs now (innermost last)
        self.ranges: list[tuple] = []    # (first, end, block): autograd sequence numbers of a block's forward
        self.param_block: dict[int, int] = {}   # id(parameter or buffer) -> block
        self._tag = None                 # the tag of the allocation being recorded
        self._tag_of = None              # the op being recorded: output index -> its tag

    def now(self) -> int | None:
        """The block whose work runs now: a forward hook's, or the running autograd node's."""
        if self.blocks:
            return self.blocks[-1]
        if torch._C._current_graph_task_id() != -1:
            node = torch._C._current_autograd_node()
            if node is not None:
                seq = node._sequence_nr()
                i = bisect.bisect_right(self.ranges, (seq, float("inf"), 0)) - 1
                if i >= 0 and self.ranges[i][0] <= seq < self.ranges[i][1]:
                    return self.ranges[i][2]
        return None

    def block_of(self, value) -> int | None:
        key = self.key_of(value) if isinstance(value, torch.Tensor) else None
        return self.owner.get(key) if key is not None else None

    def register(self, tensors, op: str = "<registered>") -> list[int]:
        keys = []
        for t in tensors:
            self._tag = self.param_block.get(id(t))
            if (k := self._see(t, op)) is not None:
                keys.append(k)
        self._tag = None
        return keys

    def _record(self, func, name: str, args, kwargs, outputs: list) -> None:
        here = self.now()
        listed = args[0] if args and isinstance(args[0], (list, tuple)) else None
        per_element = listed is not None and name.startswith("_foreach")
        elements = [self.block_of(x) for x in listed] if listed is not None and not per_element and here is None else []
        spans = len(set(elements) - {None}) > 1       # an op over many blocks' tensors: its own

        found = []                       # the block of the first tagged argument, looked up once per op

        def tag_of(i):
            if here is not None or spans:
                return here
            if per_element and 0 <= i < len(listed):
                return self.block_of(listed[i])
            if not found:
                found.append(next((b for v in tree_flatten((args, kwargs))[0]
                                   if (b := self.block_of(v)) is not None), None))
            return found[0]

        self._tag_of = tag_of
        super()._record(func, name, args, kwargs, outputs)
        self._tag_of = self._tag = None
        for value in outputs if spans else ():
            key = self.key_of(value) if isinstance(value, torch.Tensor) else None
            if key is not None and self.owner.get(key) is None:
                self.aggregates[key] = (name, elements, tuple(value.shape), value.element_size())

    def _seeing(self, index: int) -> None:
        self._tag = self._tag_of(index)

    def _new_key(self, allocation: Allocation) -> int:
        key = super()._new_key(allocation)
        tag = self._tag if self._tag is not None else self.now()
        self.owner[key] = tag
        self.tags.append(tag)
        return key

    def _free(self, key: int) -> None:
        before = len(self.timeline.events)
        super()._free(key)
        after = len(self.timeline.events)
        if after == before + 1:
            self.tags.append(self.now())
        elif after == before - 1:        # _take_over dropped the allocation it replaced
            self.tags.pop()


@dataclass
class BlockCounts:
    """What block TEMPLATE's work adds besides events: the SDPA kernels it called."""
    kernels: dict = field(default_factory=dict)


@contextlib.contextmanager
def tagging(model: torch.nn.Module, tracker: BlockTagger, emulation=None):
    """Mark each of model.blocks' forwards (and recomputations) on `tracker`; yields the template's
    BlockCounts (its kernel calls, counted on `emulation`)."""
    counts, handles, starts = BlockCounts(), [], []
    for i, block in enumerate(model.blocks):
        for p in list(block.parameters()) + list(block.buffers()):
            tracker.param_block[id(p)] = i

        def pre(module, args, i=i):
            tracker.blocks.append(i)
            counting = i == TEMPLATE and emulation is not None
            starts.append((torch._C._autograd._get_sequence_nr(), dict(emulation.kernels_used) if counting else {}))

        def post(module, args, output, i=i):
            tracker.blocks.pop()
            seq, kernels = starts.pop()
            bisect.insort(tracker.ranges, (seq, torch._C._autograd._get_sequence_nr(), i))
            if i == TEMPLATE and emulation is not None:
                for kind, n in emulation.kernels_used.items():
                    counts.kernels[kind] = counts.kernels.get(kind, 0) + n - kernels.get(kind, 0)

        handles += [block.register_forward_pre_hook(pre), block.register_forward_hook(post, always_call=True)]
    try:
        yield counts
    finally:
        for h in handles:
            h.remove()


def _adopt_orphans(tl: Timeline, tags: list, owner: dict) -> tuple[list, dict]:
    """An untagged allocation of the setup or update right before a tagged one (AdamW's step counter
    before its parameter's state) takes that one's tag."""
    tags, owner = list(tags), dict(owner)
    for i in range(len(tl.events) - 2, -1, -1):
        (key, sign), (nxt, nsign) = tl.events[i], tl.events[i + 1]
        if (sign > 0 and nsign > 0 and owner[key] is None and tags[i] is None and owner[nxt] is not None
                and tl.phases[i] in ("setup", "update") and tl.phases[i + 1] == tl.phases[i]):
            owner[key] = tags[i] = owner[nxt]
    return tags, owner


def _roles(tl: Timeline, owner: dict) -> tuple[dict, dict]:
    """(key -> its index among its block's allocations, (block, index) -> key); raises unless the
    template's neighbours allocate as the template does."""
    roles, by_owner, counts = {}, {}, {}
    for key, sign in tl.events:
        if sign > 0 and owner[key] is not None:
            o = owner[key]
            roles[key] = counts.get(o, 0)
            by_owner[(o, roles[key])] = key
            counts[o] = roles[key] + 1

    def labels(o):
        allocations = (tl.allocations[by_owner[(o, r)]] for r in range(counts.get(o, 0)))
        return [(a.nbytes, a.op, a.phase, a.shape, a.dtype) for a in allocations]

    for o in (TEMPLATE - 1, TEMPLATE + 1):
        if labels(o) != labels(TEMPLATE):
            raise CannotExtend(f"blocks {o} and {TEMPLATE} do not allocate alike")
    return roles, by_owner


def _grown(tl: Timeline, aggregates: dict, extra: int) -> dict:
    """The allocations of ops over every block's tensors, at the new depth."""
    out = {}
    for key, (op, elements, shape, size) in aggregates.items():
        if op != "stack.default" or len(shape) != 1 or shape[0] != len(elements):
            raise CannotExtend(f"{op} over {len(elements)} tensors of many blocks (shape {shape})")
        n = shape[0] + extra * elements.count(TEMPLATE)
        a = tl.allocations[key]
        out[key] = Allocation(cuda_block_bytes(n * size), a.phase, a.op, (n,), a.dtype)
    return out


def _runs(effective: list) -> list[tuple[int, int, object]]:
    runs, start = [], 0
    for i in range(1, len(effective) + 1):
        if i == len(effective) or effective[i] != effective[start]:
            runs.append((start, i, effective[start]))
            start = i
    return runs


@dataclass
class Extended:
    timeline: Timeline
    copies: dict          # key of the template block -> its copies' keys
    index: list           # event index in the traced timeline -> its index in the extended one


def extend(tl: Timeline, tags: list, owner: dict, aggregates: dict, depth: int, target: int) -> Extended:
    """`tl`, traced with `depth` blocks and tagged, as the timeline of `target` blocks."""
    extra, m = target - depth, TEMPLATE
    tags, owner = _adopt_orphans(tl, tags, owner)
    roles, by_owner = _roles(tl, owner)
    out = Timeline(dict(tl.allocations))
    out.allocations.update(_grown(tl, aggregates, extra))
    fresh, index = {}, [0] * len(tl.events)
    next_key = max(tl.allocations) + 1

    def key_for(v, role, sign):
        nonlocal next_key
        if v <= m or v > m + extra:
            return by_owner[(v if v <= m else v - extra, role)]
        if (v, role) not in fresh:
            if sign < 0:
                raise CannotExtend(f"a copy frees block {v}'s tensor {role} before allocating it")
            fresh[(v, role)] = next_key
            out.allocations[next_key] = tl.allocations[by_owner[(m, role)]]
            next_key += 1
        return fresh[(v, role)]

    def emit(i, at=None):
        """Event i, made by block `at` (numbered at the new depth: a run of the template's) or by
        its own block (renumbered)."""
        key, sign = tl.events[i]
        o = owner[key]
        if o is not None:
            t = tags[i] if tags[i] is not None else o
            base = at if at is not None else (t if t <= m else t + extra)
            key = key_for(base + (o - t), roles[key], sign)
        out.events.append((key, sign))
        out.phases.append(tl.phases[i])

    runs = _runs([t if t is not None else owner[k] for (k, _), t in zip(tl.events, tags)])
    for n, (a, b, tag) in enumerate(runs):
        if tag != m:
            for i in range(a, b):
                index[i] = len(out.events)
                emit(i)
            continue
        before = runs[n - 1][2] if n else None
        after = runs[n + 1][2] if n + 1 < len(runs) else None
        ascending, descending = before == m - 1 or after == m + 1, before == m + 1 or after == m - 1
        if ascending == descending:
            raise CannotExtend(f"events {a}-{b} of block {m} lie between blocks {before} and {after}")
        order = list(range(1, extra + 1)) if ascending else list(range(extra, 0, -1))
        for j in ([0] + order) if ascending else (order + [0]):
            for i in range(a, b):
                if j == 0:
                    index[i] = len(out.events)
                emit(i, m + j)
    copies = {by_owner[(m, r)]: [fresh[(m + j, r)] for j in range(1, extra + 1)]
              for (o, r) in by_owner if o == m}
    return Extended(out, copies, index)
