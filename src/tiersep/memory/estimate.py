"""`estimate()`: the results/vram/<preset>.json record, by trace, analytic or measure.

What `peak_bytes` means (the number the fit gate compares with the budget):
- device cuda: the GPU memory the training process occupies at its peak, as nvidia-smi would show
  it = the caching allocator's peak *reserved* bytes + the CUDA context. It is therefore larger
  than `torch.cuda.max_memory_allocated()`; compare that counter with `allocated_peak_bytes` and
  `torch.cuda.max_memory_reserved()` with `reserved_peak_bytes`.
- device cpu: the peak of live tensor bytes (what the CPU trace counts; torch has no CPU allocator
  counter). The process's RSS adds the Python/torch baseline and malloc slack on top of it.
`breakdown` splits peak_bytes: weights (with train.ema's copy of them, named in `ema`), gradients, optimizer (AdamW state), activations (saved for
backward, plus the input batch), transient (backward and optimizer temporaries) are the tensors live
at the moment of the allocated peak; overhead is everything else (CUDA context, cuBLAS workspace,
memory the allocator holds cached beyond the live tensors).
`compiled`: whether the figure is for the step of the torch.compile'd model (memory/trace/compiled.py),
as the trainer runs it when the preset compiles on `device`; `compiled_note` says why, or why the
compiled trace fell back to the eager figure (an upper bound: compiling only lowers the peak).
A data-parallel tier (train.ranks > 1): every figure is one rank's, what each rank's GPU must hold
(memory/trace/ranks.py: its micro-batch's step, DDP's buckets, the communicator); `data_parallel` says
what DDP adds and gives the figures of all ranks together.
`uncertainty` (cuda trace): that of the estimate's class (attention kernel, checkpointing, allocator
mode, eager or compiled step) from the GPU evidence (memory/accuracy.py), named in
`uncertainty_class` and `uncertainty_evidence`; the gate books peak_bytes x (1 + uncertainty).
"""
from __future__ import annotations

import copy
import time

import torch

from . import accuracy, analytic, calibration, conditions, cpu_booking
from .constants import BREAKDOWN_KEYS, CPU_UNCERTAINTY
from .trace import ranks, trace_step
from tiersep.gpu_catalogue import GpuEntry
from tiersep.model.compile import error_chain

METHODS = ("trace", "analytic", "measure")


def estimate(preset: dict, method: str = "trace", device: str = "cuda", budget_bytes: int | None = None,
             safety_margin: float = 0.08, calibration_spec: str = "auto", compiled: bool | None = None,
             gpu: GpuEntry | str | None = None) -> dict:
    """Predict the peak memory of one training step of `preset` on `device` (see module docstring).
    `calibration_spec` (cuda): auto, a built-in GPU name or a calibration file (memory.calibration).
    `compiled`: model the compiled step (trace only); None: when the preset compiles on `device`.
    `gpu` (cuda): the card whose kernels and precision are modelled, a catalogue entry or name;
    None: modelled_gpu's choice."""
    if method not in METHODS:
        raise ValueError(f"estimate.method: {method!r} (allowed: {', '.join(METHODS)})")
    if device not in ("cuda", "cpu"):
        raise ValueError(f"estimate.device: {device!r} (allowed: cuda, cpu)")
    start = time.time()
    cal = calibration.resolve(calibration_spec) if device == "cuda" else None
    card = modelled_gpu(gpu, cal, calibration_spec) if device == "cuda" else None
    cond = conditions.decide(preset, device, compiled, card)
    preset = cond.applied(preset)
    if method == "trace":
        record = _from_trace(preset, cond, cal)
    elif method == "analytic":
        record = analytic.estimate_analytic(preset, cond, cal)
    else:
        record = _from_measure(preset, cond, cal)
    if method != "trace":   # the EMA copy: as many bytes as the weights, which these methods book
        record["ema"] = _ema_record(preset, analytic.weight_bytes(preset, device))
        record.update(compiled=False, compiled_note=f"the {method} method models the eager step"
                      + (" (the preset compiles: an upper bound)" if cond.compiled else ""))
    t = preset["train"]
    if cond.data_parallel and "data_parallel" not in record:
        record = ranks.untraced(record, preset, device)
    record = {
        "preset": preset["name"],
        "method": method,
        "device": device,
        **record,
        "precision": t["precision"],
        "batch_size": t["batch_size"],
        "grad_accum": t["grad_accum"],
        "ranks": t.get("ranks", 1),
        "nodes": t.get("nodes", 1),
        "segment_samples": preset["audio"]["segment_samples"],
        "checkpointing": preset["model"]["checkpointing"],
        "calibration": dict(cal["used"], context_bytes=cal["context_bytes"]) if cal else None,
        "allocator": cond.allocator_record(),
        "gpu": cond.gpu_record(),
    }
    if device == "cuda" and method == "trace":
        cls = accuracy.estimate_class(record)
        record["uncertainty"], record["uncertainty_evidence"] = accuracy.uncertainty(cls)
        record["uncertainty_class"] = cls
    return finish(with_booking(record, preset), budget_bytes, safety_margin, time.time() - start)


def for_card(record: dict, preset: dict, cond: conditions.Conditions) -> dict | None:
    """A CUDA trace record made for another card, restated for the card of `cond`, or None where it
    cannot be: the trace is the same wherever the same preset runs (`cond.applied(preset)`, the same
    calibration), and only the card, its class and what that books differ (the fit matrix shares its
    traces across the GPUs of a column this way). None when this card's class would book the compiled
    trace (the trace itself would differ)."""
    why_eager = _why_eager(preset, cond)
    if why_eager is None or record.get("compiled") or cond.data_parallel:
        return None
    out = copy.deepcopy(record)
    out["gpu"] = cond.gpu_record()
    out["compiled_note"] = f"train.compile {preset['train'].get('compile')} on {cond.device}{why_eager}"
    cls = accuracy.estimate_class(out)
    out["uncertainty"], out["uncertainty_evidence"] = accuracy.uncertainty(cls)
    out["uncertainty_class"] = cls
    return finish(out, out["budget_bytes"], out["safety_margin"], out["seconds"])


def modelled_gpu(gpu: GpuEntry | str | None, cal: dict, calibration_spec: str = "auto") -> GpuEntry | None:
    """The card a CUDA estimate models: `gpu` when given (a catalogue entry or name); with the
    calibration given, its card; else the GPU in this machine; else the calibration's card (the
    built-in H100 without a GPU). A calibration's card not in the catalogue is known by the capability
    it records (`tiersep calibrate`), or None (any sm80+ card, as before there was a catalogue)."""
    from tiersep import gpu_catalogue, gpu_info

    if isinstance(gpu, GpuEntry):
        return gpu
    if gpu is not None:
        return gpu_catalogue.required(gpu, "--gpu")
    if calibration_spec == "auto" and gpu_info.name() is not None:
        return gpu_info.catalogue_entry()
    entry = gpu_catalogue.catalogue_entry(cal["name"], cal.get("total_memory_bytes"))
    if entry.name != "unknown":
        return entry
    if cal.get("capability"):
        return gpu_catalogue.from_capability(cal["name"], cal["capability"], cal.get("total_memory_bytes"),
                                             cal["used"]["source"])
    return None


def with_booking(record: dict, preset: dict) -> dict:
    """Add what the CPU gate books for the whole train process around the live bytes (cpu only; a
    data-parallel rank's process also holds gloo's buffers)."""
    if record["device"] == "cpu":
        record["cpu_process"] = cpu_booking.booking(record, preset)
        if record.get("data_parallel"):
            record["cpu_process"] = ranks.book_host_communicator(record["cpu_process"])
    return record


def _ranks_per_node(record: dict) -> int:
    """Ranks that share one machine's RAM (cpu) in a data-parallel record, else 1."""
    return int((record.get("data_parallel") or {}).get("ranks_per_node") or 1)


def required_bytes(record: dict) -> int:
    """What the fit gate books for an estimate: on CUDA the predicted device use (peak_bytes) times
    (1 + the uncertainty of its class), so that a class known to err is never trusted as exact; on
    CPU the predicted peak RSS of the whole train process (memory/cpu_booking.py). Data-parallel: per
    rank on CUDA (each rank has its GPU); on CPU the ranks of a node share its RAM, so a rank's
    process times the ranks per node."""
    if record["device"] == "cpu" and record.get("cpu_process"):
        return int(record["cpu_process"]["rss_bytes"]) * _ranks_per_node(record)
    if record["device"] == "cuda":
        return int(round(record["peak_bytes"] * (1 + float(record.get("uncertainty") or 0.0))))
    return int(record["peak_bytes"])


def finish(record: dict, budget_bytes: int | None, safety_margin: float, seconds: float) -> dict:
    """Add the budget verdict and the time taken to an estimate record (the one place `fits` is set)."""
    margin = int(safety_margin * budget_bytes) if budget_bytes is not None else None
    if record["device"] == "cpu" and record.get("cpu_process"):   # the malloc mode this budget allows
        share = budget_bytes // _ranks_per_node(record) if budget_bytes is not None else None
        record["cpu_process"] = cpu_booking.choose_malloc(record["cpu_process"], share, safety_margin)
    record["gate_required_bytes"] = required_bytes(record)
    record["budget_bytes"] = int(budget_bytes) if budget_bytes is not None else None
    record["safety_margin"] = safety_margin
    record["margin_bytes"] = margin
    record["fits"] = None if budget_bytes is None else bool(record["gate_required_bytes"] + margin <= budget_bytes)
    record["seconds"] = round(seconds, 3)
    return ranks.with_global(record)


def _device_peak(reserved_peak: int, live: int, cal: dict) -> tuple[int, dict]:
    """Predicted device use (nvidia-smi's figure): the allocator's reserved peak + the CUDA context."""
    workspace = cal["cublas_workspace_bytes"]
    return reserved_peak + cal["context_bytes"], {
        "cuda_context": cal["context_bytes"], "cublas_workspace": workspace,
        "allocator_cache": reserved_peak - live - workspace}


def _trace(preset: dict, cond: conditions.Conditions, cal: dict | None, compiled: bool):
    device = cond.device
    if cond.data_parallel:     # one rank's step, DDP's buckets and communicator (memory/trace/ranks.py)
        return ranks.trace_rank_step(preset, device, **({
            "workspace_bytes": cal["cublas_workspace_bytes"],
            "expandable_segments": cond.expandable_segments} if device == "cuda" else {}))
    if device == "cuda":
        return trace_step(preset, device, workspace_bytes=cal["cublas_workspace_bytes"],
                          expandable_segments=cond.expandable_segments, compiled=compiled)
    return trace_step(preset, device, compiled=compiled)


def _traced(preset: dict, cond: conditions.Conditions, cal: dict | None):
    """(trace result, compiled_note): the compiled step's trace when asked for on CPU (within 0.02% of
    real inductor CPU steps), else or when that fails the eager one. On CUDA the eager step: the
    compiled trace (0.66x eager for `large`, 0.67x for `small`) is not checked against a GPU, while a
    compiled step measured 0.63-0.77x its eager peak on CPU and 0.74x for MERL's model on an H100,
    so eager is an upper bound (auto compiles no checkpointed model, where that fails)."""
    setting = f"train.compile {preset['train'].get('compile')} on {cond.device}"
    why_eager = _why_eager(preset, cond)
    if why_eager is None:
        try:
            return _trace(preset, cond, cal, True), f"{setting}: the compiled step (memory/trace/compiled.py)"
        except Exception as err:  # noqa: BLE001 - any failure of the compiled trace: eager is an upper bound
            why_eager = f", but the compiled trace failed ({error_chain(err)}): the eager step, an upper bound"
    return _trace(preset, cond, cal, False), setting + why_eager


def _why_eager(preset: dict, cond: conditions.Conditions) -> str | None:
    """Why the estimate traces the eager step (the end of compiled_note), or None to trace the compiled one."""
    if not cond.compiled:
        return ": the eager step"
    if cond.data_parallel:
        return (": the eager step of a rank, an upper bound: a compiled DistributedDataParallel step "
                "(DDPOptimizer splits the graph at bucket boundaries) is not modelled")
    if preset["model"]["checkpointing"]:
        return (", checkpointed: the eager step, although the compiled run may need more: the compiled "
                "trace is not trusted with checkpointing (it predicted 0.56x a real compiled CPU step, "
                "which took 2.0x the eager peak: bench/results/compiled_estimate_cpu.md)")
    compiled_class = dict(_planned_class(preset, cond), step="compiled")
    if cond.device == "cuda" and not accuracy.trace_checked(compiled_class):
        under = accuracy.worst_under(compiled_class)
        checked = ("it is used on CUDA once it is checked against a GPU's compiled step" if under is None else
                   f"on a GPU it read {under:+.1%} of a compiled step's device use (docs/memory.md), so it is "
                   f"not booked")
        return (": the eager step, an upper bound of the compiled one where measured (0.63-0.77x on CPU, "
                f"0.74x for MERL's model on an H100); the compiled trace: {checked} "
                "(memory/trace/compiled.py, bench/gpu_evidence.py)")
    return None


def _planned_class(preset: dict, cond: conditions.Conditions) -> dict:
    """The accuracy class a CUDA estimate of `preset` will have, before it is traced."""
    return accuracy.estimate_class({"attention_backend": cond.traced_kernel(preset),
                                    "checkpointing": preset["model"]["checkpointing"],
                                    "allocator": cond.allocator_record(),
                                    "precision": cond.precision, "gpu": cond.gpu_record()})


def _from_trace(preset: dict, cond: conditions.Conditions, cal: dict | None) -> dict:
    device = cond.device
    r, compiled_note = _traced(preset, cond, cal)
    breakdown = dict(r.breakdown)
    live = sum(breakdown.values())
    if device == "cuda":
        peak, overhead_detail = _device_peak(r.reserved_peak, live, cal)
        if r.data_parallel:   # NCCL's buffers: cudaMalloc'ed outside the caching allocator
            peak += r.data_parallel["communicator_bytes"]
            overhead_detail["communicator"] = r.data_parallel["communicator_bytes"]
        uncertainty = None    # the class's (estimate(), memory/accuracy.py)
    else:
        peak = r.allocated_peak
        overhead_detail = {}
        uncertainty = CPU_UNCERTAINTY
    breakdown["overhead"] = peak - live
    backend = max(r.kernels, key=r.kernels.get) if r.kernels else cond.attention   # what the trace ran
    return {
        "parameters": r.parameters,
        "peak_bytes": int(peak),
        "largest_allocation_bytes": int(r.largest_allocation),
        "breakdown": {k: int(breakdown[k]) for k in BREAKDOWN_KEYS},
        "attention_backend": backend,
        "uncertainty": uncertainty,
        "allocated_peak_bytes": int(r.allocated_peak),
        "reserved_peak_bytes": int(r.reserved_peak) if r.reserved_peak is not None else None,
        "overhead_detail": overhead_detail,
        "input_bytes": int(r.inputs_bytes),
        "peak_phase": r.peak_phase,
        "peak_op": r.peak_op,
        "top_allocations": r.top_allocations,
        "micro_batches_traced": r.micro_batches_traced,
        "events": r.events,
        "notes": r.notes,
        "compiled": r.compiled,
        "compiled_note": compiled_note,
        "ema": _ema_record(preset, r.ema_bytes),
        "torch": torch.__version__,
        **({"data_parallel": r.data_parallel} if r.data_parallel else {}),
    }


def _ema_record(preset: dict, copy_bytes: int) -> dict | None:
    """train.ema as the estimate counted it: the EMA copy of the weights (part of breakdown
    weights, traced with its update after the optimizer step), or None when it is off."""
    spec = preset["train"].get("ema")
    return {**spec, "copy_bytes": int(copy_bytes)} if spec else None


def _from_measure(preset: dict, cond: conditions.Conditions, cal: dict | None) -> dict:
    from .measure import measure_step

    device = cond.device
    r = measure_step(preset, device, steps=2 if device == "cuda" else 1)
    weights = analytic.static_bytes(preset, device)
    if device == "cuda":
        peak = r.reserved_peak + cal["context_bytes"]
        overhead = peak - r.allocated_peak
    else:
        peak, overhead = r.allocated_peak, 0
    rest = r.allocated_peak - sum(weights.values())
    breakdown = {**weights, "activations": max(rest, 0), "transient": 0, "overhead": overhead}
    return {
        "parameters": r.parameters,
        "peak_bytes": int(peak),
        "largest_allocation_bytes": r.largest_allocation,
        "breakdown": {k: int(breakdown[k]) for k in BREAKDOWN_KEYS},
        "attention_backend": cond.attention,
        "uncertainty": 0.0,
        "allocated_peak_bytes": int(r.allocated_peak),
        "reserved_peak_bytes": int(r.reserved_peak) if r.reserved_peak is not None else None,
        "rss_growth_bytes": r.rss_growth,
        "seconds_per_step": round(r.seconds_per_step, 3),
        "notes": ["measured: activations holds everything live at the peak beyond weights, gradients "
                  "and optimizer state (transient is not separated)"],
        "torch": torch.__version__,
    }
