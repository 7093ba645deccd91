"""What a CPU training process occupies beyond the live tensors the trace counts.

On a CPU the estimate's peak_bytes is the peak of live tensor bytes; the fit gate books the whole
`tiersep train` process's peak RSS, predicted here (`booking`): a process allowance (torch and
tiersep imports, the gate's in-process trace, library pages touched at exit) plus the live bytes
times a factor that covers validation, export and what malloc holds beyond the live tensors.
Measurements: bench/cpu_rss.py -> bench/results/cpu_rss.md.

Also here:
- `configure_malloc()`: the glibc settings the booking assumes: a fixed 64 KiB mmap threshold, so
  freed tensor buffers go back to the kernel instead of leaving holes in a heap that only shrinks
  from the top. Without it a checkpointed step's RSS grew 1.8-2x its live bytes instead of ~1.1x.
  It costs page faults: 1.1-1.7x the CPU time of a run on the bench machine. The trainer calls it
  at start-up (or only when `malloc_settings_needed`) and records what it returns in run.json.
- `measure_peak_rss()`: a command's peak RSS from outside, through a small launcher process. A
  child's ru_maxrss starts at its parent's high-water mark (Linux carries it across fork and
  exec), so a train process started directly from pytest, or from a bench that has traced, reads
  as the parent's peak whenever that is higher.
- `own_peak_rss_bytes()`: this process's peak RSS since exec (VmHWM), free of that inheritance.
"""
from __future__ import annotations

import ctypes
import ctypes.util
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
# The train process's peak RSS = PROCESS_BYTES + LIVE_FACTOR x the step's live tensor bytes, with
# configure_malloc() applied (bench/results/cpu_rss.md: 1.06-1.18x the real peak over 7 presets and
# 3 test presets). PROCESS_BYTES: what a `tiersep train` process holds whatever the preset, at its
# peak: torch 2.11 + tiersep imports (640 MiB, half of it shared-library pages), the gate's
# in-process trace (~140 MiB, none with a usable estimate file), ~120-170 MiB of library pages
# touched at interpreter exit, the model, loader and validation segments of a small preset; the
# smallest presets peak at 950-1010 MiB (the spread between runs). LIVE_FACTOR: over the RSS after
# the gate's trace (~790 MiB) the three large presets peaked 1.03-1.07x their live bytes higher
# (validation, export, accumulation and checkpointing included), booked at 1.10. Another torch
# build (a CPU-only wheel maps far fewer library pages) is booked conservatively.
PROCESS_BYTES = 1010 * MIB
LIVE_FACTOR = 1.10
# Without configure_malloc() glibc's heap fragments by 1.0-1.9x the live bytes, depending on the
# shape (checkpointing and bf16 worst): no factor is tight, this one bounds every measured preset.
GLIBC_DEFAULT_FACTOR = 2.5
MALLOC_ASSUMED = f"glibc mmap threshold {MMAP_THRESHOLD // KIB} KiB (cpu_process.configure_malloc)"


def booking(record: dict, preset: dict) -> dict:
    """The predicted peak RSS of a `tiersep train` process for this CPU estimate, with its parts.
    rss_bytes assumes configure_malloc(); rss_bytes_glibc_default bounds a run without it. `preset`
    is not needed by this model (validation, export, precision and checkpointing fall inside the
    measured factor); it stays in the signature for models that need it."""
    live = int(record["peak_bytes"])
    return {"rss_bytes": int(PROCESS_BYTES + LIVE_FACTOR * live), "live_bytes": live,
            "process_bytes": PROCESS_BYTES, "live_factor": LIVE_FACTOR, "malloc": MALLOC_ASSUMED,
            "rss_bytes_glibc_default": int(PROCESS_BYTES + GLIBC_DEFAULT_FACTOR * live),
            "model": f"{PROCESS_BYTES // MIB} MiB process + {LIVE_FACTOR} x live tensor bytes"}


def malloc_settings_needed(booked: dict, budget_bytes: int | None, safety_margin: float) -> bool:
    """Whether a run needs configure_malloc() to stay within its budget: False only when even the
    bound without it (rss_bytes_glibc_default) fits, so glibc's faster buffer reuse can be kept."""
    if budget_bytes is None:
        return True
    return booked["rss_bytes_glibc_default"] + safety_margin * budget_bytes > budget_bytes


def live_budget(budget_bytes: int, safety_margin: float) -> int:
    """The live-tensor budget that books to `budget_bytes` (what `fit` searches against on CPU): a
    live peak L fits it with the margin, L <= (1 - margin) x live_budget, exactly when its booking
    fits the budget, booking(L) <= (1 - margin) x budget_bytes. Negative when the process alone
    does not fit."""
    keep = 1.0 - safety_margin
    return int((budget_bytes * keep - PROCESS_BYTES) / LIVE_FACTOR / keep)
