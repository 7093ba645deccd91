"""`fit()`: derive a variant of a preset whose training step fits a memory budget.

Levers, from the one that changes training least to the one that changes it most:
  1. a fused attention kernel instead of math (same maths, O(L) memory);
  2. a smaller micro-batch with more accumulation (same effective batch batch_size * grad_accum);
  3. per-block gradient checkpointing (same maths, about a third more compute);
  4. bf16 autocast (norms, RoPE, STFT and the residual stream stay fp32);
  5. a shorter training segment (changes what the model sees: last resort).
The search keeps the longest segment, then the fewest levers, then the largest micro-batch, using
the instant `analytic` form scaled by trace/analytic of the original preset, and verifies the choice
with `trace` (stepping further down if the trace disagrees). It writes nothing; the CLI does.
"""
from __future__ import annotations

import copy

from . import analytic, calibration
from .constants import GIB
from .cuda_model import modelled_backend
from .estimate import estimate, required_bytes, with_booking


class NothingFits(ValueError):
    """No variant of the preset fits the budget."""


def _divisors_desc(n: int, at_most: int) -> list[int]:
    return [d for d in range(min(n, at_most), 0, -1) if n % d == 0]


def _variant(preset: dict, segment: int, micro: int, effective: int, ckpt: bool, bf16: bool,
             backend: str) -> dict:
    v = copy.deepcopy(preset)
    v["audio"]["segment_samples"] = segment
    v["train"]["batch_size"] = micro
    v["train"]["grad_accum"] = effective // micro
    v["model"]["checkpointing"] = ckpt
    v["train"]["precision"] = "bf16" if bf16 else v["train"]["precision"]
    v["model"]["attention_backend"] = backend
    return v


def describe_changes(old: dict, new: dict) -> list[str]:
    """One line per changed field, in the order a reader wants them."""
    changes = []
    o, n = old["model"]["attention_backend"], new["model"]["attention_backend"]
    if o != n:
        changes.append(f"model.attention_backend: {o} -> {n} (fused kernel, O(L) memory, same maths)")
    ob, nb = old["train"]["batch_size"], new["train"]["batch_size"]
    if ob != nb:
        changes.append(f"train.batch_size: {ob} -> {nb} and train.grad_accum: {old['train']['grad_accum']} -> "
                       f"{new['train']['grad_accum']} (effective batch {ob * old['train']['grad_accum']} kept)")
    if old["model"]["checkpointing"] != new["model"]["checkpointing"]:
        changes.append("model.checkpointing: false -> true (per-block recomputation, ~1/3 more compute)")
    if old["train"]["precision"] != new["train"]["precision"]:
        changes.append(f"train.precision: {old['train']['precision']} -> {new['train']['precision']} (autocast)")
    os_, ns = old["audio"]["segment_samples"], new["audio"]["segment_samples"]
    if os_ != ns:
        rate = old["audio"]["sample_rate"]
        changes.append(f"audio.segment_samples: {os_} -> {ns} ({os_ / rate:.2f} s -> {ns / rate:.2f} s)")
    return changes


def fit(preset: dict, budget_bytes: int, device: str = "cuda", safety_margin: float = 0.08,
        calibration_spec: str = "auto") -> tuple[dict, list[str]]:
    """A variant of `preset` whose estimated peak plus the safety margin is within `budget_bytes`.
    Long because the search's steps are closures over one state (the trace-to-analytic ratio, the
    levers allowed, the tightened limit) that the trace check updates between rounds."""
    if budget_bytes is None or budget_bytes <= 0:
        raise ValueError("fit: a positive budget in bytes is needed")
    limit = budget_bytes * (1.0 - safety_margin)
    cal = calibration.resolve(calibration_spec) if device == "cuda" else None
    original = estimate(preset, "trace", device, budget_bytes, safety_margin, calibration_spec)
    if original["fits"]:
        return copy.deepcopy(preset), []

    numels = analytic.parameter_numels(preset)
    # Scale the closed form to this preset's trace so the search is centred on the trace.
    ratio = original["peak_bytes"] / analytic.predict(preset, device, numels=numels, device_cal=cal)["peak"]
    a, t, m = preset["audio"], preset["train"], preset["model"]
    effective = t["batch_size"] * t["grad_accum"]
    backend = m["attention_backend"]
    if modelled_backend(preset, device) == "math":
        backend = "auto"   # fused kernels where the device has one
    bf16_options = [False] if t["precision"] == "bf16" else [False, True]
    ckpt_options = [True] if m["checkpointing"] else [False, True]

    def analytic_peak(v: dict) -> float:
        """What the gate would book for `v` (on CPU the process around the live bytes), from the
        closed form scaled to the trace."""
        peak = ratio * analytic.predict(v, device, numels=numels, device_cal=cal)["peak"]
        return required_bytes(with_booking({"device": device, "peak_bytes": int(peak)}, v))

    def best_at(segment: int, limit_now: float) -> dict | None:
        """Fewest levers, then the largest micro-batch, that fit at this segment length."""
        for bf16 in bf16_options:
            for ckpt in ckpt_options:
                for micro in _divisors_desc(effective, t["batch_size"]):
                    v = _variant(preset, segment, micro, effective, ckpt, bf16, backend)
                    if analytic_peak(v) <= limit_now:
                        return v
        return None

    def longest_segment(limit_now: float) -> int | None:
        """Largest segment (a multiple of hop, >= n_fft) at which the most frugal variant fits."""
        hop, lo = a["hop"], -(-a["n_fft"] // a["hop"])
        hi = a["segment_samples"] // hop
        frugal = lambda frames: _variant(preset, frames * hop, 1, effective, True, True, backend)
        if analytic_peak(frugal(lo)) > limit_now:
            return None
        while lo < hi:   # the analytic peak grows with the segment
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if analytic_peak(frugal(mid)) <= limit_now else (lo, mid - 1)
        return lo * hop

    limit_now = limit
    for _ in range(4):   # verify with trace; tighten the analytic limit if the trace disagrees
        choice = best_at(a["segment_samples"], limit_now)
        if choice is None:
            segment = longest_segment(limit_now)
            choice = best_at(segment, limit_now) if segment is not None else None
        if choice is None:
            break
        checked = estimate(choice, "trace", device, budget_bytes, safety_margin, calibration_spec)
        if checked["fits"]:
            fitted = copy.deepcopy(choice)
            gib = budget_bytes / GIB
            fitted["name"] = f"{preset['name']}_fit_{gib:g}gib".replace(f"{gib:g}", f"{gib:g}".replace(".", "p"))
            changes = describe_changes(preset, fitted)
            fitted["description"] = (f"{preset['name']} fitted to {gib:g} GiB ({device}): "
                                     f"{'; '.join(changes)}. Trace estimate {checked['peak_bytes'] / GIB:.2f} GiB.")
            return fitted, changes
        limit_now *= limit / checked["gate_required_bytes"] * 0.98
    raise NothingFits(
        f"preset {preset['name']}: nothing fits {budget_bytes / GIB:.2f} GiB on {device} with a "
        f"{safety_margin:.0%} margin, not even micro-batch 1 with checkpointing, bf16, a fused attention "
        f"kernel and the shortest segment ({a['n_fft']} samples); the original needs "
        f"{original['peak_bytes'] / GIB:.2f} GiB. Reduce model.n_layers / model.emb_dim, or use a larger GPU."
    )
