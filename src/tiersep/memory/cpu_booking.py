"""What a CPU training process occupies beyond the live tensors the trace counts (the CPU booking).

On a CPU the estimate's peak_bytes is the peak of live tensor bytes; the fit gate books the whole
`tiersep train` process's peak RSS, predicted here (`booking`): a process allowance measured on
this machine (`process_allowance`: the peak RSS, exit included, of a probe process doing what every
train process does whatever its preset: imports, the gate's trace, steps of the smallest model;
plus the loader and bookkeeping) plus the live bytes
times a factor that covers validation, export and what malloc holds beyond the live tensors. The
factor depends on the malloc mode: glibc as it comes (fast, looser) or tuned
(tiersep.malloc.configure_malloc: tight, slow); `choose_malloc` picks glibc's own whenever its
booking fits the budget. Measurements: bench/cpu_rss.py -> bench/results/cpu_rss.md.
The probe's peak is measured from outside (tiersep.probe.measure_peak_rss).
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tiersep.malloc import MMAP_THRESHOLD
from tiersep.probe import measure_peak_rss
from tiersep.resources import command_module

MIB = 2**20
KIB = 2**10


def trims_heap(preset: dict, mode: str | None) -> bool:
    """Whether a CPU train process of `preset` in malloc `mode` trims its heap around each
    checkpointed block (trimmed_heap): with glibc's own malloc and checkpointing."""
    return mode == "glibc_default" and bool(preset["model"]["checkpointing"])


# ---------------------------------------------------------------------------------------------
# The booking
# ---------------------------------------------------------------------------------------------
# The train process's peak RSS = the larger of its run (the process allowance less its exit pages
# + a factor x the step's live tensor bytes) and its exit (the allowance): LIVE_FACTOR with
# configure_malloc() applied, GLIBC_DEFAULT_FACTOR without (checkpointed or not: trimmed_heap).
# The allowance is measured on the machine, not a constant: a probe process does what every
# `tiersep train` process does whatever its preset (the train imports, the gate's trace, two AdamW
# steps of the smallest model, a validation forward, a checkpoint's serialisation) and its peak RSS,
# exit included, is taken. What torch's shared libraries occupy depends on the machine and on how
# the page cache holds them (large folios map more pages per fault): the import-only peak was
# 612-670 MiB on one machine and ~870 MiB on the CI machine, and the part a run adds to it moved
# too (166-172 MiB here, 235-300 MiB there). A tiny preset's train process peaked within 2 MiB
# of the probe here (802 vs 800 MiB).
# RUN_BYTES: what a real run adds to the probe whatever the preset: the dataset and loader, the
# logs and bookkeeping.
# LIVE_FACTOR (tuned): the large presets peaked 1.03-1.07x their live bytes above the rest
# (validation, export, accumulation and checkpointing included), booked at 1.10.
# The exit pages (what the probe touches only at exit: C++ destructors' library pages, ~117 MiB)
# count once, in the floor, in both modes: the tensors' pages are gone before them (tuned: unmapped;
# glibc's own: the trainer gives the heap's free pages back before exit, release_heap). All 24
# random presets of seed 21 peaked before exit unless their live bytes were under the exit pages
# (r21_18, r21_20: 13-21 MiB more on exit). Booked on top of the live bytes they over-booked small
# tuned presets by the same 117 MiB (1.18-1.23x); with glibc's own heap kept through exit, 9 of 12
# presets of seed 22 peaked on exit, 50-120 MiB above their run (r22_08: 1417 vs 1298 MiB; with the
# release 1251, its run's).
# FALLBACK_PROCESS_BYTES: the allowance when the measurement cannot run: the largest tiny train
# process seen (1126 MiB, on the CI machine) + RUN_BYTES.
RUN_BYTES = 48 * MIB
LIVE_FACTOR = 1.10
FALLBACK_PROCESS_BYTES = 1174 * MIB
# With glibc's malloc as it comes (the dynamic mmap threshold climbs to the size of the first large
# free, then most tensors live in a heap that only shrinks from the top) the presets of 400 MiB live
# or more grew 1.06-1.33x their live bytes above the allowance less its exit pages (fp32: seed 21,
# 14 presets, 1.08-1.33; seed 22, 1.10-1.30; the fixed ones 1.06-1.21, bench/results/cpu_rss*.md),
# and bf16 autocast (cpu_small_bf16_b4) 1.36-1.46 in four runs: booked at 1.50. The spread at one
# size is what bounds the factor: at 1.45 cpu_small_bf16_b4 was booked at 0.997x one run's peak,
# at 1.55 r21_24 (1.15) at 1.265x.
# Gradient accumulation has no term of its own: train_step drops each micro-batch's
# autograd graph right after its backward. Kept alive through the next forward (issue 21), its small
# C++ nodes fenced the heap holes the freed activations left, posix_memalign(64) asks 96 bytes more
# than an exact hole, and each later micro-batch's heap-served activations extended the heap: a
# preset grew 1.7x and was booked at 0.89-0.96x its peak. What stays is the first micro-batch's
# gradients (made during its backward, kept through the others): +0.1x live over the same micro-batch
# without accumulation. Small objects living across big frees are what glibc's heap grows by: two train
# processes' malloc logs (this preset; a checkpointed one) replayed through glibc peaked at 1.7x
# their live bytes, and at 1.1-1.2x without their allocations under 4-32 KiB.
# Checkpointing has no factor of its own: the trainer trims the heap around each checkpointed block
# (trimmed_heap). Without the trim each block's recomputation grew the heap again, by more the more
# blocks (one preset, 1-4 layers: 1.09, 1.21, 1.43, 1.50x live above the allowance; r21_10: 1.51x
# with 1 layer, 1.80 with 2, 1.96-2.10 with 4), so no one factor fitted: 2.0 booked r21_17 at
# 1.258x its peak and a 4-layer r21_10 under it. With the trim the checkpointed presets of 400 MiB
# live or more grew 1.06-1.30x above the allowance less its exit pages (r21_10 with 4 layers:
# 1.17-1.20x above the allowance): the range without checkpointing, so one factor books both.
# That mode is 2-4x faster than the tuned one (cpu_small: 1.31 vs 0.33 steps/s on 2 busy cores): it
# is the default whenever its booking fits; the tuned settings are for a tight budget.
GLIBC_DEFAULT_FACTOR = 1.50
MODES = {"glibc_default": "glibc's malloc as it comes",
         "tuned": f"glibc mmap threshold {MMAP_THRESHOLD // KIB} KiB (tiersep.malloc.configure_malloc)"}


def train_imports() -> str:
    """Python that imports what a `tiersep train` process imports before it builds anything: the
    `tiersep` command's module (resources.command_module) and the trainer it loads (its
    load_trainer()). Where tiersep is not installed there is no command to import, and the probe
    imports torch alone."""
    try:
        module = command_module()
    except RuntimeError:
        return "import torch"
    return f"import {module}; {module}.load_trainer()"


# What `tiersep train` imports before it builds anything (its command module -> the trainer).
TRAIN_IMPORTS = train_imports()
# The probe's model: the smallest real TF-Locoformer (1 layer x 8 channels, 0.25 s at 8 kHz).
PROBE_PRESET = {
    "name": "process_allowance_probe",
    "audio": {"sample_rate": 8000, "channels": 2, "segment_samples": 2000, "n_fft": 128, "hop": 64},
    "model": {"n_layers": 1, "emb_dim": 8, "attention_dim": 8, "n_heads": 2, "ffn_hidden": 16,
              "norm_groups": 2, "dropout": 0.0},
    "train": {"device": "cpu", "batch_size": 2, "precision": "fp32", "num_workers": 0},
}
PROBE_STEPS = 2


def probe_train_process() -> None:
    """Run in the probe process (after TRAIN_IMPORTS): the preset-independent work of a train
    process on PROBE_PRESET, then print its peak RSS before exit and the steps it took, as JSON."""
    import io

    import torch

    from tiersep import config
    from tiersep.memory.trace import build_workload, trace_step
    from tiersep.model.step import train_step
    from tiersep.probe import peak_rss_bytes

    preset = config.validate(json.loads(json.dumps(PROBE_PRESET)), "preset.schema.yaml", "probe")
    trace_step(preset, "cpu")                            # the gate's trace
    work = build_workload(preset, "cpu", torch.randn)
    losses = [float(train_step(work.model, work.loss_fn, work.optimizer, work.inputs, preset, "cpu")[0])
              for _ in range(PROBE_STEPS)]
    work.model.eval()
    with torch.no_grad():                                 # validation
        work.model(work.inputs[0][0])
    torch.save({"model": work.model.state_dict(), "optimizer": work.optimizer.state_dict()}, io.BytesIO())
    print(json.dumps({"peak_before_exit_bytes": peak_rss_bytes(), "losses": losses}))


_PROBE = "\nfrom tiersep.memory.cpu_booking import probe_train_process\nprobe_train_process()"


def measure_process_allowance() -> dict:
    """What a `tiersep train` process on this machine holds whatever the preset: the measured peak
    RSS (exit included) of a fresh probe process doing a train process's preset-independent work
    (`probe_train_process`, ~6 s) plus RUN_BYTES; and exit_pages_bytes, what the probe touched
    only at exit (library pages of C++ destructors: not in a run's own peak_rss_bytes, read before
    exit). Falls back to FALLBACK_PROCESS_BYTES, saying why, when the measurement fails."""
    try:
        with tempfile.TemporaryFile("w+") as out:
            measured = measure_peak_rss([sys.executable, "-c", TRAIN_IMPORTS + _PROBE], log=out, timeout=300)
            out.seek(0)
            printed = out.read().strip().splitlines()
        if measured["returncode"] != 0:
            raise RuntimeError(f"the probe exited {measured['returncode']}: {' '.join(printed[-3:])[-300:]}")
        report = json.loads(printed[-1])
    except (OSError, RuntimeError, ValueError, IndexError, subprocess.TimeoutExpired) as err:
        return {"process_bytes": FALLBACK_PROCESS_BYTES, "probe_peak_bytes": None, "exit_pages_bytes": 0,
                "source": f"fallback ({err})"}
    probe = measured["peak_rss_bytes"]
    return {"process_bytes": probe + RUN_BYTES, "probe_peak_bytes": probe,
            "exit_pages_bytes": max(0, probe - int(report["peak_before_exit_bytes"])),
            "source": f"measured: a probe train process (imports, trace, {PROBE_STEPS} steps) peaks at "
                      f"{probe // MIB} MiB here + {RUN_BYTES // MIB} MiB run"}


def allowance_cache_file() -> Path | None:
    """Where this boot's measurement for this interpreter and this probe is kept, or None when
    there is no boot id (not Linux). The key changes with a reboot (the page cache starts again),
    with the interpreter or venv, with the installed torch and with this module (the probe)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None
    torch_spec = importlib.util.find_spec("torch")
    torch_init = Path(torch_spec.origin) if torch_spec and torch_spec.origin else None
    parts = [boot, os.path.realpath(sys.executable), sys.prefix, Path(__file__).read_text(),
             f"{torch_init}:{torch_init.stat().st_mtime_ns}" if torch_init else "no torch"]
    key = hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "tiersep" / f"process-allowance-{key}.json"


# How long a kept measurement is trusted. The page cache moves the probe's RSS within one boot:
# the same venv's probe peaked at 955 MiB at 04:51 and 786 MiB at 06:45 on 2026-11-25, and a
# fresh install's (new files in large folios) at 1091 MiB. An old figure can book too little or
# too much, so it is measured again when older than this; ~6 s, once per run's first minutes.
ALLOWANCE_MAX_AGE_S = 15 * 60


@functools.cache
def process_allowance() -> dict:
    """measure_process_allowance(), measured once per boot, interpreter and torch and kept for
    ALLOWANCE_MAX_AGE_S: every estimate and train process of a run reads the first one's figure
    (allowance_cache_file) instead of spending ~6 s on its own probe. A fallback is never kept."""
    cache = allowance_cache_file()
    if cache is not None and cache.is_file():
        try:
            if time.time() - cache.stat().st_mtime < ALLOWANCE_MAX_AGE_S:
                return {**json.loads(cache.read_text()), "cache_file": str(cache)}
        except (OSError, ValueError):
            pass                                         # unreadable: measure again
    allowance = measure_process_allowance()
    if cache is not None and allowance["probe_peak_bytes"] is not None:
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            partial = cache.with_name(f"{cache.name}.{os.getpid()}.tmp")
            partial.write_text(json.dumps(allowance))
            partial.replace(cache)                       # atomic: parallel jobs may race to write
        except OSError:
            pass                                         # a read-only home: measure in every process
    return allowance


def booking(record: dict, preset: dict, allowance: dict | None = None) -> dict:
    """The predicted peak RSS of a `tiersep train` process for this CPU estimate, in each malloc
    mode (`glibc_default`, `tuned`: rss_bytes, its whole life's peak, what the gate books;
    run_rss_bytes, its peak before exit, what run.json's peak_rss_bytes measures), with the mode a
    run without a budget uses (glibc_default) copied to the top level; `choose_malloc` picks
    again for a budget. `allowance`: a measured process_allowance() to use (default: this machine's)."""
    live = int(record["peak_bytes"])
    allowance = allowance or process_allowance()
    process, exit_pages = allowance["process_bytes"], allowance["exit_pages_bytes"]
    source = allowance["source"] + (f"; kept in {allowance['cache_file']}" if "cache_file" in allowance else "")
    booked = {"live_bytes": live, "process_bytes": process, "process_source": source,
              "exit_pages_bytes": exit_pages, "malloc_setting": preset["train"]["host_malloc"]}
    for mode, factor in (("glibc_default", GLIBC_DEFAULT_FACTOR), ("tuned", LIVE_FACTOR)):
        # the heap is given back before exit (trainer.train: release_heap; tuned: the tensors are
        # unmapped): the exit pages take its room, so they count once, in the floor
        run_rss = int(process - exit_pages + factor * live)
        model = (f"{(process - exit_pages) // MIB} MiB process before exit + {factor} x live tensor bytes, "
                 f"at least its {process // MIB} MiB on exit, {MODES[mode]}")
        if trims_heap(preset, mode):
            model += ", its heap trimmed around each checkpointed block"
        booked[mode] = {"rss_bytes": max(run_rss, process), "run_rss_bytes": run_rss, "live_factor": factor,
                        "model": model}
    return choose_malloc(booked, None, 0.0)


def choose_malloc(booked: dict, budget_bytes: int | None, safety_margin: float) -> dict:
    """The booking with the malloc mode the run will use: train.host_malloc when it names one; for
    auto glibc's own (fast) when its booking fits the budget with the margin, or there is no budget,
    else the tuned settings (tight). The chosen mode's figures are copied to the top level,
    `malloc` names it. A booking from before the modes is returned as it is."""
    if "glibc_default" not in booked:
        return booked
    default = booked["glibc_default"]["rss_bytes"]
    mode = booked.get("malloc_setting", "auto")
    if mode == "auto":
        fits = budget_bytes is None or default + safety_margin * budget_bytes <= budget_bytes
        mode = "glibc_default" if fits else "tuned"
    return {**booked, **booked[mode], "malloc": mode}
