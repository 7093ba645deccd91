"""One trial's `tiersep train` process, seen from the orchestrator: start it, read its validation
SI-SDR as metrics.csv grows, stop it through the trainer's preemption channel, read its records.

A trial runs exactly like a tier: `python -m tiersep.cli train --preset <trial preset YAML> --out
<run folder> --estimate <the admission's record> [--resume]`, in its own session. Pruning sends it
SIGUSR1, the cluster-preemption signal (train/signals.py): the trainer writes checkpoints/last.pt
at the next step boundary and exits 75. The child also gets SIGUSR1 when the orchestrator dies
(prctl PR_SET_PDEATHSIG), so a SIGKILLed search leaves checkpoints, not orphans, and the rerun
resumes them.
On a GPU the orchestrator has booked the trial's memory (packing.py): the process gets the
booking's descriptors (so the booking lives exactly as long as it does) and that GPU alone, with
TIERSEP_GPU_LEASE_HELD telling its own lease that the booking covers it.
"""
from __future__ import annotations

import csv
import ctypes
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tiersep.resources import command_module

EXIT_OK, EXIT_REFUSED, EXIT_OOM, EXIT_PREEMPTED = 0, 3, 4, 75   # tiersep train's (train/trainer.py)
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:   # runs in the child between fork and exec
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGUSR1)
    except (OSError, AttributeError):   # not Linux: a killed search leaves the trial running
        pass


def start(config_file: str, preset_file: Path, data: Path, run_dir: Path, estimate_file: Path,
          log_file: Path, resume: bool, booking=None) -> subprocess.Popen:
    """Start the trial's `tiersep train`; `booking` (a gpu_lease.Booking) is handed over to it."""
    cmd = [sys.executable, "-m", command_module(), "train", "--config", config_file, "--preset", str(preset_file),
           "--data", str(data), "--out", str(run_dir), "--estimate", str(estimate_file)]
    if resume:
        cmd.append("--resume")
    env, fds = None, ()
    if booking is not None:
        from tiersep import gpu_lease

        env = {**os.environ, gpu_lease.VISIBLE_ENV: booking.gpu.entry, gpu_lease.HELD_ENV: booking.gpu.entry}
        fds = booking.fds
    log = open(log_file, "a")
    try:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                   pass_fds=fds, start_new_session=True, preexec_fn=_die_with_parent)
    except BaseException:
        if booking is not None:
            booking.release()
        raise
    finally:
        log.close()
    if booking is not None:   # the child holds the booking's locks now; this process lets go of its copies
        booking.hand_to(process.pid, f"tiersep train of search trial {run_dir.name}")
        booking.release()
    return process


def validations(run_dir: Path) -> list[tuple[int, float]]:
    """(step, validation SI-SDR) of every validated step in metrics.csv so far (a torn last line of
    a file being written is skipped)."""
    path = run_dir / "metrics.csv"
    if not path.is_file():
        return []
    out = []
    with open(path, newline="", errors="replace") as f:
        try:
            for row in csv.DictReader(f):
                step, value = (row.get("step") or ""), (row.get("val_si_sdr") or "")
                if not step.isdigit() or not value:
                    continue
                try:
                    score = float(value)
                except ValueError:
                    continue
                if math.isfinite(score):
                    out.append((int(step), score))
        except csv.Error:
            pass
    return out


def last_step(run_dir: Path) -> int:
    """The last step metrics.csv logged (0 when none)."""
    path = run_dir / "metrics.csv"
    if not path.is_file():
        return 0
    steps = [0]
    with open(path, newline="", errors="replace") as f:
        try:
            steps += [int(r["step"]) for r in csv.DictReader(f) if (r.get("step") or "").isdigit()]
        except csv.Error:
            pass
    return max(steps)


def run_record(run_dir: Path) -> dict | None:
    """run.json of a finished run (written once, at the end, atomically), or None."""
    path = run_dir / "run.json"
    try:
        return json.loads(path.read_text()) if path.is_file() else None
    except (OSError, ValueError):
        return None


def measured_peak(run_dir: Path) -> int | None:
    """The run's measured peak: run.json's (device use on a GPU, RSS on a CPU) when it finished,
    else the largest of memory.csv (a pruned or stopped run)."""
    record = run_record(run_dir)
    if record:
        return record.get("peak_device_bytes") or record.get("peak_rss_bytes")
    path = run_dir / "memory.csv"
    if not path.is_file():
        return None
    peak = 0
    with open(path, newline="", errors="replace") as f:
        try:
            for row in csv.DictReader(f):
                for key in ("device", "peak"):
                    value = row.get(key) or ""
                    if value.isdigit():
                        peak = max(peak, int(value))
        except csv.Error:
            pass
    return peak or None


def last_log_line(log_file: Path) -> str:
    try:
        lines = [ln.strip() for ln in log_file.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return lines[-1][:300] if lines else ""


def process_started(pid: int) -> float | None:
    """The start time of process `pid` (to tell it from a later process given the same pid)."""
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def wait_gone(pid: int, started: float | None, timeout: float = 120.0) -> bool:
    """Wait for a trial process left by a dead orchestrator to end; SIGUSR1 it first (it checkpoints
    and exits 75). True when it is gone."""
    if started is None or process_started(pid) != started:
        return True
    try:
        os.kill(pid, signal.SIGUSR1)
    except ProcessLookupError:
        return True
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process_started(pid) != started:
            return True
        time.sleep(0.2)
    return False
