"""Packing trials onto GPUs by their predicted memory (docs/search.md#packing).

On a GPU every admitted trial books bytes on one GPU before its process starts (tiersep.gpu_lease
bookings): several trials share a GPU when their bookings fit its free memory together, a trial
whose booking fits no GPU waits (first come, first placed), and a GPU whose memory is not back to
its baseline after a trial ended takes no booking until it is (the waiting line names the
process that still holds memory). The trial's process inherits the booking's locks, so the
booking ends exactly when that process ends.

A trial's booking is the gate's booking (predicted device use x (1 + its class's uncertainty))
plus its share of the safety margin: gate_required / (1 - safety_margin). A trial alone on a GPU
then books exactly what the fit gate checks (required + margin x GPU <= GPU), and trials that
share it keep the same fraction of the GPU free together.
"""
from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass, field

from tiersep import gpu_lease

GIB = 2**30


def booking_bytes(estimate: dict) -> int:
    """What a trial books on a GPU (module docstring) from the gate's record of what it trains."""
    margin = float(estimate.get("safety_margin") or 0.0)
    return int(math.ceil(int(estimate["gate_required_bytes"]) / (1.0 - margin)))


@dataclass
class Waiting:
    trial: object                     # optuna.trial.Trial
    admission: object                 # search.admit.Admission
    resume: bool
    bytes: int
    since: float = field(default_factory=time.monotonic)
    said: str | None = None           # the last reason given (figures aside), so a new one is said once


class Placer:
    """Places the search's trials on the visible GPUs by their bookings; FIFO among the waiting."""

    def __init__(self, gpus: list[gpu_lease.Gpu], say):
        self.gpus, self.say = gpus, say
        self.waiting: list[Waiting] = []

    def reset_baselines(self) -> None:
        """Each GPU's memory in use now becomes its baseline (kept when trials hold bookings on it)."""
        for gpu in self.gpus:
            base = gpu_lease.reset_baseline(gpu)
            if base is None:
                self.say(f"{gpu.label()}: NVML cannot read its memory; trials cannot be booked on it")
                continue
            held = ", ".join(f"pid {p['pid']} ({p.get('name') or '?'})" for p in base.get("processes") or [])
            self.say(f"{gpu.label()}: baseline {base['used_bytes'] / GIB:.2f} GiB used"
                     + (f" by {held}" if held else "") + f", {(base['total_bytes'] - base['used_bytes']) / GIB:.2f}"
                     " GiB free to book")

    def queue(self, trial, admission, resume: bool) -> None:
        self.waiting.append(Waiting(trial, admission, resume, booking_bytes(admission.estimate)))

    def place(self, idle: bool) -> list[tuple[Waiting, gpu_lease.Booking]]:
        """Book the waiting trials in order until one does not fit; `idle`: none of this search's
        trials is running, so a trial that waits past the lease timeout ends the search (exit 6;
        a rerun resumes it) instead of waiting forever."""
        placed = []
        while self.waiting:
            head = self.waiting[0]
            got = gpu_lease.try_book(f"search trial {head.trial.number}", head.bytes, self.gpus)
            if isinstance(got, gpu_lease.Booking):
                got.waited_seconds = time.monotonic() - head.since
                placed.append((self.waiting.pop(0), got))
                continue
            gist = re.sub(r"\d+(\.\d+)?", "#", got)   # memory draining after a trial is one reason, not many
            if gist != head.said:
                self.say(f"trial {head.trial.number}: waiting to book {head.bytes / GIB:.2f} GiB: {got}")
                head.said = gist
            limit = gpu_lease.timeout_seconds()
            if idle and not placed and time.monotonic() - head.since > limit:
                raise gpu_lease.NoFreeGpu(f"trial {head.trial.number} found no GPU for its {head.bytes / GIB:.2f} GiB "
                                          f"within {limit:g} s: {got} ({gpu_lease.TIMEOUT_ENV} sets the wait; "
                                          "the same command resumes the study)")
            break
        return placed
