"""The `measure` method: real training steps on the device present, and the peak they reached.

CUDA: torch.cuda.max_memory_allocated / max_memory_reserved after reset_peak_memory_stats, over
`steps` real steps (the allocator's counters, i.e. what the trace's allocated/reserved predict).
CPU: the peak of live tensor bytes over real steps, counted by the same StorageTracker the trace
uses (on real tensors), plus the process's peak RSS growth as an independent check.

Same setup as the trace: AdamW state created before the measured step, every micro-batch's inputs
resident, the trainer's own train_step.
"""
from __future__ import annotations

import gc
import time
from dataclasses import dataclass

import torch

from .trace import FORWARD, StorageTracker, build_workload, cpu_block_bytes
from tiersep.device import device_type
from tiersep.model.step import LossScaler, train_step
from tiersep.probe import peak_rss_bytes


@dataclass
class MeasureResult:
    device: str
    parameters: int
    allocated_peak: int           # cuda: max_memory_allocated; cpu: peak tracked live bytes
    reserved_peak: int | None     # cuda: max_memory_reserved
    rss_growth: int | None        # cpu: peak RSS minus RSS before the step (bytes)
    largest_allocation: int | None
    seconds_per_step: float


def measure_step(preset: dict, device: str | None = None, steps: int = 1,
                 model_and_loss=None) -> MeasureResult:
    """Run `steps` real training steps of `preset` and return the peak memory they reached."""
    device = device or device_type("auto")
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("measure: device cuda asked for, but no CUDA device is visible")
    dev = torch.device(device)
    torch.manual_seed(preset["train"]["seed"])
    work = build_workload(preset, device, lambda *shape: 0.1 * torch.randn(shape, device=dev), model_and_loss)
    model, loss_fn, optimizer, params, inputs = work.model, work.loss_fn, work.optimizer, work.params, work.inputs
    gc.collect()

    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = time.time()
        scaler = LossScaler.from_preset(preset, device)   # fp16: the trainer's scaler, as it runs
        for _ in range(steps):
            train_step(model, loss_fn, optimizer, inputs, preset, device, ema=work.ema, scaler=scaler)
        torch.cuda.synchronize()
        seconds = (time.time() - start) / steps
        return MeasureResult(device, sum(p.numel() for p in params), torch.cuda.max_memory_allocated(),
                             torch.cuda.max_memory_reserved(), None, None, seconds)

    tracker = StorageTracker(cpu_block_bytes)
    tracker.register(params + list(model.buffers()) + (work.ema.params if work.ema else []))
    tracker.register(work.optimizer_state())
    tracker.register([x for pair in inputs for x in pair])
    rss_before = _current_rss_bytes()
    peak_rss_before = peak_rss_bytes()
    start = time.time()
    hook = model.register_forward_pre_hook(lambda *_: setattr(tracker, "phase", FORWARD))
    try:
        with tracker:
            for _ in range(steps):
                train_step(model, loss_fn, optimizer, inputs, preset, device, ema=work.ema)
    finally:
        hook.remove()
        tracker.stop()
    seconds = (time.time() - start) / steps
    peak_rss = peak_rss_bytes()
    rss_growth = peak_rss - rss_before if peak_rss > peak_rss_before else None
    largest = max((x.nbytes for x in tracker.timeline.allocations.values()), default=0)
    peak, _ = tracker.timeline.replay()
    return MeasureResult(device, sum(p.numel() for p in params), peak, None, rss_growth, largest, seconds)


def _current_rss_bytes() -> int:
    import psutil

    return psutil.Process().memory_info().rss
