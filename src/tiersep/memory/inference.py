"""Peak memory of separation: model calls on a batch of chunks, eval mode, no autograd.

The same machinery as the training estimate (trace.py): the real model is built under
FakeTensorMode and its forward runs as OverlapAdd runs it (eval mode, inference_mode, the
preset's precision) on a fake [batch, C, chunk] input, under a StorageTracker; for `cuda` with
CudaEmulation (CUDA's autocast policy and SDPA kernels) and CudaKernelMemory (what kernels
allocate inside), the call repeated and replayed through the caching-allocator model, and the CUDA
context added from a device calibration. One call's timeline: the input batch arrives on the
device, the forward runs, the input is dropped when the call returns, the stems are copied to the
host and dropped.

On a CPU, what `tiersep separate` books is the whole process's peak RSS, as the CPU fit gate books
a train process (memory/cpu_booking.py): the measured process allowance, plus the live tensor bytes of
a call times the factor of a malloc mode (malloc's slack around tensors freed and made again every
call), plus the host buffers of the stream (memory bounded by the chunk, not the song:
separate/plan.py). On CUDA the gate books the device use x (1 + uncertainty), and no GPU has measured
separation yet: the uncertainty is that of a class without evidence (memory/accuracy.py).
"""
from __future__ import annotations

import time
import warnings
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from . import calibration, cpu_booking
from .accuracy import NO_EVIDENCE_UNCERTAINTY
from .conditions import decide
from .constants import CPU_UNCERTAINTY
from .estimate import finish
from .trace import (CUBLAS_WORKSPACE_BYTES, STEPS, CudaEmulation, CudaKernelMemory, RecordedStep, StorageTracker,
                    allocator, cpu_block_bytes, cuda_block_bytes, emulated, move_order, peak_from,
                    repeat_steps)

# Whole-process RSS per live tensor byte of a model call above the allowance, in each malloc mode of
# the CPU gate (cpu_process), measured by bench/separate.py (bench/results/separate_cpu.md) between a
# 1 s chunk and 10 s x 4 chunk batches:
# - glibc's malloc as it comes: the peak settles over the first batches (freed tensors kept in the
#   heap) and grew 1.40x (cpu_tiny) and up to 1.71x (cpu_small) the live bytes once settled, more
#   than the 1.40 it books for training: booked at 1.80;
# - tuned (a 64 KiB mmap threshold: freed tensors go back to the kernel): 0.6x, and a 10-minute
#   song peaked within 1% of a 1-minute one; booked at the gate's 1.10. It was 3-5x slower for 10 s
#   x 4 batches (their tensors are faulted in again every call), so it is used only when glibc's
#   booking does not fit the budget, as the CPU gate does.
FACTORS = {"glibc_default": 1.80, "tuned": cpu_booking.LIVE_FACTOR}


@dataclass
class InferenceTrace:
    device: str
    chunk_samples: int
    batch: int
    parameters: int
    allocated_peak: int           # peak live bytes (torch.cuda.max_memory_allocated on cuda)
    reserved_peak: int | None     # the caching allocator's reserved peak (cuda)
    largest_allocation: int
    weights: int
    io_bytes: int                 # the input batch and the stems, at the peak
    peak_op: str
    kernels: dict
    notes: list


def record_calls(preset: dict, device: str, chunk_samples: int, batch: int,
                 workspace_bytes: int = CUBLAS_WORKSPACE_BYTES) -> tuple[RecordedStep, set]:
    """Record the weights arriving and one model call of separation; returns the recording (as
    trace.repeat_steps takes it) and the keys of the call's input and output."""
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device: {device!r} (allowed: cuda, cpu)")
    from tiersep.model.step import autocast, autocast_dtype
    from tiersep.model import build_model

    half = autocast_dtype(preset["train"]["precision"])
    emulation = CudaEmulation(preset["model"]["attention_backend"]) if device == "cuda" else None
    kernels = CudaKernelMemory(workspace_bytes) if device == "cuda" else None
    tracker = StorageTracker(cuda_block_bytes if device == "cuda" else cpu_block_bytes, op_model=kernels)
    a = preset["audio"]
    with FakeTensorMode(allow_non_fake_inputs=False), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*CUDA is not available.*")
        warnings.filterwarnings("ignore", message=".*autocast.*")
        model = build_model(preset).eval()
        weights = set(tracker.register([x for x in move_order(model) if x is not None]))
        start = len(tracker.timeline.events)
        with emulated(model, tracker, emulation, half) as stack:
            stack.enter_context(tracker)
            # on cuda the forward hooks hold CUDA's autocast policy; on cpu the real CPU autocast
            stack.enter_context(autocast(preset["train"]["precision"], "cpu", outer_off=True)
                                if device == "cpu" else torch.autocast("cpu", enabled=False))
            stack.enter_context(torch.inference_mode())
            pieces = torch.empty(batch, a["channels"], chunk_samples)         # the batch on the device
            estimates = model(pieces)                                        # [b, n_src, C, chunk]
            io = {tracker.key_of(pieces), tracker.key_of(estimates)}
            del pieces                                                       # the call has returned
            del estimates                                                    # copied to the host
        tracker.stop()
    timeline = tracker.timeline
    persistent = {k for k, x in timeline.allocations.items() if x.op.startswith("<cublas workspace")}
    parameters = sum(p.numel() for p in model.parameters())
    rec = RecordedStep(timeline, start, parameters, weights, set(), set(), io - {None}, set(), persistent,
                       1, emulation)
    return rec, io - {None}


def trace_inference(preset: dict, device: str, chunk_samples: int, batch: int,
                    workspace_bytes: int = CUBLAS_WORKSPACE_BYTES, expandable_segments: bool = False,
                    calls: int = STEPS) -> InferenceTrace:
    """Trace separation's model calls of `preset` on `device` for one chunk size and batch: one call
    on cpu (its peak of live bytes), `calls` on cuda, replayed through the caching-allocator model."""
    rec, io = record_calls(preset, device, chunk_samples, batch, workspace_bytes)
    timeline, starts = repeat_steps(rec, calls if device == "cuda" else 1)
    peak, at = peak_from(timeline, starts[0], set())
    reserved = None
    if device == "cuda":
        stats = allocator.replay(timeline, expandable_segments=expandable_segments)
        peak, reserved = max(stats.peak_allocated, peak), stats.peak_reserved
    live = timeline.live_at(at)
    sizes = {k: timeline.allocations[k].nbytes for k in live}
    emulation = rec.emulation
    return InferenceTrace(
        device=device, chunk_samples=chunk_samples, batch=batch, parameters=rec.parameters,
        allocated_peak=peak, reserved_peak=reserved,
        largest_allocation=max(x.nbytes for k, x in rec.timeline.allocations.items() if k not in rec.persistent),
        weights=sum(sizes.get(k, 0) for k in rec.weights), io_bytes=sum(sizes.get(k, 0) for k in io),
        peak_op=timeline.allocations[timeline.events[at][0]].op if at >= 0 else "",
        kernels=dict(emulation.kernels_used) if emulation is not None else {},
        notes=sorted(emulation.unmodelled) if emulation is not None and emulation.unmodelled else [])


def estimate_inference(preset: dict, device: str, chunk_samples: int, batch: int,
                       budget_bytes: int | None = None, safety_margin: float = 0.08,
                       calibration_spec: str = "auto", host_bytes: int = 0, gpu=None) -> dict:
    """The estimate record of separation with `preset` on `device` (the fields of a training
    estimate, results/vram, plus mode, chunk_samples and batch): peak_bytes is the predicted device
    use on cuda (reserved peak + CUDA context), the peak of live tensor bytes on cpu; on cpu
    `cpu_process` books the whole process (see module docstring), `host_bytes` being the stream's
    buffers. `gate_required_bytes` and `fits` as the fit gate sets them (estimate.finish). `gpu` (cuda,
    a gpu_catalogue entry; `estimate --inference --gpu`): the card whose attention kernels and
    precision are modelled, as for training (None: any sm80+ card)."""
    began = time.time()
    cal = calibration.resolve(calibration_spec) if device == "cuda" else None
    cond = decide(preset, device, compiled=False, gpu=gpu)   # separation runs the eager model
    preset = cond.applied(preset)                            # auto precision, the card's kernel
    r = trace_inference(preset, device, chunk_samples, batch,
                        cal["cublas_workspace_bytes"] if cal else CUBLAS_WORKSPACE_BYTES, cond.expandable_segments)
    live = r.allocated_peak
    peak = r.reserved_peak + cal["context_bytes"] if cal else live
    activations = max(0, live - r.weights)
    record = {
        "preset": preset["name"], "method": "trace", "device": device, "mode": "inference",
        "chunk_samples": int(chunk_samples), "chunk_seconds": chunk_samples / preset["audio"]["sample_rate"],
        "batch": int(batch), "precision": preset["train"]["precision"], "parameters": r.parameters,
        "peak_bytes": int(peak), "allocated_peak_bytes": int(live),
        "reserved_peak_bytes": int(r.reserved_peak) if r.reserved_peak is not None else None,
        "largest_allocation_bytes": int(r.largest_allocation),
        "breakdown": {"weights": r.weights, "gradients": 0, "optimizer": 0, "activations": activations,
                      "transient": 0, "overhead": int(peak - live)},
        "io_bytes": r.io_bytes, "peak_op": r.peak_op,
        "attention_backend": max(r.kernels, key=r.kernels.get) if r.kernels else cond.attention,
        "uncertainty": NO_EVIDENCE_UNCERTAINTY if device == "cuda" else CPU_UNCERTAINTY,
        "uncertainty_evidence": (f"no GPU measurement of separation (a forward in inference mode) yet: booked "
                                 f"conservatively at {NO_EVIDENCE_UNCERTAINTY:.0%}" if device == "cuda" else
                                 "the CPU trace counts a real call's live bytes (tests/test_separate_stream.py)"),
        "calibration": dict(cal["used"], context_bytes=cal["context_bytes"]) if cal else None,
        "allocator": cond.allocator_record(), "gpu": cond.gpu_record(),
        "notes": r.notes, "torch": torch.__version__,
    }
    if device == "cpu":
        record["cpu_process"] = separation_booking(live, host_bytes)
    return finish(record, budget_bytes, safety_margin, time.time() - began)


def separation_booking(live_bytes: int, host_bytes: int) -> dict:
    """The predicted peak RSS of a `tiersep separate` process on a CPU in each malloc mode (see
    module docstring), shaped as the CPU gate's booking: estimate.finish picks glibc's own malloc
    when its booking fits the budget, else the tuned one (cpu_booking.choose_malloc), and the
    separation applies that mode (tiersep.malloc.configure_malloc)."""
    allowance = cpu_booking.process_allowance()
    process = int(allowance["process_bytes"])
    booked = {"live_bytes": int(live_bytes), "host_bytes": int(host_bytes), "process_bytes": process,
              "process_source": allowance["source"], "malloc_setting": "auto"}
    for mode, factor in FACTORS.items():
        booked[mode] = {"rss_bytes": int(process + factor * live_bytes + host_bytes), "live_factor": factor,
                        "model": f"{process // 2**20} MiB process + {factor} x live tensor bytes + stream "
                                 f"buffers, {cpu_booking.MODES[mode]}"}
    return cpu_booking.choose_malloc(booked, None, 0.0)
