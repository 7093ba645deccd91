"""The `trace` method: real training steps of the real model, on fake tensors, counted.

The model, loss and AdamW are built under FakeTensorMode (no memory is allocated, so even the xlarge
preset traces in seconds with a few hundred MiB of RAM) and the trainer's own `train_step` runs a
whole optimisation step on fake inputs of the preset's micro-batch shape, under a StorageTracker.
For device `cuda`, CudaEmulation applies CUDA's autocast policy and SDPA kernels, CudaKernelMemory
adds what CUDA kernels allocate internally, the host-side AdamW step counters are left out, and the
timeline is replayed through the caching-allocator model.

The timeline follows the real run (memory/trace/workload.py, as memory/measure.py runs it): the weights
moved to the device one by one, the EMA copy of them (train.ema), the AdamW state created by one step on zero gradients, every
micro-batch's inputs made resident (0.1 * randn), then `steps` training steps. The first step is
traced; later ones repeat its events, after freeing what it left (the gradients, which the next
step's zero_grad frees first), so that the allocator sees the steady state a long run reaches.
With gradient accumulation, the first micro-batch is traced and the others repeat its events, except
that each new gradient is freed as soon as it is made (autograd adds it into `.grad` in place).
"""
from __future__ import annotations

import contextlib
import difflib
import warnings
from copy import deepcopy
from dataclasses import dataclass, field

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from . import allocator
from .compiled import CompiledStepTracker, compile_now
from .depth import TEMPLATE, TRACED_BLOCKS, BlockCounts, BlockTagger, CannotExtend, extend, tagging
from .emulation import CudaEmulation
from .kernels import CudaKernelMemory
from .tracker import FORWARD, UPDATE, StorageTracker, Timeline, cpu_block_bytes, cuda_block_bytes
from .workload import build_workload
from tiersep.model.step import autocast_dtype, train_step

# In torch's counters: the cuBLAS workspace torch allocates through the caching allocator for each
# thread's handle on its first GEMM (CUBLAS_WORKSPACE_CONFIG default; 32 MiB on Hopper, 8 MiB
# before). A device calibration that measured it replaces this default (`workspace_bytes`).
CUBLAS_WORKSPACE_BYTES = 32 * 2**20
# Training steps replayed through the allocator model: the caching allocator's segments reach their
# steady state within three steps (bench/trace_vs_events.py), as in the shared H100 measurements.
STEPS = 3
# Micro-batches traced: 1 (later ones are derived from it, see _accumulating_copies), or 2 (the second
# is the template of the later ones: slower, kept to check the derivation, tests/test_memory_cuda_model.py).
TRACED_MICRO_BATCHES = 1


@dataclass
class TraceResult:
    device: str
    parameters: int
    allocated_peak: int             # what torch.cuda.max_memory_allocated would report (or CPU live bytes)
    reserved_peak: int | None       # max_memory_reserved (cuda only)
    largest_allocation: int
    breakdown: dict                 # weights, gradients, optimizer, activations, transient (at the peak)
    inputs_bytes: int
    peak_phase: str
    peak_op: str
    top_allocations: list
    kernels: dict
    micro_batches_traced: int
    events: int
    steps: int = 1                  # training steps replayed (cuda)
    expandable_segments: bool = False
    notes: list = field(default_factory=list)
    compiled: bool = False          # the step of the torch.compile'd model
    ema_bytes: int = 0              # train.ema's copy of the weights (part of breakdown["weights"])
    data_parallel: dict | None = None   # a rank's DDP buckets and communicator (memory/trace/ranks.py)


@dataclass
class RecordedStep:
    """Setup and one training step, as recorded; keys name the timeline's allocations."""
    timeline: Timeline
    step_start: int                 # index of the step's first event
    parameters: int
    weights: set
    optimizer: set
    host: set                       # AdamW's step counters: host memory on CUDA
    inputs: set
    gradients: set
    persistent: set                 # allocated once per process (cuBLAS workspaces)
    micro_batches: int
    emulation: CudaEmulation | None
    ema: set = field(default_factory=set)   # train.ema's copy of the weights (counted among the weights)


@contextlib.contextmanager
def _forward_hooks(model, tracker: StorageTracker, emulation: CudaEmulation | None, dtype,
                   starts: list | None = None, ends: list | None = None):
    """Mark the forward phase (and each forward's first and last event index in `starts`, `ends`);
    for CUDA emulation, hold CPU autocast on around model.forward as train_step holds CUDA autocast
    (the trace's tensors are CPU tensors)."""
    state = {}

    def pre(module, args):
        tracker.phase = FORWARD
        if starts is not None:
            starts.append(len(tracker.timeline.events))
        if emulation is not None and dtype is not None:
            state["ctx"] = torch.autocast("cpu", dtype=dtype)
            state["ctx"].__enter__()

    def post(module, args, output):
        if ends is not None:
            ends.append(len(tracker.timeline.events))
        if state.get("ctx") is not None:
            state.pop("ctx").__exit__(None, None, None)
            emulation.clear_cast_cache()

    handles = [model.register_forward_pre_hook(pre), model.register_forward_hook(post, always_call=True)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def emulated(model, tracker: StorageTracker, emulation: CudaEmulation | None, dtype,
              starts: list | None = None, ends: list | None = None):
    """The CUDA emulation (if any) and the forward hooks, as a training step of `model` runs under."""
    with contextlib.ExitStack() as stack:
        if emulation is not None:
            stack.enter_context(emulation)
        stack.enter_context(_forward_hooks(model, tracker, emulation, dtype, starts, ends))
        yield stack


def move_order(model: torch.nn.Module) -> list[torch.Tensor]:
    """Parameters and buffers in the order model.to(device) copies them (Module._apply: children
    first, then the module's own parameters and buffers)."""
    out = []
    for child in model.children():
        out += move_order(child)
    return out + list(model._parameters.values()) + list(model._buffers.values())


def record_step(preset: dict, device: str = "cuda", model_and_loss=None,
                workspace_bytes: int = CUBLAS_WORKSPACE_BYTES, compiled: bool = False,
                sync_frees: dict | None = None) -> RecordedStep:
    """Record the setup and one training step of `preset` as they would run on `device` (`compiled`:
    of the torch.compile'd model, memory/trace/compiled.py). `sync_frees` ({event index: [keys]}, filled
    while the first micro-batch is traced): frees that happen in the step's last micro-batch only,
    before the traced micro-batch's event of that index (memory/trace/ranks.py: DistributedDataParallel
    moves each gradient into its bucket in the micro-batch that synchronises).
    A deeper preset than depth.TRACED_BLOCKS (cuda, eager, one rank, the model tiersep builds) is traced
    with that many blocks and extended to its depth, event for event (memory/trace/depth.py); where the
    blocks do not repeat as the extension needs, the whole depth is traced."""
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device: {device!r} (allowed: cuda, cpu)")
    target = preset["model"]["n_layers"]
    if device == "cuda" and not compiled and sync_frees is None and model_and_loss is None and target > TRACED_BLOCKS:
        shallow = deepcopy(preset)
        shallow["model"]["n_layers"] = TRACED_BLOCKS
        try:
            return _finish(_extended(_trace(shallow, device, None, workspace_bytes, tagged=True), target), None)
        except CannotExtend:
            pass
    return _finish(_trace(preset, device, model_and_loss, workspace_bytes, compiled), sync_frees)


@dataclass
class _Traced:
    """What record_step's trace gives before the untraced micro-batches are derived."""
    timeline: Timeline
    step_start: int
    parameters: int
    keys: dict                      # weights, optimizer, host, inputs, gradients, ema: sets of keys
    starts: list                    # each traced forward's first event, and the event after its last
    ends: list
    micro_batches: int
    traced: int
    emulation: CudaEmulation | None
    tracker: StorageTracker
    blocks: BlockCounts | None = None   # the template block's kernel calls (tagged traces)
    template_parameters: int = 0


def _trace(preset: dict, device: str, model_and_loss, workspace_bytes: int, compiled: bool = False,
           tagged: bool = False) -> _Traced:
    """The setup and the traced micro-batches of one step (`tagged`: with each event's block, depth.py)."""
    half = autocast_dtype(preset["train"]["precision"])   # fp16's GradScaler: untraced scalars (its .item())
    emulation = CudaEmulation(preset["model"]["attention_backend"]) if device == "cuda" else None
    kernels = CudaKernelMemory(workspace_bytes) if device == "cuda" else None
    tracker = (BlockTagger if tagged else CompiledStepTracker if compiled else StorageTracker)(
        cuda_block_bytes if device == "cuda" else cpu_block_bytes, op_model=kernels)
    tracker.recording = False

    with _fresh_fake_mode(), contextlib.ExitStack() as outer:
        torch.manual_seed(0)
        # the model is built on the host; the device sees its weights arrive one by one
        from tiersep.model import build_loss, build_model

        built = model_and_loss(preset) if model_and_loss else (build_model(preset), build_loss(preset))
        blocks = None
        if tagged:
            if not hasattr(built[0], "blocks"):
                raise CannotExtend("the model has no blocks")
            blocks = outer.enter_context(tagging(built[0], tracker, emulation))

        def build(p):
            tracker.register([x for x in move_order(built[0]) if x is not None])
            tracker.recording = True
            return built

        with tracker:
            work = build_workload(preset, device, lambda *shape: 0.1 * torch.randn(shape), build, move=False)
        model, optimizer, params = work.model, work.optimizer, work.params
        ema = {tracker.key_of(x) for x in work.ema.params} if work.ema else set()
        if work.ema:   # the traced step is one that averages (train.ema.every > 1 skips some)
            work.ema.steps = work.ema.every - 1
        keys = {"weights": {tracker.key_of(x) for x in params + list(model.buffers())} | ema,
                "optimizer": {tracker.key_of(x) for x in work.optimizer_state()},
                "host": {tracker.key_of(s["step"]) for s in optimizer.state.values()
                         if isinstance(s.get("step"), torch.Tensor)} if device == "cuda" else set(),
                "inputs": {tracker.key_of(x) for pair in work.inputs for x in pair}, "ema": ema}
        step_start = len(tracker.timeline.events)
        traced = min(len(work.inputs), TRACED_MICRO_BATCHES)
        starts, ends = [], []       # each forward's first and last event
        step_model, holder = compile_now(model, work, preset, device, lambda m: emulated(
            m, tracker, emulation, half), emulation) if compiled else (model, None)

        with emulated(step_model, tracker, emulation, half, starts, ends) as stack:
            stack.enter_context(tracker)
            stack.enter_context(holder.tracking(tracker) if holder else contextlib.nullcontext())
            train_step(step_model, work.loss_fn, optimizer, work.inputs[:traced], preset, device, ema=work.ema)
        tracker.stop()
        keys["gradients"] = {tracker.key_of(p.grad) for p in params if p.grad is not None}
        template = sum(p.numel() for p in model.blocks[TEMPLATE].parameters()) if tagged else 0
    return _Traced(tracker.timeline, step_start, sum(p.numel() for p in params), keys, starts, ends,
                   len(work.inputs), traced, emulation, tracker, blocks, template)


def _extended(t: _Traced, target: int) -> _Traced:
    """`t` (a tagged trace of TRACED_BLOCKS blocks) as the trace of `target` blocks (depth.extend)."""
    extra = target - TRACED_BLOCKS
    tracker = t.tracker
    ext = extend(t.timeline, tracker.tags, tracker.owner, tracker.aggregates, TRACED_BLOCKS, target)
    keys = {name: keys | {c for k in keys for c in ext.copies.get(k, ())} for name, keys in t.keys.items()}
    if t.emulation is not None:
        for kind, n in t.blocks.kernels.items():
            t.emulation.kernels_used[kind] += extra * n
    return _Traced(ext.timeline, ext.index[t.step_start], t.parameters + extra * t.template_parameters, keys,
                   [ext.index[i] for i in t.starts], [ext.index[i] for i in t.ends], t.micro_batches, t.traced,
                   t.emulation, tracker)


def _finish(t: _Traced, sync_frees: dict | None) -> RecordedStep:
    """The RecordedStep of a trace: the untraced micro-batches derived, the keys' sets named."""
    timeline = t.timeline
    persistent = {k for k, a in timeline.allocations.items() if a.op.startswith("<cublas workspace")}
    gradients = t.keys["gradients"]
    timeline = _all_micro_batches(timeline, t.starts, t.ends, t.micro_batches, t.traced, gradients, persistent,
                                  sync_frees)
    k = {name: keys - {None} for name, keys in t.keys.items()}
    return RecordedStep(timeline, t.step_start, t.parameters, k["weights"], k["optimizer"], k["host"], k["inputs"],
                        k["gradients"], persistent, t.traced, t.emulation, k["ema"])


def _all_micro_batches(timeline: Timeline, starts: list, ends: list, micro_batches: int, traced: int,
                       gradients: set, persistent: set, sync_frees: dict | None) -> Timeline:
    """The traced micro-batches' timeline with the untraced ones derived from them, and the frees of
    the last micro-batch (`sync_frees`, record_step) made."""
    if micro_batches > traced:
        update = next(i for i in range(starts[-1], len(timeline.phases)) if timeline.phases[i] == UPDATE)
        extra = micro_batches - traced
        if traced == 1:
            return _accumulating_copies(timeline, (starts[0], ends[0], update), extra, gradients, persistent,
                                        {i - starts[0]: keys for i, keys in (sync_frees or {}).items()})
        if sync_frees:
            raise RuntimeError("trace: frees of the last micro-batch need the first one traced alone")
        return _more_micro_batches(timeline, starts[-2:], update, extra)
    return _with_frees(timeline, sync_frees) if sync_frees else timeline


MAX_CACHED_OPS = 50_000   # entries of FakeTensorMode's dispatch cache kept across traces (three catalogue rows leave ~19 000)


@contextlib.contextmanager
def _fresh_fake_mode():
    """FakeTensorMode as a fresh process has it, but for its dispatch cache's hits. The cache is
    shared by every instance, and its hits are what make a tier's later traces cheaper (the same
    weights, AdamW's state and most shapes again). A hit builds a compact storage for its output,
    and a miss keeps the storage the op made (hann_window's periodic narrow of a window one sample
    longer): only entries where the two are alike are kept, so a trace books what it would in a
    fresh process, op for op."""
    _keep_what_a_miss_gives()
    with FakeTensorMode(allow_non_fake_inputs=False), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*CUDA is not available.*")
        warnings.filterwarnings("ignore", message=".*autocast.*")
        yield


def _keep_what_a_miss_gives() -> None:
    """Drop the FakeTensorMode cache's entries whose hit gives another storage than a miss (all of
    them past MAX_CACHED_OPS: a long process, such as a search, does not grow without bound)."""
    cache = FakeTensorMode.cache
    if len(cache) > MAX_CACHED_OPS:
        FakeTensorMode.cache_clear()
    for key in [key for key, entry in cache.items() if not _hit_is_a_miss(entry)]:
        del cache[key]


def _hit_is_a_miss(entry) -> bool:
    """Whether a hit on `entry` gives the storage a miss gives. A hit makes a tensor that is not a
    view of an argument with empty_strided (the least storage its shape and strides need, from
    offset 0); an argument, a view of one and a constant are what a miss gives. A bypass entry
    (no output_infos) dispatches as a miss does."""
    for info in getattr(entry, "output_infos", ()):
        meta = info.metadata
        if meta is None or info.view_idx is not None:
            continue
        if meta.storage_offset != 0 or meta.storage_bytes != _least_storage_bytes(meta.shape, meta.stride,
                                                                                   meta.dtype):
            return False
    return True


def _least_storage_bytes(shape: tuple, stride: tuple, dtype: torch.dtype) -> int:
    """The bytes empty_strided allocates for `shape` and `stride` (at::detail::computeStorageNbytes)."""
    if any(size == 0 for size in shape):
        return 0
    return (1 + sum((size - 1) * step for size, step in zip(shape, stride))) * dtype.itemsize


def _with_frees(tl: Timeline, frees: dict) -> Timeline:
    """`tl` with the frees of `frees` ({event index: [keys]}) inserted before the events of those indices."""
    out = Timeline(dict(tl.allocations))
    for i in range(len(tl.events) + 1):
        for key in frees.get(i, ()):
            out.events.append((key, -1))
            out.phases.append(tl.phases[i - 1])
        if i < len(tl.events):
            out.events.append(tl.events[i])
            out.phases.append(tl.phases[i])
    return out


def _accumulating_copies(tl: Timeline, marks: tuple[int, int, int], extra: int, gradients: set,
                         persistent: set, last_frees: dict | None = None) -> Timeline:
    """Insert `extra` micro-batches made from the first one before the update. marks: the first
    micro-batch's first event, its forward's last event, and the update's first event. A copy has
    the first one's allocations under new keys, except that a new gradient is freed right after it
    is made (AccumulateGrad adds it into .grad in place, where the first micro-batch's became .grad)
    and the cuBLAS workspaces exist already. What a micro-batch leaves alive besides gradients (the
    running loss; train_step drops its estimates before the update's first op) is freed after the
    next forward. `last_frees` ({offset from the first micro-batch's first event: [keys]}): frees the
    last copy makes before its event of that offset."""
    start, forward_end, update = marks
    window, phases = tl.events[start:update], tl.phases[start:update]
    leftovers = _leftovers(window, gradients, persistent)
    out = Timeline(dict(tl.allocations), list(tl.events[:update]), list(tl.phases[:update]))

    def free(keys, phase):
        out.events.extend((k, -1) for k in keys)
        out.phases.extend(phase for _ in keys)

    next_key = max(tl.allocations) + 1
    previous = {k: k for k in leftovers}       # the leftovers of the micro-batch before
    starts, keys = [], []                      # each copy's first event and first new key
    # The copies after the first (which frees the traced micro-batch's leftovers) and before a last one
    # with frees of its own repeat copy 1 with their keys moved on (Timeline.repeats).
    periodic = range(1, extra - 1 if last_frees else extra)
    for copy in range(extra):
        starts.append(len(out.events))
        keys.append(next_key)
        if copy >= 2 and copy in periodic:
            _copy_again(out, (starts[1], starts[2]), (keys[1], keys[2]), next_key - keys[1])
            next_key += keys[2] - keys[1]
            previous = {k: v + keys[2] - keys[1] for k, v in previous.items()}
            continue
        fresh = {}
        frees = (last_frees or {}) if copy == extra - 1 else {}
        for i, ((key, sign), phase) in enumerate(zip(window, phases)):
            free(frees.get(i, ()), phase)
            if i == forward_end - start:
                free([previous[k] for k in leftovers], phase)
            if key in persistent:
                continue
            if sign > 0:
                fresh[key] = next_key
                out.allocations[next_key] = tl.allocations[key]
                next_key += 1
            out.events.append((fresh[key], sign))
            out.phases.append(phase)
            if sign > 0 and key in gradients:
                free([fresh[key]], phase)
        free(frees.get(len(window), ()), phases[-1])
        previous = {k: fresh[k] for k in leftovers}
    starts.append(len(out.events))
    out.events += [(previous.get(key, key), sign) for key, sign in tl.events[update:]]
    out.phases += tl.phases[update:]
    if len(periodic) >= 2:
        out.repeats.append((starts[1], starts[2] - starts[1], len(periodic), keys[1] - keys[0], keys[0]))
    return out


def _leftovers(window: list, gradients: set, persistent: set) -> list:
    """What a micro-batch's events (`window`) leave alive besides its gradients and the workspaces;
    raises when it frees what it did not allocate (it could not be repeated)."""
    born = {k for k, s in window if s > 0}
    if any(s < 0 and k not in born for k, s in window):
        raise RuntimeError("trace: the first micro-batch frees what it did not allocate; cannot repeat it")
    alive = set()
    for key, sign in window:
        (alive.add if sign > 0 else alive.discard)(key)
    return sorted(alive - gradients - persistent)


def _copy_again(out: Timeline, events: tuple[int, int], keys: tuple[int, int], shift: int) -> None:
    """Append out's events[events[0]:events[1]] again with every key raised by `shift`, and the
    allocations of the keys in range(*keys) under the raised keys."""
    out.events += [(k + shift, s) for k, s in out.events[events[0]:events[1]]]
    out.phases += out.phases[events[0]:events[1]]
    out.allocations.update((k + shift, out.allocations[k]) for k in range(*keys))


def _more_micro_batches(tl: Timeline, last_two: list[int], update: int, extra: int) -> Timeline:
    """Insert `extra` copies of the last traced micro-batch (events last_two[1]..update) before the
    update. A copy's allocations get new keys; a free in the template of something the micro-batch
    before it allocated (the running loss) frees the same thing of the copy before; after the
    copies, the update refers to the last copy's allocations."""
    before, template = tl.events[last_two[0]:last_two[1]], tl.events[last_two[1]:update]
    born_before = [k for k, s in before if s > 0]
    born = [k for k, s in template if s > 0]
    # which allocation of the micro-batch before plays which role in the template: align them by op
    # and size (the first also creates the gradients, where later ones allocate and add theirs)
    label = [(tl.allocations[k].op, tl.allocations[k].nbytes) for k in born_before], \
        [(tl.allocations[k].op, tl.allocations[k].nbytes) for k in born]
    role = {}
    for a, b, n in difflib.SequenceMatcher(None, *label, autojunk=False).get_matching_blocks():
        role.update(zip(born_before[a:a + n], born[b:b + n]))
    own = set(born)
    if any(s < 0 and k not in own and k not in role for k, s in template):
        raise RuntimeError("trace: the last traced micro-batch frees what the one before did not allocate "
                           "in a matching role; cannot repeat it")
    out = Timeline(dict(tl.allocations), list(tl.events[:update]), list(tl.phases[:update]))
    phases = tl.phases[last_two[1]:update]
    latest = {k: k for k in born}              # role (the template's key) -> key of the latest copy
    next_key = max(tl.allocations) + 1
    for _ in range(extra):
        fresh = {}
        for k in born:
            fresh[k] = next_key
            out.allocations[next_key] = tl.allocations[k]
            next_key += 1
        for (key, sign), phase in zip(template, phases):
            out.events.append((fresh[key] if key in fresh else latest[role[key]] if key in role else key, sign))
            out.phases.append(phase)
        latest = fresh
    for (key, sign), phase in zip(tl.events[update:], tl.phases[update:]):
        out.events.append((latest.get(key, key), sign))
        out.phases.append(phase)
    return out


def repeat_steps(rec: RecordedStep, steps: int) -> tuple[Timeline, list[int]]:
    """The recorded setup followed by `steps` training steps: copies of the recorded one under new
    keys, each after freeing what the step before left (its gradients, freed by the next step's
    zero_grad before anything else). Returns the timeline and each step's first event index."""
    tl = rec.timeline
    step = tl.events[rec.step_start:]
    phases = tl.phases[rec.step_start:]
    born = {k for k, s in step if s > 0}
    offset = max(tl.allocations, default=0) + 1
    out = Timeline(dict(tl.allocations), list(tl.events), list(tl.phases), list(tl.repeats))
    starts = [rec.step_start]
    live = set()
    for key, sign in step:
        if key in born:
            (live.add if sign > 0 else live.discard)(key)
    copied = [key in born and key not in rec.persistent for key, _ in step]   # what a later step repeats
    kept = [0]                       # events copied before each index
    for c in copied:
        kept.append(kept[-1] + c)
    events = [e for e, c in zip(step, copied) if c]
    kept_phases = [ph for ph, c in zip(phases, copied) if c]
    allocations = [(k, tl.allocations[k]) for k, sign in events if sign > 0]
    for copy in range(1, steps):
        shift = copy * offset
        previous = (copy - 1) * offset
        starts.append(len(out.events))
        frees = sum(key not in rec.persistent for key in live)
        for start, length, count, key_shift, base in tl.repeats:
            first, end = start - rec.step_start, start - rec.step_start + length * count
            if first >= 0 and kept[end] - kept[first] == end - first:   # none left out: copied whole
                out.repeats.append((starts[-1] + frees + kept[first], length, count, key_shift, base + shift))
        for key in sorted(live):
            if key not in rec.persistent:
                out.events.append((key + previous if previous else key, -1))
                out.phases.append(phases[0])
        out.allocations.update((k + shift, a) for k, a in allocations)
        out.events += [(key + shift, sign) for key, sign in events]
        out.phases += kept_phases
    return out, starts


def trace_step(preset: dict, device: str = "cuda", model_and_loss=None,
               workspace_bytes: int = CUBLAS_WORKSPACE_BYTES, expandable_segments: bool = False,
               steps: int = STEPS, compiled: bool = False) -> TraceResult:
    """Trace training steps of `preset` as they would run on `device` (cuda|cpu).
    `workspace_bytes`: the cuBLAS workspace of the device calibration; `expandable_segments`: the
    caching allocator's mode (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True); `steps`: training
    steps replayed through the allocator model (cuda; the CPU trace counts one); `compiled`: the
    torch.compile'd model's steps (memory/trace/compiled.py; raises when they cannot be traced)."""
    rec = record_step(preset, device, model_and_loss, workspace_bytes, compiled)
    return summarize(rec, device, expandable_segments, steps, compiled)


def summarize(rec: RecordedStep, device: str, expandable_segments: bool = False, steps: int = STEPS,
              compiled: bool = False) -> TraceResult:
    """The TraceResult of a recorded step: its steps replayed (and, for cuda, through the allocator
    model), the peak, what is live then and the largest allocation."""
    steps = steps if device == "cuda" else 1
    timeline, starts = repeat_steps(rec, steps)
    exclude = rec.host
    # the peak of the steps (torch.cuda.reset_peak_memory_stats() after the setup)
    peak, at = peak_from(timeline, starts[0], exclude)
    live = timeline.live_at(at, exclude=exclude)
    sizes = {k: timeline.allocations[k].nbytes for k in live}

    def total(keys):
        return sum(sizes[k] for k in keys if k in sizes)

    offset = max(rec.timeline.allocations, default=0) + 1
    gradients = {k + c * offset for k in rec.gradients for c in range(steps)} | rec.gradients
    breakdown = {"weights": total(rec.weights), "gradients": total(gradients - rec.weights),
                 "optimizer": total(rec.optimizer - rec.host)}
    named = rec.weights | gradients | rec.optimizer | rec.persistent
    rest = [k for k in live if k not in named]
    breakdown["activations"] = sum(sizes[k] for k in rest
                                   if k in rec.inputs or timeline.allocations[k].phase == FORWARD)
    breakdown["transient"] = sum(sizes[k] for k in rest) - breakdown["activations"]
    peak_alloc = timeline.allocations[timeline.events[at][0]]

    reserved = None
    allocated_peak = peak
    if device == "cuda":
        stats = allocator.replay(timeline, exclude=exclude, expandable_segments=expandable_segments)
        allocated_peak, reserved = max(stats.peak_allocated, peak), stats.peak_reserved

    top = sorted(rest, key=lambda k: -sizes[k])[:5]
    emulation = rec.emulation
    notes = sorted(emulation.unmodelled) if emulation is not None and emulation.unmodelled else []
    return TraceResult(
        device=device,
        parameters=rec.parameters,
        allocated_peak=allocated_peak,
        reserved_peak=reserved,
        largest_allocation=max(x.nbytes for k, x in rec.timeline.allocations.items()
                               if k not in rec.host and k not in rec.persistent),
        breakdown=breakdown,
        inputs_bytes=total(rec.inputs),
        peak_phase=peak_alloc.phase,
        peak_op=peak_alloc.op,
        top_allocations=[{"op": timeline.allocations[k].op, "shape": list(timeline.allocations[k].shape),
                          "dtype": timeline.allocations[k].dtype, "bytes": sizes[k],
                          "phase": timeline.allocations[k].phase} for k in top],
        kernels=dict(emulation.kernels_used) if emulation is not None else {},
        micro_batches_traced=rec.micro_batches,
        events=len(rec.timeline.events),
        steps=steps,
        expandable_segments=expandable_segments if device == "cuda" else False,
        notes=notes, compiled=compiled, ema_bytes=total(rec.ema))


def peak_from(timeline: Timeline, start: int, exclude: set) -> tuple[int, int]:
    """(peak live bytes at or after event `start`, index of the event that reached it)."""
    live = 0
    for key, sign in timeline.events[:start]:
        if key not in exclude:
            live += sign * timeline.allocations[key].nbytes
    peak, at = live, start - 1
    for i in range(start, len(timeline.events)):
        key, sign = timeline.events[i]
        if key in exclude:
            continue
        live += sign * timeline.allocations[key].nbytes
        if live > peak:
            peak, at = live, i
    return peak, at
