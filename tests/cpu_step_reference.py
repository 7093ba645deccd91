"""Real CPU training steps of presets, measured independently of the trace, in a fresh process.

For each preset it prints one JSON line:
- resident_bytes: the weights (and their EMA copy, train.ema), AdamW state and inputs a step starts
  from (their storages);
- profiled_peak_bytes: resident_bytes + the peak of the CPU allocator's own running sum over the
  preset's first step (tests/memory_reference.py), from the state the trace models (AdamW state
  made, no gradients);
- rss_growth_bytes: the process's peak RSS over its third step (VmHWM reset just before it, the
  second step unmeasured) minus its RSS before it, from the same state.

The process runs with the tuned malloc (tiersep.malloc.configure_malloc: allocations of 64 KiB or
more mmapped and unmapped on free), so its RSS follows the live bytes to the page, less what glibc's
heap already holds for the small ones. With glibc's malloc as it comes a step reuses the last step's
freed heap and grew by 7-10 MB for 41 MB of live bytes, which says nothing. The steps before the
measured one pay the one-time costs (oneDNN, thread pools: +22 MB on the tiny preset) and leave the
heap as a step leaves it (the profiler's own records, freed, would otherwise take small allocations).

Usage: python tests/cpu_step_reference.py PRESETS.json   (a list of presets as tiersep.config returns them)
"""
from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import torch

from memory_reference import profiled_peak, storage_bytes
from tiersep.malloc import configure_malloc
from tiersep.memory.trace import build_workload
from tiersep.model.step import LossScaler, train_step
from tiersep.probe import peak_rss_bytes


def current_rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def measure(preset: dict) -> dict:
    torch.manual_seed(preset["train"]["seed"])
    work = build_workload(preset, "cpu", lambda *shape: 0.1 * torch.randn(shape))
    ema = work.ema.params if work.ema else []
    scaler = LossScaler.from_preset(preset, "cpu")   # fp16: the real step scales (the trace does not)
    resident = storage_bytes(work.params + list(work.model.buffers()) + ema + work.optimizer_state()
                             + [x for pair in work.inputs for x in pair])

    def step():
        work.optimizer.zero_grad(set_to_none=True)
        gc.collect()
        train_step(work.model, work.loss_fn, work.optimizer, work.inputs, preset, "cpu", ema=work.ema, scaler=scaler)

    peak = profiled_peak(step)
    step()
    work.optimizer.zero_grad(set_to_none=True)
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")    # VmHWM := VmRSS (Linux 4.0+)
    before = current_rss_bytes()
    train_step(work.model, work.loss_fn, work.optimizer, work.inputs, preset, "cpu", ema=work.ema, scaler=scaler)
    growth = peak_rss_bytes() - before
    return {"resident_bytes": resident, "profiled_peak_bytes": resident + peak, "rss_growth_bytes": growth}


def main() -> None:
    assert configure_malloc()["applied"], "the tuned malloc could not be applied"
    for preset in json.loads(Path(sys.argv[1]).read_text()):
        print(json.dumps(measure(preset)), flush=True)


if __name__ == "__main__":
    main()
