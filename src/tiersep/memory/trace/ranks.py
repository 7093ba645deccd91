"""Per-rank memory of a data-parallel tier (train.ranks > 1): what each rank's device must hold.

A rank of a data-parallel tier runs the single-process step on its own micro-batch (batch_size is
the per-rank micro-batch; the effective batch is batch_size x ranks x grad_accum), inside
DistributedDataParallel(gradient_as_bucket_view=True) (tiersep.train.trainer). What DDP changes,
read from torch 2.11 (torch/nn/parallel/distributed.py, torch/csrc/distributed/c10d/reducer.cpp):

- **Buckets.** The reducer holds every gradient in flat buckets, one `at::empty(numel)` tensor of
  the parameters' dtype per bucket, allocated for the life of the model: at construction (one
  bucket for all parameters when find_unused_parameters is off), then rebuilt once, before the
  second step's forward, from the order the gradients became ready in the first backward: grouped
  in that order, per dtype, into buckets that close once they reach their limit, the first
  `FIRST_BUCKET_BYTES`, the others `BUCKET_CAP_BYTES` (`compute_bucket_assignment_by_size`,
  reproduced in `assign_buckets`). The steady state is the rebuilt buckets: booked here before the
  step, as live as the weights.
- **Gradients.** With gradient_as_bucket_view=True a parameter's `.grad` is a view of its bucket.
  zero_grad(set_to_none=True) drops the view, not the bucket, so the next backward makes each
  gradient as a single process does (AccumulateGrad), and DDP's hook right after it copies it into
  the bucket (`mul_out(bucket_view, grad, 1/world)`) and makes `.grad` the view again: the gradient
  is freed there. In the micro-batches under `no_sync` (all but the last with accumulation) the hook
  does nothing: the gradients live beside the buckets, as in a single process, until the last
  micro-batch's hooks move them. The trace records when each AccumulateGrad ran (a post-accumulate
  hook on the fake parameters) and frees the gradient there, in the last micro-batch
  (trace.record_step's `sync_frees`).
- **Communicator.** NCCL allocates its buffers with cudaMalloc, outside the caching allocator: device
  use beyond the reserved peak, like the CUDA context. No multi-GPU calibration exists, so the
  figure is `NCCL_COMMUNICATOR_BYTES`, documented below and marked unmeasured in the record. On a CPU
  gloo's buffers are host memory of the rank's process (not tensors): booked in the process's RSS
  (`GLOO_COMMUNICATOR_BYTES`, measured, below), not in its live tensor bytes.

Not modelled: the one-off rebuild before the second step (the construction bucket is freed before
the rebuilt ones are allocated, and no activation is alive then), DDP's buffer broadcast (the model
has no buffers), a compiled DDP step (DDPOptimizer splits the graph at bucket boundaries: the eager
step is traced, an upper bound).
"""
from __future__ import annotations

import dataclasses

import torch

from ..constants import MIB
from .tracker import SETUP, Allocation, StorageTracker, Timeline, cpu_block_bytes, cuda_block_bytes
from .step import CUBLAS_WORKSPACE_BYTES, STEPS, RecordedStep, TraceResult, record_step, summarize

# DistributedDataParallel(bucket_cap_mb=None) -> 25 MiB (torch/nn/parallel/distributed.py), and the
# first bucket's limit, torch.distributed._DEFAULT_FIRST_BUCKET_BYTES (reducer.hpp
# kDefaultFirstBucketBytes); tests/test_memory_ranks.py checks both against the installed torch.
BUCKET_CAP_BYTES = 25 * MIB
FIRST_BUCKET_BYTES = 1 * MIB

# NCCL's device memory per rank (one communicator: the process group's), not measured: no
# multi-GPU calibration exists. The figure: NCCL's documented default NCCL_BUFFSIZE of 4 MiB per
# channel and connection (NCCL user guide, Environment Variables) x an assumed 32 channels x 2
# connections of a ring (to the previous and the next rank) = 256 MiB of Simple-protocol buffers,
# doubled for the LL/LL128 protocols' buffers and NCCL's kernels: 512 MiB. A measurement on a
# multi-GPU machine should replace it.
NCCL_COMMUNICATOR_BYTES = 512 * MIB
NCCL_SOURCE = ("unmeasured: documented figure, NCCL_BUFFSIZE default 4 MiB per channel and connection "
               "(NCCL user guide) x an assumed 32 channels x 2 ring connections, doubled for the LL/LL128 buffers "
               "and NCCL's kernels = 512 MiB; no multi-GPU calibration exists")
# gloo's host memory per rank (CPU ranks), beyond the live tensors (which include the buckets):
# measured here (2026-11-25, torch 2.11, 2 cores, /proc VmHWM after 10 steps, 3 runs each), a rank
# of a 2-rank gloo DDP run against the same steps in one process: cpu_tiny 761.0-764.2 against
# 763.8-766.2 MiB (nothing to see), a 3.7M-parameter variant (two buckets, 1.7 + 12.4 MiB)
# 908.4-922.1 against 893.6-900.6 MiB, i.e. 0.6-9 MiB beyond its 14.2 MiB of buckets. Booked as
# 32 MiB: room for gloo's per-call scratch on buckets up to BUCKET_CAP_BYTES.
GLOO_COMMUNICATOR_BYTES = 32 * MIB
GLOO_SOURCE = ("measured: a 2-rank gloo DDP rank's peak RSS was 0.6-9 MiB above one process's plus its buckets "
               "(cpu_tiny and a 3.7M-parameter variant, 3 runs each, 2026-11-25, torch 2.11); booked as 32 MiB "
               "with room for gloo's scratch on buckets up to 25 MiB")


def assign_buckets(nbytes: list[int], dtypes: list, order: list[int] | None = None,
                   limits: tuple[int, ...] = (FIRST_BUCKET_BYTES, BUCKET_CAP_BYTES)) -> list[list[int]]:
    """The reducer's bucket assignment (compute_bucket_assignment_by_size): parameter indices in
    `order` (the order gradients became ready; None: index order, the buckets then sorted by their
    smallest index as torch does without indices), grouped per dtype into buckets that close once
    their bytes reach the limit, the first limit once per dtype, then the last one."""
    result, open_, step = [], {}, {}
    for index in (order if order is not None else range(len(nbytes))):
        key = dtypes[index]
        bucket = open_.setdefault(key, [[], 0])
        bucket[0].append(index)
        bucket[1] += nbytes[index]
        at = step.setdefault(key, 0)
        if bucket[1] >= limits[at]:
            result.append(bucket[0])
            open_[key] = [[], 0]
            step[key] = min(at + 1, len(limits) - 1)
    result += [b[0] for b in open_.values() if b[0]]
    if order is None:
        result.sort(key=min)
    return result


def param_bytes(params: list[torch.Tensor]) -> tuple[list[int], list]:
    return [p.numel() * p.element_size() for p in params], [p.dtype for p in params]


@dataclasses.dataclass
class RankRecording:
    rec: RecordedStep
    buckets: list[list[int]]        # parameter indices per bucket, as the rebuilt reducer has them
    bucket_bytes: list[int]         # each bucket's tensor bytes (before the allocator's rounding)


def _tracker() -> StorageTracker | None:
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return next((m for m in reversed(_get_current_dispatch_mode_stack()) if isinstance(m, StorageTracker)), None)


def record_rank_step(preset: dict, device: str = "cuda",
                     workspace_bytes: int = CUBLAS_WORKSPACE_BYTES) -> RankRecording:
    """Record one rank's setup and step: the single-process step of its micro-batch, with each
    gradient freed where DDP moves it into its bucket, and the rebuilt buckets allocated before it."""
    from tiersep.model import build_loss, build_model

    ready: list[int] = []           # parameter indices in the order their gradients became ready
    frees: dict[int, list[int]] = {}
    state = {}

    def model_and_loss(p):
        model = build_model(p)
        params = list(model.parameters())
        state["params"] = params

        def hook(index):
            def after_accumulate(param):
                tracker = _tracker()
                if tracker is None or not tracker.recording or index in ready:
                    return
                ready.append(index)
                key = tracker.key_of(param.grad)
                if key is not None:
                    frees.setdefault(len(tracker.timeline.events), []).append(key)
            return after_accumulate

        for i, param in enumerate(params):
            param.register_post_accumulate_grad_hook(hook(i))
        return model, build_loss(p)

    rec = record_step(preset, device, model_and_loss, workspace_bytes, sync_frees=frees)
    params = state["params"]
    if sorted(ready) != list(range(len(params))):
        raise RuntimeError(f"ranks: {len(params) - len(set(ready))} parameters got no gradient in the "
                           "traced backward; DDP would need find_unused_parameters")
    sizes, dtypes = param_bytes(params)
    buckets = assign_buckets(sizes, dtypes, ready)
    bucket_bytes = [sum(sizes[i] for i in b) for b in buckets]
    block = cuda_block_bytes if device == "cuda" else cpu_block_bytes
    return RankRecording(_with_buckets(rec, bucket_bytes, [dtypes[b[0]] for b in buckets], block),
                         buckets, bucket_bytes)


def _with_buckets(rec: RecordedStep, bucket_bytes: list[int], dtypes: list, block) -> RecordedStep:
    """`rec` with the buckets allocated right before the step (counted as gradients)."""
    tl = rec.timeline
    key = max(tl.allocations, default=-1) + 1
    out = Timeline(dict(tl.allocations), list(tl.events[:rec.step_start]), list(tl.phases[:rec.step_start]))
    keys = set()
    for i, (nbytes, dtype) in enumerate(zip(bucket_bytes, dtypes)):
        size = dtype.itemsize
        out.allocations[key] = Allocation(block(nbytes), SETUP, f"<ddp bucket {i}>", (nbytes // size,),
                                          str(dtype).replace("torch.", ""))
        out.events.append((key, +1))
        out.phases.append(SETUP)
        keys.add(key)
        key += 1
    out.events += tl.events[rec.step_start:]
    out.phases += tl.phases[rec.step_start:]
    return dataclasses.replace(rec, timeline=out, step_start=rec.step_start + len(keys),
                               gradients=rec.gradients | keys)


def trace_rank_step(preset: dict, device: str = "cuda", workspace_bytes: int = CUBLAS_WORKSPACE_BYTES,
                    expandable_segments: bool = False, steps: int = STEPS) -> TraceResult:
    """trace.trace_step for one rank of a data-parallel tier; `data_parallel` says what DDP adds."""
    recording = record_rank_step(preset, device, workspace_bytes)
    result = summarize(recording.rec, device, expandable_segments, steps)
    result.data_parallel = data_parallel_info(preset, device, recording.bucket_bytes)
    return result


def communicator(device: str) -> tuple[int, str, str]:
    """(bytes, where they are booked, source) of a rank's communicator."""
    if device == "cuda":
        return NCCL_COMMUNICATOR_BYTES, "device (peak_bytes)", NCCL_SOURCE
    return GLOO_COMMUNICATOR_BYTES, "host process (cpu_process)", GLOO_SOURCE


def data_parallel_info(preset: dict, device: str, bucket_bytes: list[int] | None) -> dict:
    """The record's `data_parallel` block, before the global figures (`with_global`); bucket_bytes
    None: not traced (analytic, measure)."""
    t = preset["train"]
    comm, where, source = communicator(device)
    block = cuda_block_bytes if device == "cuda" else cpu_block_bytes
    return {
        "backend": "nccl" if device == "cuda" else "gloo",
        "gradient_as_bucket_view": True,
        "bucket_cap_bytes": BUCKET_CAP_BYTES,
        "first_bucket_bytes": FIRST_BUCKET_BYTES,
        "buckets": len(bucket_bytes) if bucket_bytes is not None else None,
        "bucket_sizes_bytes": [int(b) for b in bucket_bytes] if bucket_bytes is not None else None,
        "bucket_bytes": int(sum(block(b) for b in bucket_bytes)) if bucket_bytes is not None else None,
        "communicator_bytes": comm,
        "communicator_booked_in": where,
        "communicator_source": source,
        "ranks_per_node": t["ranks"] // t["nodes"],
    }


def with_global(record: dict) -> dict:
    """Add the global figures of a data-parallel record (its other figures are per rank)."""
    dp = record.get("data_parallel")
    if not dp:
        return record
    ranks = record["ranks"]
    dp["global"] = {
        "effective_batch": record["batch_size"] * ranks * record["grad_accum"],
        "peak_bytes_all_ranks": int(record["peak_bytes"]) * ranks,
        "gate_required_bytes_per_rank": rank_required_bytes(record),
        "gate_required_bytes_all_ranks": rank_required_bytes(record) * ranks,
    }
    return record


def rank_required_bytes(record: dict) -> int:
    """What one rank needs of its device (cuda) or its node's RAM (cpu: its process's RSS)."""
    cpu = record.get("cpu_process") if record["device"] == "cpu" else None
    if cpu:
        return int(cpu["rss_bytes"])
    return int(round(record["peak_bytes"] * (1 + float(record.get("uncertainty") or 0.0))))


def book_host_communicator(booked: dict) -> dict:
    """A CPU rank's process booking (cpu_booking.booking) with gloo's host memory added."""
    booked = dict(booked, communicator_bytes=GLOO_COMMUNICATOR_BYTES)
    for mode in ("glibc_default", "tuned"):
        if mode in booked:
            m = dict(booked[mode])
            m["rss_bytes"] += GLOO_COMMUNICATOR_BYTES
            m["run_rss_bytes"] += GLOO_COMMUNICATOR_BYTES
            m["model"] += f" + {GLOO_COMMUNICATOR_BYTES // MIB} MiB gloo communicator"
            booked[mode] = m
    return booked


def untraced(record: dict, preset: dict, device: str) -> dict:
    """DDP's extras on an analytic or measured single-process record, an upper bound: buckets of the
    parameters' fp32 bytes beside the gradients the record already counts (the trace frees those),
    and the communicator on cuda."""
    bucket_bytes = 4 * int(record["parameters"])
    comm = communicator(device)[0] if device == "cuda" else 0
    record["peak_bytes"] = int(record["peak_bytes"]) + bucket_bytes + comm
    record["breakdown"] = dict(record["breakdown"], gradients=record["breakdown"]["gradients"] + bucket_bytes,
                              overhead=record["breakdown"]["overhead"] + comm)
    record["notes"] = list(record.get("notes") or []) + [
        "data-parallel: the single-process step + buckets of every parameter + the communicator (cuda), "
        "an upper bound; the trace method models DDP's gradients"]
    record["data_parallel"] = dict(data_parallel_info(preset, device, None), bucket_bytes=bucket_bytes)
    return record
