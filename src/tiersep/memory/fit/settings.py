"""The gate settings: the two choices every budget decision is made with, read once from the config
and passed whole to the gate, the fit search and the fit matrix (instead of two loose parameters
through each of their signatures)."""
from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class GateSettings:
    safety_margin: float    # estimate.safety_margin: the fraction of the budget kept free
    calibration_spec: str   # estimate.calibration or --calibration: auto, a built-in GPU name or a file

    @classmethod
    def from_config(cls, cfg: dict, calibration: str | None = None) -> GateSettings:
        """The config's estimate settings; `calibration` (--calibration), when given, over its own."""
        return cls(cfg["estimate"]["safety_margin"], calibration or cfg["estimate"]["calibration"])

    def calibrated(self, calibration_spec: str) -> GateSettings:
        """The same margin with another calibration (a GPU of the fit matrix is estimated with its own)."""
        return replace(self, calibration_spec=calibration_spec)
