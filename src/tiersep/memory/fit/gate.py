"""The fit gate: refuse a training run whose estimated peak (plus margin) exceeds the budget.

The trainer calls `gate()` before it allocates anything on the device. The budget is what the
trainer hands in: on CUDA the configured budget_gib capped by the GPU's free memory; on CPU the
machine's available RAM (psutil). What it books is the estimate's `gate_required_bytes`
(estimate.required_bytes): on CUDA the predicted device use times (1 + the uncertainty of the
estimate's class, memory/accuracy.py), on CPU the predicted RSS of the whole train process
(memory/cpu_booking.py); then the safety margin of the budget on top.
"""
from __future__ import annotations

from tiersep.config import DoesNotFit

from ..constants import GIB
from ..estimate import estimate as make_estimate
from ..estimate import finish
from .settings import GateSettings


def gate(preset: dict, device_type: str, budget_bytes: int | None, settings: GateSettings,
         estimate: dict | None = None, compiled: bool | None = None) -> dict:
    """Return the estimate used; raise DoesNotFit when it does not fit the budget. `compiled`:
    estimate the compiled (True) or eager (False) step; None: as the preset will run."""
    safety_margin = settings.safety_margin
    device_type = "cuda" if device_type == "cuda" else "cpu"
    if estimate is not None and estimate.get("ranks", 1) != preset["train"].get("ranks", 1):
        estimate = None    # made for another number of ranks: a rank's figures differ (memory/trace/ranks.py)
    if estimate is None:
        estimate = make_estimate(preset, "trace", device_type, budget_bytes, safety_margin,
                                 settings.calibration_spec, compiled=compiled)
    else:
        estimate = finish(dict(estimate), budget_bytes, safety_margin, estimate.get("seconds", 0.0))
    if budget_bytes is None or estimate["fits"]:
        return estimate
    needed, margin = estimate["gate_required_bytes"], estimate["margin_bytes"]
    cpu = estimate.get("cpu_process") if device_type == "cpu" else None
    if cpu:
        what = (f"estimated peak {needed / GIB:.2f} GiB ({estimate['method']}, {device_type}, "
                f"{estimate['peak_bytes'] / GIB:.2f} GiB live tensors booked as {cpu['model']}, ")
    else:
        what = (f"estimated peak {estimate['peak_bytes'] / GIB:.2f} GiB ({estimate['method']}, {device_type}, "
                + (f"+{estimate['uncertainty']:.1%} uncertainty of its class: booked {needed / GIB:.2f} GiB, "
                   if needed != estimate["peak_bytes"] else ""))
    dp = estimate.get("data_parallel")
    if dp:   # a rank's figures: each rank on its own GPU (cuda), the ranks of a node share its RAM (cpu)
        what = (f"{estimate['ranks']} data-parallel ranks, each on its own GPU: " if device_type == "cuda" else
                f"{estimate['ranks']} data-parallel ranks, {dp['ranks_per_node']} on this machine together: ") \
            + what.replace("estimated peak", "estimated peak per rank" if device_type == "cuda" else "estimated peak")
    what += (f"{estimate.get('attention_backend')} attention) + {safety_margin:.0%} margin "
             f"({margin / GIB:.2f} GiB) exceeds the budget of {budget_bytes / GIB:.2f} GiB")
    suggestion = fitted = None
    try:
        from .search import fit

        fitted, suggestion = fit(preset, budget_bytes, device_type, settings)
        hint = (f"nearest change that fits: {'; '.join(suggestion)} (`tiersep fit --preset "
                f"{preset['name']} --budget {budget_bytes / GIB:.1f}` writes it)")
    except Exception as err:   # nothing fits, or the search failed: say so, still refuse
        hint = f"no variant fits ({str(err).splitlines()[0]})"
    raise DoesNotFit(f"preset {preset['name']}: {what}; {hint}", estimate, budget_bytes, suggestion,
                     fitted if suggestion else None)
