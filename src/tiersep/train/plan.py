"""The plan of one training process, settled before anything is allocated on the device.

`plan_run` decides, in order: the checkpoint to resume, the micro-batch (downshifted after an OOM on
a Snakemake retry), the CUDA allocator settings, the device and its free-memory baseline, and the
fit gate's verdict (refused, or adapted to the budget with on_oversize: adapt). The loop then only
carries the plan out; run.json and failure.json record it.
"""
from __future__ import annotations

import copy
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from tiersep import config as C
from tiersep.device import apply_memory_fraction, choose_device, configure_cuda_allocator, device_type
from tiersep.io import read_json
from tiersep.malloc import configure_malloc
from tiersep.memory import GateSettings
from tiersep.memory.cpu_booking import trims_heap
from tiersep.model.compile import compiles
from tiersep.model.step import resolve_precision
from tiersep.probe import MemoryProbe
from tiersep.train.job import TrainJob
from tiersep.train.oom import plan_micro_batch
from tiersep.train.resume import resume_state

# A CPU run is refused ("GPU-sized") when one optimisation step would process more than this many
# TF-bin x layer x channel units (batch x accumulation x frames x freq bins x layers x emb_dim).
# Measured on one core: cpu_tiny is 2.6e5 units (0.15 s per step), cpu_small 7.8e5 (0.45 s), so
# the limit is about 6 s per step; the seeds' `small` (2.5e7) takes minutes per step and 10-30 GB
# on a CPU (REFERENCE.md), ultra_safe 4e8.
CPU_MAX_STEP_UNITS = 1.0e7


@dataclass
class RunPlan:
    preset: dict                    # as trained: after a downshift or an adaptation
    device: torch.device
    probe: MemoryProbe
    attempt: int
    allocator: dict                 # effective CUDA allocator settings (device.configure_cuda_allocator)
    start_free: int                 # free device memory (or RAM) before this job allocated anything
    start_process: int
    budget: int | None = None
    estimate: dict | None = None    # the estimate the gate passed
    resume: dict | None = None      # checkpoint state to continue from
    not_resumed: str | None = None  # why --resume starts a new run
    resume_requested: bool = False  # --resume was given
    resume_warning: str | None = None  # a damaged last.pt: resumed from the previous one, or started over
    downshifted_from: dict | None = None
    adapted: dict | None = None     # {"reason", "changes"} when on_oversize: adapt changed the preset
    recovered_from: dict | None = None   # the OOM failure this attempt recovers from
    refusal: str | None = None      # set: the run is refused (exit 3)
    memory_fraction: float | None = None
    malloc: dict | None = None      # host malloc settings the CPU booking assumes (cpu_process)
    gate_settings: GateSettings | None = None   # the gate's, kept for a re-check (a compile falling back to eager)

    @property
    def compile(self) -> bool:
        """train.compile as it applies to this run (tiersep.model.compile.compiles)."""
        return compiles(self.preset, self.device.type)


def step_units(preset: dict) -> float:
    """Work of one optimisation step: samples x frames x freq bins x layers x channels."""
    a, m, t = preset["audio"], preset["model"], preset["train"]
    frames = a["segment_samples"] // a["hop"] + 1
    bins = a["n_fft"] // 2 + 1
    return float(t["batch_size"] * t["grad_accum"] * frames * bins * m["n_layers"]
                 * max(m["emb_dim"], m["attention_dim"]))


def cpu_refusal(preset: dict) -> str | None:
    """The message refusing a GPU-sized preset on CPU, or None when it may run here."""
    units = step_units(preset)
    if preset["train"]["allow_cpu"] or units <= CPU_MAX_STEP_UNITS:
        return None
    return (f"preset {preset['name']} is GPU-sized: one step processes {units:.2e} TF-bin x layer x "
            f"channel units, {units / CPU_MAX_STEP_UNITS:.1f}x the CPU limit of {CPU_MAX_STEP_UNITS:.0e} "
            "(about 6 s per step on one core). Train it on a GPU, or force the CPU with "
            "`--set train.allow_cpu=true`.")


def gate_budget(cfg: dict, device: torch.device, start_free: int) -> int | None:
    """The budget the fit gate checks: the configured GiB (auto: none) capped by what is free now
    on this GPU, or the machine's available RAM (CPU). budget_gib: auto is resolved here, in the job
    that runs on the GPU."""
    if device.type != "cuda":
        return start_free
    configured = C.budget_bytes(cfg)
    return start_free if configured is None else min(configured, start_free)


def usable_estimate(estimate_path, preset: dict, device: torch.device, allocator: dict,
                    downshifted: bool) -> tuple[dict | None, str | None]:
    """(the estimate file's record, None) when it was made for this run, else (None, why not):
    another device, preset, micro-batch, allocator mode or train.ema, or a record that does not validate."""
    if estimate_path is None or not Path(estimate_path).is_file():
        return None, None
    from tiersep.records import RecordError, validate_record

    try:
        record = validate_record("estimate", read_json(estimate_path), estimate_path)
    except (RecordError, ValueError) as err:
        return None, f"{str(err).splitlines()[0]}; not trusted, estimating again"
    if record.get("device") != device.type or record.get("preset") not in (None, preset["name"]) or downshifted:
        return None, None
    if bool(record.get("ema")) != bool(preset["train"].get("ema")):   # the EMA copy is booked or not
        return None, f"{estimate_path} was made {'with' if record.get('ema') else 'without'} train.ema; estimating again"
    expandable = (record.get("allocator") or {}).get("expandable_segments")
    if device.type == "cuda" and expandable is not None and expandable != allocator["expandable_segments"]:
        return None, f"{estimate_path} models another allocator mode; estimating again"
    return record, None


def run_precision(preset: dict) -> str:
    """train.precision as this process will train it: `auto` resolved for the device it trains on
    (model/step.py resolve_precision; the card's native bf16 read from NVML, no CUDA context)."""
    precision = preset["train"]["precision"]
    if precision != "auto":
        return precision
    from tiersep import gpu_info

    kind = device_type(preset["train"]["device"])
    return resolve_precision(precision, kind, kind == "cuda" and gpu_info.catalogue_entry().bf16)


def plan_run(job: TrainJob, gated_on_main: bool = False, main_estimate: dict | None = None) -> RunPlan:
    """Everything decided before the run allocates anything (see module docstring).
    `gated_on_main`: a data-parallel rank other than 0 plans with rank 0's gate verdict (its
    `main_estimate`) instead of gating again, and with the micro-batch of rank 0's plan (the job's preset)."""
    from tiersep.memory import DoesNotFit, gate

    cfg, out_dir, resume, attempt = job.cfg, job.out_dir, job.resume, job.attempt
    preset = copy.deepcopy(job.preset)
    preset["train"]["precision"] = run_precision(preset)   # auto: for this machine's device, before all else
    failure_path = out_dir / "failure.json"
    previous_failure = read_json(failure_path) if failure_path.is_file() else None
    resume_warnings: list[str] = []
    state, not_resumed = resume_state(out_dir, preset, resume, resume_warnings)

    # a rank other than 0 trains rank 0's micro-batch (its verdict's preset), whatever the checkpoint says
    batch, accum, downshifted_from = ((preset["train"]["batch_size"], preset["train"]["grad_accum"], None)
                                      if gated_on_main else
                                      plan_micro_batch(preset, attempt, previous_failure, state["run"] if state else None))
    downshifted = (batch, accum) != (preset["train"]["batch_size"], preset["train"]["grad_accum"])
    preset["train"]["batch_size"], preset["train"]["grad_accum"] = batch, accum
    if downshifted_from:
        print(f"tiersep train: attempt {attempt} after an out-of-memory failure: micro-batch "
              f"{downshifted_from['batch_size']} x {downshifted_from['grad_accum']} -> {batch} x {accum} "
              "(same effective batch)", file=sys.stderr)

    allocator = configure_cuda_allocator(preset)   # before CUDA starts in this process
    device = choose_device(preset)
    probe = MemoryProbe(device)
    plan = RunPlan(preset, device, probe, attempt, allocator, probe.start_free_bytes(), probe.process_bytes(),
                   resume=state, not_resumed=not_resumed, resume_warning="; ".join(resume_warnings) or None,
                   resume_requested=resume,
                   downshifted_from=downshifted_from, gate_settings=GateSettings.from_config(cfg),
                   memory_fraction=apply_memory_fraction(device))
    if previous_failure and previous_failure.get("kind") == "oom":
        plan.recovered_from = previous_failure   # only an OOM is "recovered from" by this run
    elif state:
        plan.recovered_from = state["run"].get("recovered_from")
    if gated_on_main:
        plan.estimate = main_estimate
        plan.malloc = host_malloc(plan)
        return plan
    plan.refusal = cpu_refusal(preset) if device.type == "cpu" else None
    if plan.refusal is not None:
        return plan
    plan.budget = gate_budget(cfg, device, plan.start_free)
    estimate, distrust = usable_estimate(job.estimate_path, preset, device, allocator, downshifted)
    if distrust:
        print(f"tiersep train: {distrust}", file=sys.stderr)
    try:
        plan.estimate = gate(preset, device.type, plan.budget, plan.gate_settings, estimate=estimate)
    except DoesNotFit as refused:
        plan.refusal, plan.estimate = str(refused), refused.estimate
        if cfg["on_oversize"] == "adapt" and plan.budget is not None:
            _adapt(plan, refused, out_dir, resume)
    plan.malloc = host_malloc(plan)
    return plan


def host_malloc(plan: RunPlan) -> dict:
    """Apply the malloc mode the CPU gate booked for the plan's estimate (before the model exists)
    and say which, for run.json: the tuned settings only when glibc's own did not fit the budget
    (cpu_process); `trim_heap`: the trainer trims glibc's heap around each checkpointed block, as
    booked, unless the step is compiled (dynamo does not trace the C call)."""
    device = plan.device
    booked = (plan.estimate or {}).get("cpu_process") if device.type == "cpu" else None
    mode = booked.get("malloc", "tuned") if booked else None   # bookings from before the modes assumed tuned
    if mode == "tuned":
        return {**configure_malloc(), "trim_heap": False}
    why = ("glibc's own malloc: its booking fits the budget" if mode == "glibc_default"
           else "CUDA run: the gate books device memory" if device.type == "cuda" else "no CPU booking")
    return {"allocator": "glibc", "applied": False, "reason": why,
            "trim_heap": trims_heap(plan.preset, mode) and not plan.compile}


def _adapt(plan: RunPlan, refused, out_dir: Path, resume: bool) -> None:
    """on_oversize: adapt. Train the nearest variant that fits (the one the gate's refusal names,
    from tiersep.memory.fit), gated again; the refusal stands when none does."""
    from tiersep.memory import DoesNotFit, gate

    if not refused.fitted:
        plan.refusal = f"{refused}; on_oversize is adapt, but no variant fits"
        return
    fitted = copy.deepcopy(refused.fitted)
    fitted["name"] = plan.preset["name"]  # the tier keeps its name; run.json records what changed
    try:
        plan.estimate = gate(fitted, plan.device.type, plan.budget, plan.gate_settings)
    except DoesNotFit as err:
        plan.refusal = f"{refused}; on_oversize is adapt, but the variant still does not fit: {err}"
        return
    plan.preset, plan.refusal = fitted, None
    plan.adapted = {"reason": str(refused), "changes": list(refused.suggestion)}
    print(f"tiersep train: adapted {fitted['name']} to the budget: {'; '.join(refused.suggestion)}",
          file=sys.stderr)
    # an earlier run of this adapted variant may have left a checkpoint
    plan.resume, plan.not_resumed = resume_state(out_dir, fitted, resume)
