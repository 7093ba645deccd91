"""Peak-memory estimates of a training step, and the fit gate (see README: Memory estimates).

estimate(preset, method, device, budget_bytes, safety_margin) -> the results/vram JSON record
fit(preset, budget_bytes, device, safety_margin) -> (variant that fits, changes)
gate(preset, device_type, budget_bytes, safety_margin, estimate=None) -> estimate, or DoesNotFit
"""
from .estimate import estimate
from .fit import NothingFits, fit
from .gate import DoesNotFit, gate

__all__ = ["estimate", "fit", "gate", "DoesNotFit", "NothingFits"]
