"""What a CPU training process occupies beyond the live tensors the trace counts.

On a CPU the estimate's peak_bytes is the peak of live tensor bytes; the fit gate books the whole
`tiersep train` process's peak RSS, predicted here (`booking`): a process allowance measured on
this machine (`process_allowance`: what the train imports hold, library pages touched at exit
included, plus the run's fixed part: the gate's in-process trace, model, loader) plus the live bytes
times a factor that covers validation, export and what malloc holds beyond the live tensors. The
factor depends on the malloc mode: glibc as it comes (fast, looser) or tuned (`configure_malloc`,
tight, slow); `choose_malloc` picks glibc's own whenever its booking fits the budget.
Measurements: bench/cpu_rss.py -> bench/results/cpu_rss.md.

Also here:
- `configure_malloc()`: the tuned mode: a fixed 64 KiB mmap threshold, so freed tensor buffers go
  back to the kernel instead of leaving holes in a heap that only shrinks from the top. Without it
  a checkpointed step's RSS grew 1.8-2x its live bytes instead of ~1.1x. It costs page faults on
  every tensor: cpu_small trained at 0.33 instead of 1.31 steps/s. The trainer calls it only when
  the estimate chose the tuned mode, before the model exists, and records the mode in run.json.
- `measure_peak_rss()`: a command's peak RSS from outside, through a small launcher process. A
  child's ru_maxrss starts at its parent's high-water mark (Linux carries it across fork and
  exec), so a train process started directly from pytest, or from a bench that has traced, reads
  as the parent's peak whenever that is higher.
- `own_peak_rss_bytes()`: this process's peak RSS since exec (VmHWM), free of that inheritance.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

MIB = 2**20
KIB = 2**10

# glibc: buffers of at least MMAP_THRESHOLD bytes are mmap'ed and unmapped on free. Setting it
# explicitly also turns off glibc's dynamic threshold (which otherwise climbs to 32 MiB after the
# first large free and then serves every tensor below that from a heap that never shrinks).
MMAP_THRESHOLD = 64 * KIB
TRIM_THRESHOLD = 128 * KIB     # glibc's own default, pinned so the dynamic rule cannot raise it
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3   # mallopt parameter numbers (malloc.h)


def malloc_env() -> dict[str, str]:
    """The environment variables that give a new process the settings configure_malloc() applies."""
    return {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD), "MALLOC_TRIM_THRESHOLD_": str(TRIM_THRESHOLD)}


def configure_malloc() -> dict:
    """Apply the malloc settings the booking assumes to this process (glibc only); returns what was
    set, for run.json. Later allocations follow them, so calling it before the model exists is enough."""
    if not sys.platform.startswith("linux"):
        return {"allocator": sys.platform, "applied": False, "reason": "not Linux glibc"}
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return {"allocator": "unknown libc", "applied": False, "reason": "no mallopt in the C library"}
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    return {"allocator": "glibc", "applied": bool(ok), "mmap_threshold": MMAP_THRESHOLD,
            "trim_threshold": TRIM_THRESHOLD, **({} if ok else {"reason": "mallopt refused"})}


# ---------------------------------------------------------------------------------------------
# Measuring
# ---------------------------------------------------------------------------------------------
def own_peak_rss_bytes() -> int:
    """This process's peak resident set since exec (VmHWM; see train.telemetry.peak_rss_bytes)."""
    from tiersep.train.telemetry import peak_rss_bytes

    return peak_rss_bytes()


# Run in a fresh, small interpreter: start the command, wait for it, write its rusage.
_LAUNCHER = """
import json, os, subprocess, sys
proc = subprocess.Popen(sys.argv[2:])
_, status, usage = os.wait4(proc.pid, 0)
with open(sys.argv[1], "w") as f:
    json.dump({"returncode": os.waitstatus_to_exitcode(status), "maxrss_kib": usage.ru_maxrss,
               "user_s": usage.ru_utime, "system_s": usage.ru_stime}, f)
"""


def measure_peak_rss(cmd: list[str], env: dict | None = None, cwd=None, log=None,
                     timeout: float | None = None) -> dict:
    """Run `cmd` and return {returncode, peak_rss_bytes, user_s, system_s}: its whole-life peak RSS
    (exit included) from os.wait4. `log`: a file object for its stdout and stderr."""
    with tempfile.TemporaryDirectory(prefix="tiersep-rss-") as tmp:
        result = Path(tmp) / "rusage.json"
        launcher = subprocess.Popen([sys.executable, "-I", "-S", "-c", _LAUNCHER, str(result), *cmd],
                                    env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT if log else None,
                                    start_new_session=True)
        try:
            launcher.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(launcher.pid, signal.SIGKILL)   # the launcher's own session: it and the command
            launcher.wait()
            raise
        if launcher.returncode != 0 or not result.is_file():
            raise RuntimeError(f"measure_peak_rss: the launcher failed ({launcher.returncode}) for {cmd[:3]}")
        usage = json.loads(result.read_text())
    return {"returncode": usage["returncode"], "peak_rss_bytes": int(usage["maxrss_kib"]) * KIB,
            "user_s": usage["user_s"], "system_s": usage["system_s"]}


# ---------------------------------------------------------------------------------------------
# The booking
# ---------------------------------------------------------------------------------------------
# The train process's peak RSS = the process allowance + a factor x the step's live tensor bytes:
# LIVE_FACTOR with configure_malloc() applied, GLIBC_DEFAULT_FACTOR(_CHECKPOINTED) without.
# The allowance is measured on the machine, not a constant: a fresh interpreter that imports what
# `tiersep train` imports peaks (at exit) at 612-670 MiB on one machine alone, depending on how the
# page cache holds torch's shared libraries (large folios map more pages per fault). A tiny
# preset's train process peaked at 784 and 837 MiB there, moving with the import-only peak to the
# MiB, and at 1049-1072 MiB on the CI machine, where a constant 1010 MiB under-booked it.
# RUN_BYTES: what a train process adds to that whatever the preset: the gate's in-process trace
# (~140 MiB), the model, loader and validation segments of a small preset; tiny presets (live
# 10-90 MiB) peaked 166-172 MiB above the import-only peak, booked at 220.
# LIVE_FACTOR (tuned): the large presets peaked 1.03-1.07x their live bytes above the rest
# (validation, export, accumulation and checkpointing included), booked at 1.10.
# FALLBACK_PROCESS_BYTES: the allowance when the measurement cannot run (the bench machine's).
RUN_BYTES = 220 * MIB
LIVE_FACTOR = 1.10
FALLBACK_PROCESS_BYTES = 1010 * MIB
# With glibc's malloc as it comes (the dynamic mmap threshold climbs to the size of the first large
# free, then most tensors live in a heap that only shrinks from the top) the peak grew 0.3-1.3x the
# live bytes above the allowance, and 1.5-1.6x with checkpointing (its recomputation frees and
# reallocates in a different order): booked at 1.40 and 2.0 (bench/results/cpu_rss.md, 7 presets).
# That mode is 2-4x faster than the tuned one (cpu_small: 1.31 vs 0.33 steps/s on 2 busy cores): it
# is the default whenever its booking fits; the tuned settings are for a tight budget.
GLIBC_DEFAULT_FACTOR = 1.40
GLIBC_DEFAULT_FACTOR_CHECKPOINTED = 2.0
MODES = {"glibc_default": "glibc's malloc as it comes",
         "tuned": f"glibc mmap threshold {MMAP_THRESHOLD // KIB} KiB (cpu_process.configure_malloc)"}
# What `tiersep train` imports before it builds anything (cli.cmd_train -> train.trainer).
TRAIN_IMPORTS = "import tiersep.cli, tiersep.train.trainer"


# Appended to the probe: its peak RSS before exit, so the pages touched at exit are known.
_PRINT_HWM = "\nfrom tiersep.train.telemetry import peak_rss_bytes\nprint(peak_rss_bytes())"


@functools.cache
def process_allowance() -> dict:
    """What a `tiersep train` process on this machine holds whatever the preset: the measured peak
    RSS of a fresh interpreter doing the train imports (exit included, ~2 s, once per process) plus
    RUN_BYTES; and exit_pages_bytes, what that probe touched only at exit (library pages of C++
    destructors: not in a run's own peak_rss_bytes, read before exit). Falls back to
    FALLBACK_PROCESS_BYTES, saying why, when the measurement fails."""
    try:
        with tempfile.TemporaryFile("w+") as out:
            measured = measure_peak_rss([sys.executable, "-c", TRAIN_IMPORTS + _PRINT_HWM], log=out,
                                        timeout=120)
            out.seek(0)
            printed = out.read().split()
        if measured["returncode"] != 0:
            raise RuntimeError(f"the import probe exited {measured['returncode']}")
    except (OSError, RuntimeError, subprocess.TimeoutExpired) as err:
        return {"process_bytes": FALLBACK_PROCESS_BYTES, "imports_peak_bytes": None, "exit_pages_bytes": 0,
                "source": f"fallback ({err})"}
    imports = measured["peak_rss_bytes"]
    before_exit = int(printed[-1]) if printed and printed[-1].isdigit() else imports
    return {"process_bytes": imports + RUN_BYTES, "imports_peak_bytes": imports,
            "exit_pages_bytes": max(0, imports - before_exit),
            "source": f"measured: train imports peak at {imports // MIB} MiB here + {RUN_BYTES // MIB} MiB run"}


def booking(record: dict, preset: dict) -> dict:
    """The predicted peak RSS of a `tiersep train` process for this CPU estimate, in each malloc
    mode (`glibc_default`, `tuned`: rss_bytes, its whole life's peak, what the gate books;
    run_rss_bytes, its peak before exit, what run.json's peak_rss_bytes measures), with the mode a
    run without a budget uses (glibc_default) copied to the top level; `choose_malloc` picks
    again for a budget."""
    live = int(record["peak_bytes"])
    allowance = process_allowance()
    process, exit_pages = allowance["process_bytes"], allowance["exit_pages_bytes"]
    default = GLIBC_DEFAULT_FACTOR_CHECKPOINTED if preset["model"]["checkpointing"] else GLIBC_DEFAULT_FACTOR
    booked = {"live_bytes": live, "process_bytes": process, "process_source": allowance["source"],
              "exit_pages_bytes": exit_pages, "malloc_setting": preset["train"]["host_malloc"]}
    for mode, factor in (("glibc_default", default), ("tuned", LIVE_FACTOR)):
        rss = int(process + factor * live)
        booked[mode] = {"rss_bytes": rss, "run_rss_bytes": rss - exit_pages, "live_factor": factor,
                        "model": f"{process // MIB} MiB process + {factor} x live tensor bytes, {MODES[mode]}"}
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
