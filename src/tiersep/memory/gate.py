"""The fit gate: refuse a training run whose estimated peak (plus margin) exceeds the budget.

The trainer calls `gate()` before it allocates anything on the device. The budget is what the
trainer hands in: on CUDA the configured budget_gib capped by the GPU's free memory; on CPU the
machine's available RAM (psutil). On CPU the estimate is the peak of live tensor bytes, and the
process needs more than that (malloc keeps freed blocks, autograd and thread pools have their own
state): measured RSS growth was 1.06-1.17x the live bytes plus up to ~400 MiB
(bench/results/estimator_accuracy_cpu.md), so the CPU gate books CPU_RSS_FACTOR x peak + CPU_BASE_BYTES.
"""
from __future__ import annotations

from .estimate import estimate as make_estimate
from .estimate import finish

GIB = 2**30
CPU_RSS_FACTOR = 1.35
CPU_BASE_BYTES = 256 * 2**20


class DoesNotFit(Exception):
    """The estimated peak plus the safety margin exceeds the budget; the message says what fits."""

    def __init__(self, message: str, estimate: dict | None = None, budget_bytes: int | None = None,
                 suggestion: list[str] | None = None, fitted: dict | None = None):
        super().__init__(message)
        self.estimate, self.budget_bytes, self.suggestion = estimate, budget_bytes, suggestion
        self.fitted = fitted  # the variant that fits (what on_oversize: adapt trains), if any


def required_bytes(record: dict, device_type: str) -> int:
    """What the gate books for an estimate on this device (see module docstring)."""
    if device_type == "cpu":
        return int(record["peak_bytes"] * CPU_RSS_FACTOR + CPU_BASE_BYTES)
    return int(record["peak_bytes"])


def gate(preset: dict, device_type: str, budget_bytes: int | None, safety_margin: float,
         estimate: dict | None = None) -> dict:
    """Return the estimate used; raise DoesNotFit when it does not fit the budget."""
    device_type = "cuda" if device_type == "cuda" else "cpu"
    if estimate is None:
        estimate = make_estimate(preset, "trace", device_type, budget_bytes, safety_margin)
    else:
        estimate = finish(dict(estimate), budget_bytes, safety_margin, estimate.get("seconds", 0.0))
    if budget_bytes is None:
        return estimate
    needed = required_bytes(estimate, device_type)
    margin = int(safety_margin * budget_bytes)
    estimate["gate_required_bytes"] = needed
    estimate["fits"] = needed + margin <= budget_bytes
    if estimate["fits"]:
        return estimate
    what = (f"estimated peak {needed / GIB:.2f} GiB ({estimate['method']}, {device_type}"
            + (f", {estimate['peak_bytes'] / GIB:.2f} GiB live tensors x {CPU_RSS_FACTOR} + "
               f"{CPU_BASE_BYTES / GIB:.2f} GiB process" if device_type == "cpu" else "")
            + f", {estimate.get('attention_backend')} attention) + {safety_margin:.0%} margin "
            f"({margin / GIB:.2f} GiB) exceeds the budget of {budget_bytes / GIB:.2f} GiB")
    suggestion = fitted = None
    # fit works in estimate units: on CPU, take off what the gate adds for the process
    fit_budget = budget_bytes if device_type == "cuda" else int(
        (budget_bytes * (1 - safety_margin) - CPU_BASE_BYTES) / CPU_RSS_FACTOR / (1 - safety_margin))
    if fit_budget <= 0:
        hint = (f"no variant fits (the {CPU_BASE_BYTES / GIB:.2f} GiB process allowance alone is over "
                "the budget)")
    else:
        try:
            from .fit import fit

            fitted, suggestion = fit(preset, fit_budget, device_type, safety_margin)
            hint = (f"nearest change that fits: {'; '.join(suggestion)} (`tiersep fit --preset "
                    f"{preset['name']} --budget {budget_bytes / GIB:.1f}` writes it)")
        except Exception as err:   # nothing fits, or the search failed: say so, still refuse
            hint = f"no variant fits ({str(err).splitlines()[0]})"
    raise DoesNotFit(f"preset {preset['name']}: {what}; {hint}", estimate, budget_bytes, suggestion,
                     fitted if suggestion else None)
