"""Count the bytes of live tensor storages while code runs, on real or fake tensors.

A TorchDispatchMode sees every aten op below autograd, so it sees forward, backward (autograd runs
the backward ops through the same dispatcher) and optimizer ops alike. Each op output whose storage
has not been seen before is a new allocation; a weakref finalizer on the storage records its free.
Fake tensors (FakeTensorMode) have storages too (on the meta device, holding no memory), so the same
counter gives the live bytes a real run would have without allocating them.

What it cannot see by itself: memory a kernel allocates internally (cuDNN/cuBLAS workspaces,
clones inside cuFFT calls) and the order in which a device kernel allocates its outputs. An `op_model`
(tiersep.memory.trace.kernels.CudaKernelMemory for CUDA) supplies both: for each op it may return a plan,
a list of steps `("out", index[, nbytes])` (record output `index` now, booking `nbytes` for its
storage), `("alloc", name, nbytes[, label])` and `("free", name)` for kernel-internal buffers, and
`("accumulate", index, operand)`: output `index` takes over `operand`'s block if `operand` is freed
right after (an in-place sum the real kernel does where the traced one cannot). Outputs the plan
does not name are recorded after it, in order.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

# Phases of a training step, used to label what an allocation is for.
SETUP, FORWARD, BACKWARD, UPDATE = "setup", "forward", "backward", "update"


def cuda_block_bytes(nbytes: int) -> int:
    """Size the CUDA caching allocator books for a request: at least 512 B, a multiple of 512 B."""
    if nbytes <= 0:
        return 0
    return max(512, -(-nbytes // 512) * 512)


def cpu_block_bytes(nbytes: int) -> int:
    """CPU allocations (c10 alloc_cpu) are 64-byte aligned; count that granularity."""
    if nbytes <= 0:
        return 0
    return -(-nbytes // 64) * 64


@dataclass(frozen=True, slots=True)
class Allocation:
    """What one allocation is; the timeline's key names it. Frozen, so that a repeated micro-batch's
    or step's copy of an allocation is the same object under another key (no copying)."""
    nbytes: int          # rounded bytes
    phase: str           # phase of the step when it was allocated
    op: str              # aten op that returned it first ("<registered>" for tensors made earlier)
    shape: tuple = ()
    dtype: str = ""


@dataclass
class Timeline:
    """The ordered allocation/free events of one run, and what is needed to explain its peak."""
    allocations: dict[int, Allocation] = field(default_factory=dict)
    events: list[tuple[int, int]] = field(default_factory=list)   # (key, +1 alloc | -1 free)
    phases: list[str] = field(default_factory=list)               # the step's phase at each event
    # Runs of identical copies (allocator.replay may skip the ones after a steady state): each
    # (start, length, count, key_shift, base): `count` copies of `length` events from `start`, copy i
    # being copy 0 with every key >= base raised by i * key_shift. A new Timeline has none.
    repeats: list[tuple[int, int, int, int, int]] = field(default_factory=list)

    def replay(self, exclude: set[int] = frozenset()) -> tuple[int, int]:
        """(peak live bytes, index of the event that reached it), ignoring keys in `exclude`."""
        live = peak = 0
        at = -1
        for i, (key, sign) in enumerate(self.events):
            if key in exclude:
                continue
            live += sign * self.allocations[key].nbytes
            if live > peak:
                peak, at = live, i
        return peak, at

    def live_at(self, index: int, exclude: set[int] = frozenset()) -> set[int]:
        """Keys live right after event `index`."""
        live: set[int] = set()
        for key, sign in self.events[: index + 1]:
            if key in exclude:
                continue
            if sign > 0:
                live.add(key)
            else:
                live.discard(key)
        return live


class StorageTracker(TorchDispatchMode):
    """Records every storage allocation and free of the ops run under it (see module docstring).

    `block_bytes` turns a storage's byte size into what the allocator books for it (512-B blocks
    for CUDA, 64-B alignment for CPU). `phase` is set by the caller (forward) and advanced here:
    an op run inside an autograd graph task is backward; the first op outside one after backward
    starts the update (clipping, optimizer step).
    """

    def __init__(self, block_bytes=cuda_block_bytes, op_model=None):
        super().__init__()
        self.block_bytes = block_bytes
        self.op_model = op_model
        self.timeline = Timeline()
        self.phase = SETUP
        self.live_bytes = 0
        self.peak_bytes = 0
        self.recording = True
        self._keys: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._next_key = 0
        self._freed: set[int] = set()
        self._internal: dict[str, int] = {}
        self._booked: set[int] = set()    # keys whose size an op model set (views keep it)
        self._finalizers: dict[int, weakref.finalize] = {}
        self._reuse = None      # (new key, old key, weakref to new storage) of a pending "accumulate"

    # -- public -------------------------------------------------------------------------------
    def register(self, tensors, op: str = "<registered>") -> list[int]:
        """Count tensors that already exist (parameters, inputs made before tracking began)."""
        return [k for t in tensors if (k := self._see(t, op)) is not None]

    def key_of(self, tensor: torch.Tensor) -> int | None:
        try:
            return self._keys.get(tensor.untyped_storage())
        except (RuntimeError, NotImplementedError):
            return None

    def stop(self) -> None:
        """Stop recording (storages freed later, e.g. at teardown, are not part of the step)."""
        self.recording = False

    # -- dispatch -----------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.recording and isinstance(out, (torch.Tensor, tuple, list)):   # not prim.device & co
            if torch._C._current_graph_task_id() != -1:
                self.phase = BACKWARD
            elif self.phase == BACKWARD:
                self.phase = UPDATE
            name = func.__name__ if hasattr(func, "__name__") else str(func)
            self._record(func, name, args, kwargs or {}, tree_flatten(out)[0])
        return out

    def _record(self, func, name: str, args, kwargs, outputs: list) -> None:
        """Record what one op allocated and freed: its op model's plan, then its other outputs."""
        plan = self.op_model(func, args, kwargs, outputs, self) if self.op_model else None
        done = set()
        for step in plan or ():
            if step[0] == "out":
                done.add(step[1])
                self._seeing(step[1])
                self._see(outputs[step[1]], name, step[2] if len(step) > 2 else None)
            elif step[0] == "accumulate":
                done.add(step[1])
                self._seeing(step[1])
                new, old = self._see(outputs[step[1]], name), self.key_of(step[2])
                if new is not None and old is not None:
                    self._reuse = (new, old, weakref.ref(outputs[step[1]].untyped_storage()))
            elif step[0] == "alloc":
                self._seeing(-1)
                self.internal(step[1], step[2], step[3] if len(step) > 3 else f"<{step[1]}> {name}")
            else:
                self.release(step[1])
        for i, value in enumerate(outputs):
            if i not in done and isinstance(value, torch.Tensor):
                self._seeing(i)
                self._see(value, name)

    def _seeing(self, index: int) -> None:
        """Called before the op's output `index` (-1: a kernel-internal buffer) is recorded: a
        subclass's hook (memory/trace/depth.py tags each allocation with its block)."""

    # -- kernel-internal buffers (op models) ----------------------------------------------------
    def internal(self, name: str, nbytes: int, op: str) -> int | None:
        """Book a buffer a kernel allocates itself (no tensor reaches Python); `release(name)` frees it."""
        nbytes = self.block_bytes(nbytes)
        if nbytes == 0:
            return None
        key = self._new_key(Allocation(nbytes, self.phase, op))
        self._internal[name] = key
        return key

    def release(self, name: str) -> None:
        key = self._internal.pop(name, None)
        if key is not None:
            self._free(key)

    # -- internals ----------------------------------------------------------------------------
    def _see(self, tensor: torch.Tensor, op: str, nbytes: int | None = None) -> int | None:
        if tensor.layout != torch.strided:
            return None
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return None
        booked = nbytes is not None      # an op model's size for the block, not the storage's
        nbytes = self.block_bytes(storage.nbytes() if nbytes is None else nbytes)
        key = self._keys.get(storage)
        if key is not None:
            known = self.timeline.allocations[key]
            if nbytes != known.nbytes and self.recording and key not in self._booked:
                # A storage resized in place (out= ops): book it as a free plus a new allocation.
                self._free(key)
                key = None
            else:
                return key
        if nbytes == 0:
            return None
        key = self._new_key(Allocation(nbytes, self.phase, op, tuple(tensor.shape),
                                       str(tensor.dtype).replace("torch.", "")))
        if booked:
            self._booked.add(key)
        self._keys[storage] = key
        self._finalizers[key] = weakref.finalize(storage, self._free, key)
        return key

    def _take_over(self, new: int, old: int, storage_ref) -> None:
        """`new` (just allocated) replaces `old` (being freed) in old's block: no event for either."""
        storage = storage_ref()
        self.timeline.events.pop()
        self.timeline.phases.pop()
        self.live_bytes -= self.timeline.allocations.pop(new).nbytes
        self._finalizers.pop(new).detach()
        self._keys[storage] = old
        self._finalizers[old] = weakref.finalize(storage, self._free, old)

    def _new_key(self, allocation: Allocation) -> int:
        key = self._next_key
        self._next_key += 1
        self.timeline.allocations[key] = allocation
        self.timeline.events.append((key, +1))
        self.timeline.phases.append(self.phase)
        self.live_bytes += allocation.nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        return key

    def _free(self, key: int) -> None:
        # A late finalizer of a storage resized earlier must not free it twice.
        if not self.recording or key in self._freed:
            return
        reuse, self._reuse = self._reuse, None
        if reuse is not None and key == reuse[1] and self.timeline.events[-1] == (reuse[0], +1):
            self._take_over(*reuse)
            return
        self._freed.add(key)
        self.timeline.events.append((key, -1))
        self.timeline.phases.append(self.phase)
        self.live_bytes -= self.timeline.allocations[key].nbytes
