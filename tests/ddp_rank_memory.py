"""One rank of a real 2-rank gloo DDP run of cpu_tiny (tests/test_memory_ranks.py starts two).

Each rank builds the real model, AdamW (its state made, as the trace's steady state has it) and its
resident micro-batches (tiersep.memory.trace.workload, as `measure` does), wraps the model in
DistributedDataParallel(gradient_as_bucket_view=True) as the trainer does, and runs the trainer's own
train_step three times (the first records the gradients' order, the second's forward rebuilds the
buckets) under the StorageTracker on real tensors, the CPU measurement tests/test_memory_bench.py
and `measure` use (a dispatch check), and under torch.profiler with profile_memory, from before the
workload is built (the independent reference: the CPU allocator's own events, tests/memory_reference.py).
It prints one JSON line: the peak of live tensor bytes over the third step by each, and the reducer's
buckets.

Usage: python tests/ddp_rank_memory.py '[{"train.grad_accum": 2}, ...]'  (one run per preset change
of cpu_tiny; torchrun's variables RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set)
"""
from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from memory_reference import allocator_profile, running_peak
from tiersep import config as C
from tiersep.memory.trace.tracker import StorageTracker, cpu_block_bytes
from tiersep.memory.trace.workload import build_workload
from tiersep.model.step import train_step


def peak_from(timeline, start: int) -> int:
    live = sum(sign * timeline.allocations[k].nbytes for k, sign in timeline.events[:start])
    peak = live
    for key, sign in timeline.events[start:]:
        live += sign * timeline.allocations[key].nbytes
        peak = max(peak, live)
    return peak


def measure(sets: dict, rank: int) -> dict:
    preset = C.set_field(C.load_preset("cpu_tiny"), "train.ranks", 2)
    for dotted, value in sets.items():
        preset = C.set_field(preset, dotted, value)
    torch.manual_seed(rank)
    with allocator_profile() as prof:
        work = build_workload(preset, "cpu", lambda *shape: 0.1 * torch.randn(shape))
        tracker = StorageTracker(cpu_block_bytes)
        tracker.register(work.params + list(work.model.buffers()))
        tracker.register(work.optimizer_state())
        tracker.register([x for pair in work.inputs for x in pair])
        with tracker:
            ddp = DistributedDataParallel(work.model, gradient_as_bucket_view=True)
            for _ in range(2):
                train_step(ddp, work.loss_fn, work.optimizer, work.inputs, preset, "cpu")
            start = len(tracker.timeline.events)
            with torch.profiler.record_function("measured step"):
                train_step(ddp, work.loss_fn, work.optimizer, work.inputs, preset, "cpu")
        tracker.stop()
    grads_are_views = all(p.grad is not None and p.grad.untyped_storage().nbytes() > p.grad.nbytes
                          for p in work.params)
    buckets = [int(b.buffer().numel() * b.buffer().element_size()) for b in ddp.reducer._get_zeros_like_grad_buckets()]
    return {"sets": sets, "rank": rank, "peak_bytes": peak_from(tracker.timeline, start),
            "allocator_peak_bytes": running_peak(prof, "measured step"),
            "bucket_sizes_bytes": buckets, "bucket_cap_bytes": ddp.bucket_bytes_cap,
            "grads_are_bucket_views": grads_are_views}


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    rows = [measure(sets, rank) for sets in json.loads(sys.argv[1])]
    dist.barrier()
    dist.destroy_process_group()
    print(json.dumps(rows))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
