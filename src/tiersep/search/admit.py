"""Admission: every trial's preset estimated by the trainer's own fit gate before any process starts.

The verdict is one of
- fits: the preset runs as it is;
- repaired (on_oversize: repair): the nearest variant that keeps the maths runs instead, found by
  the fit search the gate itself runs (tiersep.memory.fit): a fused attention kernel, per-block
  checkpointing, a smaller micro-batch with more accumulation (same effective batch), and a shorter
  segment only with search.repair_segment. A variant that needs bf16 (other numerics) or a shorter
  segment the config does not allow is not a repair;
- infeasible: nothing is started. `violation_gib` (booking + margin - budget, > 0) goes to
  trial.set_constraint, `reason` (one line) to a user attribute.

On a CPU the booking is the predicted RSS of the whole train process (memory.cpu_booking), on a GPU
the predicted device use x (1 + its class's uncertainty); the gate adds the safety margin.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

from tiersep import config as C
from tiersep.memory import DoesNotFit, GateSettings, gate

GIB = 2**30
# Levers that keep the maths; fit's other ones change numerics (bf16) or the data (segment).
KEEPS_MATHS = ("model.attention_backend", "train.batch_size", "model.checkpointing")


@dataclass
class Admission:
    verdict: str                    # fits, repaired or infeasible
    preset: dict | None             # what the trial trains (None: infeasible)
    estimate: dict                  # the gate's record of what trains (or of the sampled preset)
    budget_bytes: int
    levers: list[str] = field(default_factory=list)   # repaired: one line per lever pulled
    reason: str | None = None       # infeasible: why, on one line

    @property
    def booking_bytes(self) -> int:
        """What the gate books: the predicted peak with its class's uncertainty (CPU: the process)."""
        return int(self.estimate["gate_required_bytes"])

    @property
    def violation_gib(self) -> float:
        """Booking + margin - budget in GiB: > 0 exactly when it does not fit."""
        over = self.booking_bytes + int(self.estimate.get("margin_bytes") or 0) - self.budget_bytes
        return over / GIB


def estimate_device(preset: dict) -> str:
    """The device the trial's trainer will use: train.device, auto meaning cuda when NVML sees a
    GPU (no CUDA context is opened here)."""
    wanted = preset["train"]["device"]
    if wanted != "auto":
        return "cuda" if wanted == "cuda" else "cpu"
    from tiersep import gpu_info

    return "cuda" if gpu_info.name() is not None else "cpu"


def budget_bytes(search: dict, cfg: dict, device: str, source: str) -> int:
    """search.budget_gib in bytes; auto: the config's budget_gib on a GPU, the available RAM on a CPU."""
    if search["budget_gib"] != "auto":
        return max(1, int(float(search["budget_gib"]) * GIB))
    if device == "cpu":
        import psutil

        return int(psutil.virtual_memory().available)
    configured = C.budget_bytes(cfg)
    if configured is None:
        raise C.ConfigError(f"{source}: search.budget_gib: auto on a GPU takes the config's budget_gib, "
                            "which is auto too; give a number of GiB")
    return configured


def _forbidden(levers: list[str], repair_segment: bool) -> list[str]:
    allowed = KEEPS_MATHS + (("audio.segment_samples",) if repair_segment else ())
    return [lever for lever in levers if not lever.startswith(allowed)]


class Admitter:
    """Admits trials against one budget; estimates are kept by preset, so a configuration the
    sampler proposes again is not traced again."""

    def __init__(self, cfg: dict, search: dict, device: str, budget: int):
        self.cfg, self.device, self.budget = cfg, device, budget
        self.settings = GateSettings.from_config(cfg)
        self.repair = search["on_oversize"] == "repair"
        self.repair_segment = search["repair_segment"]
        self._seen: dict[str, Admission] = {}

    def admit(self, preset: dict) -> Admission:
        key = C.preset_hash({k: v for k, v in preset.items() if k not in ("name", "description")})
        if key not in self._seen:
            self._seen[key] = self._admit(preset)
        seen = self._seen[key]
        out = copy.deepcopy(seen)
        if out.preset is not None:
            out.preset["name"] = preset["name"]
        return out

    def _admit(self, preset: dict) -> Admission:
        try:
            record = gate(preset, self.device, self.budget, self.settings)
            return Admission("fits", preset, record, self.budget)
        except DoesNotFit as refused:
            sampled = Admission("infeasible", None, refused.estimate, self.budget)
            over = (f"booked {sampled.booking_bytes / GIB:.2f} GiB + {self.settings.safety_margin:.0%} margin "
                    f"exceeds the budget of {self.budget / GIB:.2f} GiB")
            if not self.repair:
                sampled.reason = f"does not fit: {over} (on_oversize: skip)"
                return sampled
            if not refused.fitted:
                sampled.reason = f"does not fit: {over}; no variant that fits was found"
                return sampled
            levers = list(refused.suggestion or [])
            forbidden = _forbidden(levers, self.repair_segment)
            if forbidden:
                sampled.reason = (f"does not fit: {over}; the nearest variant that fits changes the maths: "
                                  f"{'; '.join(forbidden)}")
                return sampled
            return self._repaired(preset, refused.fitted, levers, sampled, over)

    def _repaired(self, preset: dict, fitted: dict, levers: list[str], sampled: Admission, over: str) -> Admission:
        variant = copy.deepcopy(fitted)
        variant["name"], variant["description"] = preset["name"], f"{preset['name']} repaired: {'; '.join(levers)}"
        try:   # gated again, as the trainer's on_oversize: adapt does
            record = gate(variant, self.device, self.budget, self.settings)
        except DoesNotFit as err:
            sampled.reason = f"does not fit: {over}; its repair does not fit either ({C.escape_line_breaks(str(err))[:200]})"
            return sampled
        return Admission("repaired", variant, record, self.budget, levers=levers)
