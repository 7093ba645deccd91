"""One command that settles the open GPU questions of the memory estimate (issue 24), on one GPU.

    python bench/gpu_evidence.py [--out tests/data/gpu] [--reference DIR] [--budget 540] [--commit REV]
    python bench/gpu_evidence.py --dry-run [--out DIR]        # on a CPU: the same plan, tiny presets

It writes one dated folder in the shared measurement format (tests/data/gpu/h100-2026-11-22/
README.md), `<gpu>-<date>/`, that tests/test_memory_cuda_accuracy.py reads as it is:
- measurements.jsonl, first: real steps of HELD_OUT and DTYPE_CLASSES configurations, ones that no estimate rule,
  calibration or uncertainty was fitted on, flagged `held_out` (the out-of-sample accuracy, issue 34);
- events/<name>.events.json.gz: the caching allocator's event log (model creation, AdamW state and
  2 steps) of `small bf16 math`, `small fp32 math` and the released `memory_optimized b2 ckpt`;
- measurements.jsonl: real steps (3 after the setup) of both math configurations with the native
  allocator and expandable segments, the released one, and compiled steps (`train.compile: true`,
  measured after one warm-up step that compiles) of `small` in both allocator modes: the rows the
  compiled trace is checked against before the gate may book it;
- calibration.json: `tiersep calibrate`;
- colocate.json: two small trials (COLOCATE_STEPS steps of `small`, each its own process booked
  through tiersep's GPU bookings, tiersep.gpu_lease) co-located on the GPU against the same two in
  a row: wall time, each one's step-loop seconds, and each one's peak device use (NVML's per-process
  figure, sampled, and its own torch counters): the co-location slowdown bench/search_packing.py
  has to assume;
- merl.md: MERL's reference against our step, eager and compiled (bench/model_step.py, needs
  --reference, a checkout of merlresearch/tf-locoformer);
- manifest.json: the commit whose model ran, the GPU, versions, and every job with its status
  (ok, failed, skipped or timed out, and why) and seconds. A job that did not run is never a pass.
Every job is a fresh process (its allocator mode set before CUDA starts), run in priority order; a
job gets what is left of --budget (9 minutes by default) and is stopped when it runs past it.

On an offline GPU machine with only torch, follow ../shared/gpu/OFFLINE-GPU.md (wheels in .whl/,
`source .gpu/gpu-setup.sh;` before the command). Then `python -m tiersep.memory.evidence --write`.
--dry-run measures nothing on a GPU: CPU steps of cpu_tiny-sized variants, the event logs from the
CPU allocation sequence, flagged `dry_run` everywhere (the evidence loader skips such folders).
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
MATH = {"model.attention_backend": "math"}
# (name, preset, set, kind, allocator mode) in priority order; kind: events | measure | compiled
FP32, CKPT = {"train.precision": "fp32"}, {"model.checkpointing": True}
# Configurations no estimate rule, calibration or uncertainty was ever fitted on (issue 34): their
# rows carry held_out, and the accuracy that docs/memory.md states is read from them.
HELD_OUT = [
    ("held-out small fp32 ckpt b2", "small", {**FP32, **CKPT, "train.batch_size": 2}, "measure", "native"),
    ("held-out small bf16 efficient 6h b2", "small", {"model.attention_backend": "efficient", "model.n_heads": 6,
                                                     "train.batch_size": 2},
     "measure", "native"),
    ("held-out memory_optimized fp32 ckpt", "memory_optimized", {**FP32, **CKPT}, "measure", "native"),
    ("held-out ultra_safe bf16 ckpt b2", "ultra_safe", {**CKPT, "train.batch_size": 2, "train.grad_accum": 1},
     "measure", "expandable"),
    ("held-out large bf16 ckpt 1s", "large", {**CKPT, "train.precision": "bf16", "audio.segment_samples": 44032,
                                              "train.grad_accum": 1}, "measure", "native"),
    ("held-out small fp32 math b2 acc2", "small", {**FP32, **MATH, "train.batch_size": 2, "train.grad_accum": 2},
     "measure", "expandable"),
    ("held-out xlarge bf16 ckpt 0.5s", "xlarge", {**CKPT, "audio.segment_samples": 22528, "train.batch_size": 1,
                                                  "train.grad_accum": 1}, "measure", "native"),
    ("held-out small bf16 8h64 4s", "small", {"model.n_heads": 8, "model.emb_dim": 64, "model.attention_dim": 64,
                                              "audio.segment_samples": 176128}, "measure", "native"),
]
# Issue 31: classes as fine as the evidence. fp16 (autocast float16 with the trainer's loss scaler)
# with each kernel a card may run it with (flash from sm80; efficient, the pre-Ampere cards' fused
# kernel; math), and more fp32 and bf16 math rows, so that each dtype's math class rests on rows of
# its own. All held out: no rule was read off an fp16 step.
FP16, EFF = {"train.precision": "fp16"}, {"model.attention_backend": "efficient"}
DTYPE_CLASSES = [
    ("held-out small fp16", "small", FP16, "measure", "native"),
    # efficient needs a 16-bit head dim divisible by 8: small's is 12, six heads make it 16
    ("held-out small fp16 efficient 6h", "small", {**FP16, **EFF, "model.n_heads": 6}, "measure", "native"),
    ("held-out small fp16 math", "small", {**FP16, **MATH}, "measure", "native"),
    ("held-out memory_optimized fp16 ckpt", "memory_optimized", {**FP16, **CKPT}, "measure", "native"),
    ("held-out small fp16 efficient 6h ckpt b2", "small", {**FP16, **EFF, **CKPT, "model.n_heads": 6,
                                                            "train.batch_size": 2},
     "measure", "expandable"),
    ("held-out small fp16 math", "small", {**FP16, **MATH}, "measure", "expandable"),
    # 2 s: its 5 s segments' fp32 score matrices do not fit even an H200 (13.5 GiB more asked)
    ("held-out memory_optimized fp32 math 2s", "memory_optimized", {**FP32, **MATH, "audio.segment_samples": 88064},
     "measure", "native"),
    ("held-out small fp32 math 8h64", "small", {**FP32, **MATH, "model.n_heads": 8, "model.emb_dim": 64,
                                                 "model.attention_dim": 64}, "measure", "native"),
    ("held-out memory_optimized fp32 math ckpt", "memory_optimized", {**FP32, **MATH, **CKPT}, "measure",
     "expandable"),
    ("held-out small bf16 math b2", "small", {**MATH, "train.batch_size": 2}, "measure", "native"),
    ("small fp16", "small", FP16, "events", "native"),     # the allocator's log of an fp16 step, for later rules
    # the second run of 2026-11-27: the fp16 classes the first left without rows, and an out-of-sample
    # row for efficient fp32 checkpointed with expandable segments (its only row was a rule's)
    ("held-out ultra_safe fp16", "ultra_safe", {**FP16, "train.grad_accum": 1}, "measure", "expandable"),
    ("held-out small fp16 b2 acc2", "small", {**FP16, "train.batch_size": 2, "train.grad_accum": 2}, "measure",
     "expandable"),
    ("held-out large fp16 ckpt 1s", "large", {**FP16, **CKPT, "audio.segment_samples": 44032, "train.grad_accum": 1},
     "measure", "native"),
    ("held-out ultra_safe fp32 ckpt", "ultra_safe", {**FP32, **CKPT, "train.grad_accum": 1}, "measure", "expandable"),
    # the fourth run of 2026-11-27: one row for each eager Hopper class that still had none (kernel x
    # dtype x checkpointing x allocator). small's efficient 16-bit rows keep six heads (head dim 8);
    # ultra_safe (96 / 4 = 24) and memory_optimized (128 / 8 = 16) run it with their own heads.
    ("held-out small fp16 ckpt b2", "small", {**FP16, **CKPT, "train.batch_size": 2}, "measure", "expandable"),
    ("held-out ultra_safe bf16 efficient", "ultra_safe", {**EFF, "train.grad_accum": 1}, "measure", "expandable"),
    ("held-out small bf16 efficient 6h ckpt", "small", {**EFF, **CKPT, "model.n_heads": 6}, "measure", "native"),
    ("held-out memory_optimized bf16 efficient ckpt", "memory_optimized", {**EFF, **CKPT}, "measure", "expandable"),
    ("held-out small fp16 efficient 6h b2", "small", {**FP16, **EFF, "model.n_heads": 6, "train.batch_size": 2},
     "measure", "expandable"),
    ("held-out ultra_safe fp16 efficient ckpt", "ultra_safe", {**FP16, **EFF, **CKPT, "train.grad_accum": 1},
     "measure", "native"),
    ("held-out small bf16 math ckpt", "small", {**MATH, **CKPT}, "measure", "native"),
    ("held-out small bf16 math ckpt b2", "small", {**MATH, **CKPT, "train.batch_size": 2}, "measure", "expandable"),
    ("held-out small fp16 math ckpt b2", "small", {**FP16, **MATH, **CKPT, "train.batch_size": 2}, "measure",
     "native"),
    ("held-out small fp16 math ckpt", "small", {**FP16, **MATH, **CKPT}, "measure", "expandable"),
    ("held-out small fp32 math ckpt", "small", {**FP32, **MATH, **CKPT}, "measure", "native"),
    # cuDNN attention got classes of its own (records name it, 2026-11-27): one row for each Hopper
    # class of it without any (ultra_safe's head dim 24 and memory_optimized's 16 run cuDNN under
    # auto), and held-out rows for flash bf16 checkpointed, which kept only in-sample small rows
    ("held-out ultra_safe bf16", "ultra_safe", {"train.grad_accum": 1}, "measure", "expandable"),
    ("held-out memory_optimized fp16", "memory_optimized", FP16, "measure", "native"),
    ("held-out ultra_safe fp16 ckpt", "ultra_safe", {**FP16, **CKPT, "train.grad_accum": 1}, "measure", "expandable"),
    ("held-out small bf16 ckpt b2", "small", {**CKPT, "train.batch_size": 2}, "measure", "native"),
    ("held-out small bf16 ckpt", "small", CKPT, "measure", "expandable"),
    # that last one proved to be small_bf16_ckpt of 2026-11-22 again (in sample), so flash bf16
    # checkpointed with expandable segments still had no row out of sample (2026-11-28): two that differ
    ("held-out small bf16 ckpt b3", "small", {**CKPT, "train.batch_size": 3}, "measure", "expandable"),
    ("held-out small bf16 ckpt 1s", "small", {**CKPT, "audio.segment_samples": 44032}, "measure", "expandable"),
    # the one eager Hopper class left without a row (flash fp16 checkpointed, native allocator), and a
    # deep tier unchecked, which the estimate traces with five blocks of its eight (trace/depth.py)
    ("held-out small fp16 ckpt", "small", {**FP16, **CKPT}, "measure", "native"),
    ("held-out large bf16 1s", "large", {"train.precision": "bf16", "audio.segment_samples": 44032,
                                         "train.grad_accum": 1}, "measure", "expandable"),
]
JOBS = HELD_OUT + DTYPE_CLASSES + [
    ("calibrate", None, {}, "calibrate", "native"),
    ("small co-located", "small", {}, "colocate", "native"),
    ("small bf16 math", "small", MATH, "events", "native"),
    ("small fp32 math", "small", {**MATH, "train.precision": "fp32"}, "events", "native"),
    ("memory_optimized b2 ckpt", "memory_optimized", {"train.batch_size": 2, "model.checkpointing": True},
     "events", "native"),
    # checkpointed math attention under the native allocator: allocated right, device use 14-17% under
    # (held-out rows of 2026-11-27); the allocator's own logs say where the segments go
    ("small fp32 math ckpt", "small", {**FP32, **MATH, **CKPT}, "events", "native"),
    ("small bf16 math ckpt", "small", {**MATH, **CKPT}, "events", "native"),
    # flash (in fact cuDNN) attention over-estimated by 4.9-5.7% in device use (allocated exact) with the native
    # allocator: the logs give the cuDNN workspaces these shapes really get (memory/trace/kernels.py)
    ("large bf16 ckpt 1s", "large", {**CKPT, "train.precision": "bf16", "audio.segment_samples": 44032,
                                     "train.grad_accum": 1}, "events", "native"),
    ("xlarge bf16 ckpt 0.5s", "xlarge", {**CKPT, "audio.segment_samples": 22528, "train.batch_size": 1,
                                         "train.grad_accum": 1}, "events", "native"),
    ("small bf16 8h64 4s", "small", {"model.n_heads": 8, "model.emb_dim": 64, "model.attention_dim": 64,
                                     "audio.segment_samples": 176128}, "events", "native"),
    ("small bf16 math", "small", MATH, "measure", "native"),
    ("small fp32 math", "small", {**MATH, "train.precision": "fp32"}, "measure", "native"),
    ("small bf16 math", "small", MATH, "measure", "expandable"),
    ("small fp32 math", "small", {**MATH, "train.precision": "fp32"}, "measure", "expandable"),
    ("memory_optimized b2 ckpt", "memory_optimized", {"train.batch_size": 2, "model.checkpointing": True},
     "measure", "native"),
    ("small compiled", "small", {"train.compile": True}, "compiled", "native"),
    ("small compiled", "small", {"train.compile": True}, "compiled", "expandable"),
    ("merl", None, {}, "merl", "native"),
]
STEPS, LOG_STEPS = 3, 2
COLOCATE_STEPS = 100    # about 8.5 s of `small` alone on the H100 (85 ms a step)
# A dry run keeps each job's settings on a preset a CPU steps in a second.
DRY_PRESET = "cpu_tiny"


# ------------------------------------------------------------------------------------------------
# one job, in its own process
# ------------------------------------------------------------------------------------------------
def _preset(job: dict) -> dict:
    from tiersep import config as C

    preset = C.load_preset(DRY_PRESET if job["dry_run"] else job["preset"],
                           {"presets_dir": str(ROOT / "config" / "presets")})
    for key, value in job["set"].items():
        preset = C.set_field(preset, key, value)
    preset = C.set_field(preset, "train.cuda_expandable_segments", job["mode"] == "expandable")
    return C.validate(preset, "preset.schema.yaml", f"gpu_evidence job {job['name']}")


def _trace_estimate(preset: dict, job: dict) -> dict:
    """The CUDA estimate, made before CUDA is touched and kept with the row for reference (the
    evidence recomputes it from the commit's model); a compiled job's is the compiled trace's."""
    from tiersep.memory.estimate import estimate
    from tiersep.memory.trace import trace_step

    record = estimate(preset, "trace", "cuda", compiled=False)
    out = {k: record.get(k) for k in ("allocated_peak_bytes", "reserved_peak_bytes", "peak_bytes",
                                      "attention_backend", "compiled", "uncertainty")}
    if job["kind"] == "compiled":
        r = trace_step(preset, "cuda", workspace_bytes=record["overhead_detail"]["cublas_workspace"],
                       expandable_segments=job["mode"] == "expandable", compiled=True)
        out.update(allocated_peak_bytes=r.allocated_peak, reserved_peak_bytes=r.reserved_peak, compiled=True,
                   peak_bytes=r.reserved_peak + record["calibration"]["context_bytes"])
    return out


def _device_counters(torch) -> dict:
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return {"max_memory_allocated": torch.cuda.max_memory_allocated(),
            "max_memory_reserved": torch.cuda.max_memory_reserved(),
            "device_used_bytes": int(total - free),
            "outside_torch_bytes": int(total - free - torch.cuda.memory_reserved()),
            "device_total_bytes": int(total)}


def _workload(preset: dict, device: str):
    import torch

    from tiersep.memory.trace.workload import build_workload

    torch.manual_seed(preset["train"]["seed"])
    return build_workload(preset, device, lambda *shape: 0.1 * torch.randn(shape, device=device))


def run_measure(job: dict, preset: dict) -> dict:
    """Real steps after the setup, counters read as measurements.jsonl's were (memory/measure.py)."""
    import torch

    from tiersep.memory.measure import measure_step

    estimate = _trace_estimate(preset, job)
    if job["dry_run"]:     # CPU figures under CPU names: a dry run reports no GPU counter
        counters = {"cpu_live_peak_bytes": measure_step(preset, "cpu", steps=1).allocated_peak}
    else:
        torch.cuda.init()
        measure_step(preset, "cuda", steps=STEPS)
        counters = _device_counters(torch)
    return {"steps": 1 if job["dry_run"] else STEPS, **counters, "tiersep_trace_estimate": estimate}


def run_compiled(job: dict, preset: dict) -> dict:
    """train.compile: the model through compile_model as the trainer runs it; one warm-up step
    compiles, then the peak counters are reset and STEPS steps measured."""
    import torch

    from tiersep.model.compile import compile_model
    from tiersep.model.step import train_step

    estimate = _trace_estimate(preset, job)
    device = "cpu" if job["dry_run"] else "cuda"
    work = _workload(preset, device)
    call, info = compile_model(work.model, preset["train"].get("compile_mode", "default"))
    if not info["compiled"]:
        raise RuntimeError(f"torch.compile fell back to eager: {info.get('reason')}")
    train_step(call, work.loss_fn, work.optimizer, work.inputs, preset, device)
    if job["dry_run"]:
        return {"steps": 1, "warmup_steps": 1, "tiersep_trace_estimate": estimate}
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    for _ in range(STEPS):
        train_step(call, work.loss_fn, work.optimizer, work.inputs, preset, device)
    return {"steps": STEPS, "warmup_steps": 1, **_device_counters(torch), "tiersep_trace_estimate": estimate}


def run_events(job: dict, preset: dict, folder: Path) -> dict:
    """The allocator's event log of setup and LOG_STEPS steps, after torch.cuda.init() and one 256x256
    GEMM, as the shared logs were recorded; written as events/<name>.events.json.gz."""
    import torch

    from tiersep.memory.measure import measure_step

    if job["dry_run"]:
        events, segments, result = _cpu_events(preset)
    else:
        torch.cuda.init()
        torch.empty(1, device="cuda")
        a = torch.randn(256, 256, device="cuda")
        (a @ a).sum().item()
        del a
        torch.cuda.memory._record_memory_history(context=None, stacks="python")
        measure_step(preset, "cuda", steps=LOG_STEPS)
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        events = [[e["action"], int(e["addr"]), int(e["size"])] for e in snapshot["device_traces"][0]
                  if e["action"] in ("alloc", "free_requested", "free_completed", "segment_alloc", "segment_free")]
        segments = [[int(s["address"]), int(s["total_size"]), "small" if s["segment_type"] == "small" else "large"]
                    for s in snapshot["segments"]]
        result = {**_device_counters(torch), "alloc": torch.cuda.max_memory_allocated(),
                  "reserved": torch.cuda.max_memory_reserved()}
    path = folder / "events" / f"{_slug(job['name'])}.events.json.gz"
    path.parent.mkdir(parents=True, exist_ok=True)
    log = {"config": {"preset": preset["name"], "set": job["set"]}, "events": events, "segments_at_end": segments,
           "result": {"name": _slug(job["name"]), "steps": LOG_STEPS, "alloc_conf": os.environ.get(
               "PYTORCH_CUDA_ALLOC_CONF"), "dry_run": job["dry_run"], **result}}
    path.write_bytes(gzip.compress(json.dumps(log).encode()))
    from tiersep.memory.trace.allocator import load_event_log

    load_event_log(path)    # written as bench/allocator_replay.py and trace_vs_events.py read it
    return {"events_file": str(path.relative_to(folder)), "events": len(events)}


def _cpu_events(preset: dict):
    """Dry run: the CPU step's allocation sequence (StorageTracker on real tensors) in the log's
    format, each allocation at its own made-up address: it exercises the writer, it is no GPU log."""
    from tiersep.memory.trace.tracker import StorageTracker, cpu_block_bytes
    from tiersep.model.step import train_step

    work = _workload(preset, "cpu")
    tracker = StorageTracker(cpu_block_bytes)
    with tracker:
        train_step(work.model, work.loss_fn, work.optimizer, work.inputs, preset, "cpu")
    tracker.stop()
    tl = tracker.timeline
    events = [["alloc" if s > 0 else "free_completed", 4096 * (k + 1), tl.allocations[k].nbytes] for k, s in tl.events]
    return events, [], {"cpu_live_peak_bytes": tl.replay()[0]}


def run_calibrate(job: dict, folder: Path) -> dict:
    out = folder / "calibration.json"
    done = subprocess.run([sys.executable, "-m", "tiersep.cli", "calibrate", "--out", str(out)],
                          capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        why = (done.stderr.strip().splitlines() or ["no output"])[-1]
        if job["dry_run"]:
            return {"skipped": f"dry run: tiersep calibrate needs CUDA (it said: {why})"}
        raise RuntimeError(f"tiersep calibrate exited {done.returncode}: {why}")
    return {"calibration": out.name}


def run_merl(job: dict, folder: Path) -> dict:
    if not job.get("reference"):
        return {"skipped": "no --reference (a checkout of merlresearch/tf-locoformer) given"}
    device = "cpu" if job["dry_run"] else "cuda"
    argv = [sys.executable, str(ROOT / "bench" / "model_step.py"), "--reference", job["reference"],
            "--device", device, "--markdown", "--steps", "1" if job["dry_run"] else "10"]
    if not job["dry_run"]:
        argv.append("--compile")
    done = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT)
    (folder / "merl.md").write_text(done.stdout + (f"\n(exit {done.returncode}: {done.stderr[-2000:]})\n"
                                                   if done.returncode else ""))
    if done.returncode:
        raise RuntimeError(f"bench/model_step.py exited {done.returncode}")
    return {"merl": "merl.md"}


def run_trial(job: dict) -> dict:
    """One co-location trial, in its own process: book its memory (on a GPU), then run its steps."""
    import torch

    from tiersep import gpu_lease
    from tiersep.model.step import train_step

    preset, device = _preset(job), "cpu" if job["dry_run"] else "cuda"
    if job["dry_run"]:
        torch.set_num_threads(1)   # two CPU trials at once: one core each
    booked = job.get("booked")
    if not job["dry_run"]:
        gpu_lease.book_gpu(f"gpu_evidence {job['trial']}", booked, timeout=300)
        torch.cuda.init()
    work = _workload(preset, device)
    steps = 1 if job["dry_run"] else COLOCATE_STEPS
    began = time.time()
    for _ in range(steps):
        train_step(work.model, work.loss_fn, work.optimizer, work.inputs, preset, device)
    if device == "cuda":
        torch.cuda.synchronize()
    out = {"trial": job["trial"], "pid": os.getpid(), "steps": steps, "step_loop_seconds": round(time.time() - began, 3),
           "booked_bytes": booked}
    if device == "cuda":
        out.update(max_memory_allocated=torch.cuda.max_memory_allocated(),
                   max_memory_reserved=torch.cuda.max_memory_reserved())
    return out


def run_colocate(job: dict, folder: Path) -> dict:
    """Two trials in a row, then the same two at once (module docstring); writes colocate.json."""
    from tiersep import gpu_info

    def start(name: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, __file__, "--trial", json.dumps(dict(job, trial=name))],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)

    def watch(procs: dict[str, subprocess.Popen]) -> dict[str, dict]:
        """Wait for the trials, sampling NVML's per-process device use; each one's result."""
        peaks = {name: None for name in procs}
        while any(p.poll() is None for p in procs.values()):
            for seen in gpu_info.processes() or []:
                for name, p in procs.items():
                    if seen["pid"] == p.pid and seen["used_bytes"] is not None:
                        peaks[name] = max(peaks[name] or 0, seen["used_bytes"])
            time.sleep(0.05)
        out = {}
        for name, p in procs.items():
            stdout, stderr = p.communicate()
            if p.returncode:
                raise RuntimeError(f"trial {name} exited {p.returncode}: {(stderr.strip().splitlines() or [''])[-1]}")
            out[name] = {**json.loads(stdout.strip().splitlines()[-1]), "peak_device_bytes_nvml": peaks[name]}
        return out

    # The booking is the search's (the gate's figure), made in a process of its own: a cuda trace
    # may start CUDA, and a trial must book before CUDA starts (gpu_lease refuses it after).
    if not job["dry_run"]:     # a CPU dry run books nothing
        done = subprocess.run([sys.executable, __file__, "--booking", json.dumps(job)], capture_output=True,
                              text=True, cwd=ROOT, check=True)
        job = dict(job, booked=json.loads(done.stdout.strip().splitlines()[-1]))
    report = {"preset": job["preset"], "dry_run": job["dry_run"], "commit": job["commit"], "booked": job.get("booked")}
    began = time.time()
    in_a_row = {}
    for name in ("a", "b"):
        in_a_row.update(watch({name: start(name)}))
    report["in_a_row"] = {"wall_seconds": round(time.time() - began, 3), "trials": in_a_row}
    began = time.time()
    together = watch({name: start(name) for name in ("a", "b")})
    report["co_located"] = {"wall_seconds": round(time.time() - began, 3), "trials": together}
    loops = {how: sum(t["step_loop_seconds"] for t in report[how]["trials"].values()) for how in ("in_a_row", "co_located")}
    report["slowdown_per_trial"] = round(loops["co_located"] / loops["in_a_row"], 3) if loops["in_a_row"] else None
    report["wall_ratio"] = round(report["co_located"]["wall_seconds"] / report["in_a_row"]["wall_seconds"], 3)
    (folder / "colocate.json").write_text(json.dumps(report, indent=1) + "\n")
    return {"colocate": "colocate.json", "wall_ratio": report["wall_ratio"],
            "slowdown_per_trial": report["slowdown_per_trial"]}


def run_job(job: dict, folder: Path) -> dict:
    if job["kind"] == "colocate":
        return run_colocate(job, folder)
    if job["kind"] == "calibrate":
        return run_calibrate(job, folder)
    if job["kind"] == "merl":
        return run_merl(job, folder)
    preset = _preset(job)
    row = {"name": job["name"], "preset": preset["name"], "set": job["set"], "commit": job["commit"],
           "compiled": job["kind"] == "compiled", "dry_run": job["dry_run"],
           "held_out": job["name"].startswith("held-out")}
    if job["dry_run"]:
        row["stands_for"] = job["preset"]     # what the GPU run measures with these settings
    if job["mode"] == "expandable":
        row["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    if job["kind"] == "events":
        return run_events(job, preset, folder)
    row.update(run_compiled(job, preset) if job["kind"] == "compiled" else run_measure(job, preset))
    return {"row": row}


# ------------------------------------------------------------------------------------------------
# the plan, in the parent process
# ------------------------------------------------------------------------------------------------
def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", text.lower()).strip("_")


def _commit(given: str | None) -> str:
    if given:
        return given
    done = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    if done.returncode:
        sys.exit("gpu_evidence: not a git checkout here: pass --commit REV (the commit whose model runs)")
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "src/tiersep/model"], cwd=ROOT).returncode
    if dirty:
        sys.exit("gpu_evidence: src/tiersep/model differs from HEAD: commit it first (the evidence reads "
                 "the measured model from git)")
    return done.stdout.strip()


def _gpu() -> dict:
    import torch

    if not torch.cuda.is_available():
        sys.exit("gpu_evidence: torch sees no CUDA device (--dry-run runs the plan on a CPU)")
    from tiersep import gpu_info

    return {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda,
            "driver": gpu_info.driver_version(), "memory_total_bytes": torch.cuda.get_device_properties(0).total_memory,
            "python": sys.version.split()[0]}


def plan(args) -> list[dict]:
    base = {"commit": args.commit, "dry_run": args.dry_run, "reference": str(args.reference) if args.reference else None}
    return [dict(base, name=n, preset=p, set=s, kind=k, mode=m) for n, p, s, k, m in JOBS]


def run_plan(jobs: list[dict], folder: Path, budget: float) -> list[dict]:
    """Each job in a fresh process, with what is left of the budget; returns the job reports."""
    start, reports = time.time(), []
    for job in jobs:
        left = budget - (time.time() - start)
        report = {k: job[k] for k in ("name", "kind", "mode", "preset", "set")}
        if job["dry_run"] and job["kind"] == "compiled" and not job.get("dry_compile"):
            reports.append(dict(report, status="skipped", why="dry run: inductor's compile is left out "
                                "(--dry-compile includes it)", seconds=0.0))
            continue
        if left <= 1:
            reports.append(dict(report, status="skipped", why=f"the {budget:.0f} s budget was spent", seconds=0.0))
            continue
        env = dict(os.environ)
        env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        if job["mode"] == "expandable":
            env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
        began = time.time()
        try:
            done = subprocess.run([sys.executable, __file__, "--job", json.dumps(job), "--folder", str(folder)],
                                  capture_output=True, text=True, env=env, timeout=left, cwd=ROOT)
        except subprocess.TimeoutExpired:
            reports.append(dict(report, status="timed out", why=f"stopped after {left:.0f} s, the budget left",
                                seconds=round(time.time() - began, 1)))
            continue
        seconds = round(time.time() - began, 1)
        lines = done.stdout.strip().splitlines()
        if done.returncode or not lines:
            why = (done.stderr.strip().splitlines() or ["no output"])[-1][:300]
            reports.append(dict(report, status="failed", why=f"exit {done.returncode}: {why}", seconds=seconds))
            continue
        out = json.loads(lines[-1])
        status = "skipped" if "skipped" in out else "ok"
        reports.append(dict(report, status=status, seconds=seconds, **({"why": out.pop("skipped")} if
                                                                          status == "skipped" else {}), result=out))
    return reports


def write_folder(folder: Path, reports: list[dict], info: dict) -> None:
    rows = [r["result"]["row"] for r in reports if r["status"] == "ok" and "row" in r.get("result", {})]
    (folder / "measurements.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    manifest = {**info, "calibration": "calibration.json" if (folder / "calibration.json").is_file() else None,
                "jobs": [{k: v for k, v in r.items() if k != "result"} for r in reports]}
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")


def summary(reports: list[dict]) -> str:
    lines = ["| job | mode | status | s | allocated vs trace | device use vs trace |", "|---|---|---|---:|---:|---:|"]
    for r in reports:
        row = (r.get("result") or {}).get("row") or {}
        est = row.get("tiersep_trace_estimate") or {}

        def err(measured, predicted):
            return f"{predicted / measured - 1:+.2%}" if measured and predicted else ""
        lines.append(f"| {r['name']} ({r['kind']}) | {r['mode']} | {r['status']}{': ' + r['why'] if r.get('why') else ''} "
                     f"| {r['seconds']} | {err(row.get('max_memory_allocated'), est.get('allocated_peak_bytes'))} "
                     f"| {err(row.get('device_used_bytes'), est.get('peak_bytes'))} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="where the dated folder goes (default tests/data/gpu; a dry "
                                                 "run needs it)")
    parser.add_argument("--reference", type=Path, help="merlresearch/tf-locoformer checkout, for merl.md")
    parser.add_argument("--budget", type=float, default=540.0, help="seconds for the whole plan (default 540)")
    parser.add_argument("--commit", help="the commit whose model runs (default: git rev-parse HEAD)")
    parser.add_argument("--dry-run", action="store_true", help="run the plan on a CPU, tiny presets, no GPU figures")
    parser.add_argument("--dry-compile", action="store_true", help="in a dry run, compile too (slow on a CPU)")
    parser.add_argument("--only", nargs="+", metavar="KIND", help="run only these job kinds "
                        "(events measure compiled calibrate colocate merl)")
    parser.add_argument("--names", metavar="REGEX", help="run only the jobs whose name matches (e.g. "
                        "'fp16|math|calibrate')")
    parser.add_argument("--job", help=argparse.SUPPRESS)
    parser.add_argument("--trial", help=argparse.SUPPRESS)
    parser.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--booking", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.booking:  # the search's booking of a co-location trial: one number on stdout
        from tiersep.memory import GateSettings, gate
        from tiersep.search.packing import booking_bytes

        job = json.loads(args.booking)
        print(booking_bytes(gate(_preset(job), "cpu" if job["dry_run"] else "cuda", None, GateSettings(0.08, "auto"))))
        return 0
    if args.trial:   # a co-location trial: one JSON line on stdout
        print(json.dumps(run_trial(json.loads(args.trial))))
        return 0
    if args.job:     # a child: one job, one JSON line on stdout
        print(json.dumps(run_job(json.loads(args.job), args.folder)))
        return 0
    if args.dry_run and args.out is None:
        parser.error("--dry-run needs --out (a dry run's folder is no evidence: keep it out of tests/data)")
    args.commit = _commit(args.commit) if not args.dry_run else (args.commit or "dry-run")
    info = {"dry_run": True, "commit": args.commit, "gpu": None} if args.dry_run else {"commit": args.commit, **_gpu()}
    name = f"{'cpu-dry-run' if args.dry_run else _slug(info['gpu'].replace('NVIDIA', ''))}-{time.strftime('%Y-%m-%d')}"
    folder = (args.out or ROOT / "tests" / "data" / "gpu") / name
    folder.mkdir(parents=True, exist_ok=True)
    jobs = [dict(j, dry_compile=args.dry_compile) for j in plan(args)
            if (not args.only or j["kind"] in args.only) and (not args.names or re.search(args.names, j["name"]))]
    began = time.time()
    reports = run_plan(jobs, folder, args.budget)
    info.update(date=time.strftime("%Y-%m-%d"), budget_s=args.budget, wall_s=round(time.time() - began, 1))
    write_folder(folder, reports, info)
    print(summary(reports))
    print(f"wrote {folder} in {info['wall_s']} s; then: python -m tiersep.memory.evidence --write")
    return 1 if any(r["status"] in ("failed", "timed out") for r in reports) else 0


if __name__ == "__main__":
    sys.exit(main())
