"""What a training process leaves behind: run.json when it finishes, failure.json when it does not."""
from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import torch

from tiersep.gpu_lease import current_record as gpu_lease_record
from tiersep.io import torch_save, write_json
from tiersep.probe import describe_device, host_info, versions
from tiersep.records import validate_record
from tiersep.train import checkpoint as ckpt
from tiersep.train import tracking
from tiersep.train.oom import attempted_allocation
from tiersep.train.telemetry import column_max

# The estimate fields run.json keeps beside the measurement.
ESTIMATE_FIELDS = ("peak_bytes", "allocated_peak_bytes", "reserved_peak_bytes", "gate_required_bytes",
                   "largest_allocation_bytes", "method", "device", "budget_bytes", "fits", "uncertainty",
                   "attention_backend", "calibration", "allocator", "cpu_process", "compiled", "compiled_note", "ema")


def write_failure(out_dir: Path, kind: str, message: str, **extra) -> None:
    path = Path(out_dir) / "failure.json"
    failure = {"kind": kind, "message": message, **extra, **host_info(), "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    write_json(path, validate_record("failure", failure, path))


def write_run(out_dir: Path, run: dict) -> None:
    path = Path(out_dir) / "run.json"
    write_json(path, validate_record("run", run, path))


def write_oom_failure(run, err: BaseException, memory: dict) -> str:
    """failure.json kind oom for a Training `run`: the attempted allocation beside the estimate."""
    message = str(err).strip()
    first = message.splitlines()[0] if message else "out of memory"
    est, t = run.plan.estimate or {}, run.t
    write_failure(
        run.out_dir, "oom", first, full_message=message, preset=run.preset["name"], step=run.step,
        attempt=run.plan.attempt, device=describe_device(run.device), batch_size=t["batch_size"],
        grad_accum=t["grad_accum"], precision=t["precision"],
        attempted_allocation_bytes=attempted_allocation(message),
        estimate_peak_bytes=est.get("peak_bytes"),
        estimate_largest_allocation_bytes=est.get("largest_allocation_bytes"),
        estimate_method=est.get("method"), budget_bytes=run.plan.budget,
        memory_at_failure=memory, start_free_bytes=run.plan.start_free,
        next_attempt=("halves the micro-batch and doubles accumulation"
                      if t["batch_size"] > 1 else "nothing left to halve (micro-batch 1)"))
    return first


def run_record(run, weights_step: int, held: str) -> dict:
    """run.json of a finished Training `run`."""
    plan, t, probe = run.plan, run.t, run.plan.probe
    peak_alloc, peak_reserved = probe.peaks()
    # Peaks over every process that worked on this run (a resumed run has several).
    peak_alloc = max(peak_alloc, column_max(run.out_dir / "memory.csv", "peak"))
    peak_reserved = max(peak_reserved, column_max(run.out_dir / "memory.csv", "reserved"))
    measured = probe.record()
    if plan.device.type == "cuda":
        measured["peak_device_bytes"] = max(measured["peak_device_bytes"],
                                            column_max(run.out_dir / "memory.csv", "device"))
    # the step rate leaves out a compiled run's first step, which compiled the model
    compile_seconds = run.compile_info.get("first_step_seconds") or 0.0
    loop_seconds = time.time() - run.loop_start - compile_seconds
    timed_steps = run.steps_this_process - (1 if compile_seconds else 0)
    est = plan.estimate or {}
    return {
        "preset": run.preset["name"], **host_info(), "device": describe_device(plan.device),
        "device_type": plan.device.type, "gpu_lease": gpu_lease_record(), "start_free_bytes": plan.start_free,
        "start_process_bytes": plan.start_process,
        "peak_allocated_bytes": peak_alloc, "peak_reserved_bytes": peak_reserved, **measured,
        "allocator": plan.allocator if plan.device.type == "cuda" else None,
        "memory_fraction": plan.memory_fraction, "malloc": plan.malloc,
        "wall_seconds": round(time.time() - run.wall_start, 3),
        "train_seconds": round(run.train_seconds(), 3),
        "steps": run.step, "steps_this_process": run.steps_this_process,
        "steps_per_s": (timed_steps / loop_seconds) if loop_seconds > 0 and timed_steps > 0 else None,
        "parameters": run.parameters,
        "attention_backend": est.get("attention_backend", run.preset["model"]["attention_backend"]),
        "precision": t["precision"],
        "loss_scaler": loss_scaler(run),
        "batch_size": t["batch_size"], "grad_accum": t["grad_accum"],
        "ranks": t["ranks"], "nodes": t["nodes"],
        "effective_batch": t["batch_size"] * t["grad_accum"] * t["ranks"], "lr": t["lr"], "seed": t["seed"],
        "attempt": plan.attempt, "downshifted_from": plan.downshifted_from,
        "recovered_from": plan.recovered_from, "resumed_from": run.resumed_from,
        "resume_warning": plan.resume_warning,
        "best": {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in run.best.items()},
        # weights: train.export (best | last); holds: which of them, raw or ema (train.ema)
        "exported": {"weights": t["export"], "step": int(weights_step), "holds": held},
        "ema": t.get("ema"),
        "versions": versions(), "torch_threads": torch.get_num_threads(),
        "estimate": {k: est.get(k) for k in ESTIMATE_FIELDS} if est else None,
        "gate_budget_bytes": plan.budget,
        "adapted": plan.adapted,
        # a preset change started this run anew: where the earlier one went (never deleted)
        "moved_aside": run.run_info.get("moved_aside"),
        # train.steps grew and the run continued: [{steps, step}] of each shorter run it extends
        "extended_from": run.run_info.get("extended_from") or None,
        "compile": run.compile_info,
    }


def rank_memory(run) -> dict:
    """One rank's line of run.json's per_rank (gathered by rank 0): where it ran, its peak memory
    (resident set on a CPU, device use and allocator peaks on a GPU) and, with fp16, its own loss
    scaler (every rank's skips the same steps: they unscale the same all-reduced gradients)."""
    peak_alloc, peak_reserved = run.plan.probe.peaks()
    return {"rank": run.ranks.rank, **host_info(), "device": describe_device(run.device),
            "peak_allocated_bytes": peak_alloc, "peak_reserved_bytes": peak_reserved, **run.plan.probe.record(),
            "loss_scaler": loss_scaler(run)}


def loss_scaler(run) -> dict | None:
    """fp16's scale after the last step and the steps it skipped (None without a scaler)."""
    return {"scale": run.scaler.scale(), "skipped_steps": run.scaler.skipped} if run.scaler is not None else None


# What a training process writes into its run folder (a folder holding nothing else, and no stamp,
# is a run folder from before stamps: tiersep.outputs.claim adopts it).
RUN_FILES = {"model.pt", "run.json", "failure.json", "outcome.json", "metrics.csv", "memory.csv",
             ckpt.CHECKPOINT_DIR, "previous", tracking.TB_DIR, tracking.WANDB_DIR}
FINISHED = ("model.pt", "run.json")


def has_results(out_dir: Path) -> bool:
    """Whether out_dir holds a run worth keeping: a model, a run record, a checkpoint, or logged
    steps (a failed attempt's failure.json and header-only logs are not)."""
    out_dir = Path(out_dir)
    if any((out_dir / name).exists() for name in FINISHED):
        return True
    if any(ckpt.last_path(out_dir).parent.glob("*.pt")):
        return True
    for log in ("metrics.csv", "memory.csv"):
        path = out_dir / log
        if path.is_file() and path.stat().st_size > 0:
            with open(path, "rb") as handle:
                if len(handle.read(1 << 16).splitlines()) > 1:
                    return True
    return False


def export_model(run) -> tuple[int, str]:
    """Write model.pt with the weights train.export asks for: the best validation weights (best.pt,
    raw or EMA, whichever scored higher) or the last ones (the EMA's with train.ema). model.pt's
    `weights` says which: raw or ema. Returns the step they are from and that."""
    held = "ema" if run.ema is not None else "raw"
    weights, step = (run.ema.weights(run.model) if run.ema is not None else run.model.state_dict()), run.step
    best_file = ckpt.best_path(run.out_dir)
    if run.t["export"] == "best" and best_file.is_file() and run.best.get("step") is not None:
        best_state = ckpt.load_checkpoint(best_file)
        if best_state["step"] == run.best["step"]:
            (weights, held), step = ckpt.held_weights(best_state), run.best["step"]
        else:
            print(f"tiersep train: {best_file} holds step {best_state['step']}, not the best step "
                  f"{run.best['step']}; exporting the last weights", file=sys.stderr)
    weights = {k: v.detach().cpu() for k, v in weights.items()}
    torch_save({"model": weights, "preset": run.preset, "step": int(step), "final_step": run.step,
                "export": run.t["export"], "weights": held}, run.out_dir / "model.pt")
    return int(step), held
