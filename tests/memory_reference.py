"""An independent reference for the CPU memory estimates: the allocator's own events.

torch.profiler with profile_memory=True makes c10's CPU allocator report every allocation and free
it serves, whoever asked for it (an aten kernel, autograd's engine, DDP's reducer, inductor's
generated code). The trace and the `measure` method count tensors at dispatch (StorageTracker);
this counts bytes at the allocator, so a difference between the two is a real miss, not a
fake-versus-real dispatch difference.

The allocator sizes a free only if it saw the allocation while a profiler ran: a tensor made before
profiling and freed inside it would never leave the running sum. So profile from a state where every
tensor alive is counted in `before` and lives through the profiled call (weights, optimizer state,
inputs), and run it in a fresh process (tests/cpu_step_reference.py) where no earlier profiler
left sizes behind.
"""
from __future__ import annotations

import gc
from typing import Callable

import torch


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (views and shared storages counted once)."""
    seen = {}
    for x in tensors:
        if x is not None:
            storage = x.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def allocator_profile():
    """A profiler that records the CPU allocator's allocations and frees."""
    return torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)


def allocator_changes(prof) -> list[tuple[int, int]]:
    """The CPU allocator's allocations (+bytes) and frees (-bytes) in `prof`, in time order:
    [(ns, bytes)]."""
    return sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                  if e.name() == "[memory]" and e.device_type() == torch.profiler.DeviceType.CPU)


def running_peak(prof, window: str | None = None) -> int:
    """The highest running sum of the allocator's events in `prof` (bytes above what was live when
    profiling began); with `window`, only over the record_function block of that name (the sum at
    its start included)."""
    start, end = 0, float("inf")
    if window is not None:
        (block,) = [e for e in prof.profiler.kineto_results.events() if e.name() == window]
        start, end = block.start_ns(), block.end_ns()
    live = peak = 0
    for when, nbytes in allocator_changes(prof):
        if when > end:
            break
        live += nbytes
        if when >= start:
            peak = max(peak, live)
    return peak


def profiled_peak(call: Callable[[], object]) -> int:
    """The highest running sum of the CPU allocator's allocations and frees while `call()` runs,
    above what was live when it started (bytes as requested from the allocator)."""
    gc.collect()
    with allocator_profile() as prof:
        call()
    return running_peak(prof)


# The allocator's own peak was the same to the byte in every fresh process on the machine that
# measured it (an Intel Xeon, 2026-11-26), but kernels allocate their own scratch below the dispatcher
# (oneDNN convolutions, the misses these tests assert), and its size may differ with the CPU's
# instruction set, which no second machine has measured: allowed +-0.5% around each measured figure,
# still far inside the 10% a wrong trace moves it.
MACHINE_MARGIN = 0.005

