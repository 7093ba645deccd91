"""The `trace` method: one real training step of the real model, on fake tensors, counted.

The model, loss and AdamW are built under FakeTensorMode (no memory is allocated, so even the xlarge
preset traces in seconds with a few hundred MiB of RAM) and the trainer's own `train_step` runs a
whole optimisation step on fake inputs of the preset's micro-batch shape, under a StorageTracker.
For device `cuda`, CudaEmulation applies CUDA's autocast policy and SDPA kernels, the host-side
AdamW step counters are left out, and the timeline is replayed through the caching-allocator model.

Steady state, not the first step: AdamW's state (exp_avg, exp_avg_sq) is created before the traced
step, as it exists in every step after the first. With grad_accum > 1, two micro-batches are traced
(the second is the first that runs with the gradients of the previous one alive; later ones repeat
it) while every micro-batch's inputs are resident, as the trainer moves them all to the device.
"""
from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass, field

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from . import allocator
from .cuda_model import CudaEmulation
from .tracker import FORWARD, SETUP, Allocation, StorageTracker, cpu_block_bytes, cuda_block_bytes
from .workload import build_workload
from tiersep.train.step import train_step

# In torch's counters: the cuBLAS workspace torch allocates through the caching allocator for its
# handle on the first GEMM (CUBLAS_WORKSPACE_CONFIG default; 32 MiB on Hopper, 8 MiB before). A
# device calibration that measured it replaces this default (trace_step's `workspace_bytes`).
CUBLAS_WORKSPACE_BYTES = 32 * 2**20


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
    notes: list = field(default_factory=list)


@contextlib.contextmanager
def _forward_hooks(model, tracker: StorageTracker, emulation: CudaEmulation | None, dtype):
    """Mark the forward phase; for CUDA emulation, hold CPU autocast on around model.forward as
    train_step holds CUDA autocast (the trace's tensors are CPU tensors)."""
    state = {}

    def pre(module, args):
        tracker.phase = FORWARD
        if emulation is not None and dtype is not None:
            state["ctx"] = torch.autocast("cpu", dtype=dtype)
            state["ctx"].__enter__()

    def post(module, args, output):
        if state.get("ctx") is not None:
            state.pop("ctx").__exit__(None, None, None)
            emulation.clear_cast_cache()

    handles = [model.register_forward_pre_hook(pre), model.register_forward_hook(post, always_call=True)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def trace_step(preset: dict, device: str = "cuda", model_and_loss=None,
               workspace_bytes: int = CUBLAS_WORKSPACE_BYTES) -> TraceResult:
    """Trace one steady-state training step of `preset` as it would run on `device` (cuda|cpu).
    `workspace_bytes`: the cuBLAS workspace of the device calibration."""
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device: {device!r} (allowed: cuda, cpu)")
    t = preset["train"]
    traced = min(t["grad_accum"], 2)
    bf16 = torch.bfloat16 if t["precision"] == "bf16" else None
    emulation = CudaEmulation(preset["model"]["attention_backend"]) if device == "cuda" else None
    tracker = StorageTracker(cuda_block_bytes if device == "cuda" else cpu_block_bytes)

    with FakeTensorMode(allow_non_fake_inputs=False), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*CUDA is not available.*")
        warnings.filterwarnings("ignore", message=".*autocast.*")
        torch.manual_seed(0)
        work = build_workload(preset, device, torch.empty, model_and_loss, move=False)
        model, loss_fn, optimizer, params, inputs = work.model, work.loss_fn, work.optimizer, work.params, work.inputs

        weight_keys = set(tracker.register(params + list(model.buffers())))
        state = work.optimizer_state()
        host = [s["step"] for s in optimizer.state.values() if isinstance(s.get("step"), torch.Tensor)]
        optimizer_keys = set(tracker.register(state))
        # AdamW keeps its step counters on the host unless capturable/fused: not GPU memory.
        host_keys = {tracker.key_of(h) for h in host} if device == "cuda" else set()
        input_keys = set(tracker.register([x for pair in inputs for x in pair]))
        step_start = len(tracker.timeline.events)

        with contextlib.ExitStack() as stack:
            if emulation is not None:
                stack.enter_context(emulation)
            stack.enter_context(tracker)
            stack.enter_context(_forward_hooks(model, tracker, emulation, bf16))
            train_step(model, loss_fn, optimizer, inputs[:traced], preset, device)
        tracker.stop()
        grad_keys = {tracker.key_of(p.grad) for p in params if p.grad is not None}

    timeline = tracker.timeline
    if device == "cuda":
        # The cuBLAS workspace: allocated on the first GEMM, kept for the life of the handle.
        ws = max(timeline.allocations) + 1
        timeline.allocations[ws] = Allocation(ws, workspace_bytes, SETUP, "<cublas workspace>")
        timeline.events.insert(step_start, (ws, +1))
        persistent = {ws}
    else:
        ws, persistent = None, set()
    peak, at = timeline.replay(exclude=host_keys)
    live = timeline.live_at(at, exclude=host_keys)
    sizes = {k: timeline.allocations[k].nbytes for k in live}

    def total(keys):
        return sum(sizes[k] for k in keys if k in sizes)

    breakdown = {"weights": total(weight_keys), "gradients": total(grad_keys - weight_keys),
                 "optimizer": total(optimizer_keys - host_keys)}
    named = weight_keys | grad_keys | optimizer_keys | ({ws} if ws is not None else set())
    rest = [k for k in live if k not in named]
    breakdown["activations"] = sum(sizes[k] for k in rest
                                   if k in input_keys or timeline.allocations[k].phase == FORWARD)
    breakdown["transient"] = sum(sizes[k] for k in rest) - breakdown["activations"]
    peak_alloc = timeline.allocations[timeline.events[at][0]]

    reserved = None
    allocated_peak = peak
    if device == "cuda":
        keep = weight_keys | persistent | (optimizer_keys - host_keys)
        stats = allocator.replay(timeline, exclude=host_keys, repeat_from=step_start, keep=keep)
        allocated_peak, reserved = max(stats.peak_allocated, peak), stats.peak_reserved

    top = sorted(rest, key=lambda k: -sizes[k])[:5]
    notes = []
    if emulation is not None and emulation.unmodelled:
        notes.extend(sorted(emulation.unmodelled))
    return TraceResult(
        device=device,
        parameters=sum(p.numel() for p in params),
        allocated_peak=allocated_peak,
        reserved_peak=reserved,
        largest_allocation=max(x.nbytes for k, x in timeline.allocations.items()
                               if k not in host_keys and k not in persistent),
        breakdown=breakdown,
        inputs_bytes=total(input_keys),
        peak_phase=peak_alloc.phase,
        peak_op=peak_alloc.op,
        top_allocations=[{"op": timeline.allocations[k].op, "shape": list(timeline.allocations[k].shape),
                          "dtype": timeline.allocations[k].dtype, "bytes": sizes[k],
                          "phase": timeline.allocations[k].phase} for k in top],
        kernels=dict(emulation.kernels_used) if emulation is not None else {},
        micro_batches_traced=traced,
        events=len(timeline.events),
        notes=notes,
    )

