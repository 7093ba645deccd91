"""fit() and the fit gate."""
from __future__ import annotations

import pytest

from tiersep import config as C
from tiersep.memory import DoesNotFit, GateSettings, NothingFits, estimate, fit, gate

GIB = 2**30
SETTINGS = GateSettings(0.08, "auto")   # the config's defaults


def test_gate_refuses_with_estimate_budget_and_nearest_fit():
    preset = C.load_preset("small")          # ~6.7 GiB on CUDA as is
    with pytest.raises(DoesNotFit) as caught:
        gate(preset, "cuda", 4 * GIB, SETTINGS)
    message = str(caught.value)
    peak = caught.value.estimate["peak_bytes"] / GIB
    assert f"estimated peak {peak:.2f} GiB" in message
    assert "budget of 4.00 GiB" in message
    assert "nearest change that fits: model.checkpointing: false -> true" in message
    assert "tiersep fit --preset small --budget 4.0" in message
    assert caught.value.suggestion


def test_gate_passes_and_returns_the_estimate():
    preset = C.load_preset("cpu_tiny")
    record = gate(preset, "cuda", 24 * GIB, SETTINGS)
    assert record["fits"] is True and record["budget_bytes"] == 24 * GIB
    assert gate(preset, "cuda", None, SETTINGS)["fits"] is None


def test_gate_uses_a_given_estimate_against_the_current_budget():
    preset = C.load_preset("cpu_tiny")
    record = estimate(preset, device="cpu", budget_bytes=64 * GIB)
    assert record["fits"] is True
    # the same record against a budget too small even for the CPU process allowance: refused,
    # without a search that could help (nothing fits)
    with pytest.raises(DoesNotFit, match=r"live tensors booked as .* budget of 0.20 GiB; no variant fits"):
        gate(preset, "cpu", int(0.2 * GIB), SETTINGS, estimate=record)


def pinned_small() -> dict:
    """The cpu_small tier's audio with the sizes pinned here (micro-batch 4, fp32)."""
    preset = C.load_preset("cpu_small")
    for key, value in {"train.batch_size": 4, "train.grad_accum": 1, "train.precision": "fp32",
                       "model.checkpointing": False, "model.n_layers": 2, "model.emb_dim": 24,
                       "model.attention_dim": 24, "model.n_heads": 2, "model.norm_groups": 4}.items():
        preset = C.set_field(preset, key, value)
    return preset


def test_fit_keeps_the_effective_batch_and_fits():
    preset = pinned_small()
    peak = estimate(preset, device="cuda")["peak_bytes"]
    budget = int(0.9 * peak)                 # too small for micro-batch 4 as it is
    assert estimate(preset, device="cuda", budget_bytes=budget)["fits"] is False
    fitted, changes = fit(preset, budget, "cuda", SETTINGS)
    t = fitted["train"]
    assert t["batch_size"] * t["grad_accum"] == 4
    assert t["batch_size"] < 4 and any(c.startswith("train.batch_size: 4 ->") for c in changes)
    assert fitted["audio"]["segment_samples"] == preset["audio"]["segment_samples"]
    assert fitted["name"].startswith("cpu_small_fit_") and fitted["name"].endswith("gib")
    C.validate(C.deep_merge({}, fitted), "preset.schema.yaml", "fitted")   # still a valid preset
    checked = estimate(fitted, device="cuda", budget_bytes=budget, safety_margin=0.08)
    assert checked["fits"] is True
    assert checked["peak_bytes"] + checked["margin_bytes"] <= budget


def test_fit_of_a_preset_that_fits_changes_nothing():
    preset = C.load_preset("cpu_tiny")
    fitted, changes = fit(preset, 24 * GIB, "cuda", SETTINGS)
    assert changes == [] and fitted == preset


def test_fit_says_when_nothing_fits():
    with pytest.raises(NothingFits, match="nothing fits 0.55 GiB on cuda"):
        fit(pinned_small(), int(0.55 * GIB), "cuda", SETTINGS)   # the CUDA context alone is 0.5
