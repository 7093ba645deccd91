"""The uncertainty of an estimate's class, and the gate booking it (memory/accuracy.py, estimate.py,
gate.py). The evidence itself is checked against the GPU data in test_memory_cuda_accuracy.py."""
from __future__ import annotations

import copy

import pytest

from tiersep import config as C
from tiersep.memory import DoesNotFit, GateSettings, accuracy, estimate, gate

GIB = 2**30
MARGIN = 0.08


@pytest.fixture(scope="module")
def record():
    """A CUDA trace record of a class with GPU evidence (fused attention, expandable, eager)."""
    return estimate(C.load_preset("cpu_tiny"), "trace", "cuda", calibration_spec="NVIDIA H100 80GB HBM3")


def test_a_cuda_record_states_its_class_and_the_evidence(record):
    cls = record["uncertainty_class"]
    assert cls == {"attention": "fused", "checkpointing": False, "allocator": "expandable", "step": "eager"}
    assert record["uncertainty"] == accuracy.uncertainty(cls)[0] >= accuracy.TARGET
    assert "GPU measurements of this class" in record["uncertainty_evidence"]
    assert record["gate_required_bytes"] == round(record["peak_bytes"] * (1 + record["uncertainty"]))


def test_the_gate_refuses_what_only_the_uncertainty_pushes_over(record):
    """A record of uncertainty u is refused at a budget between peak x (1 + margin) and
    peak x (1 + u) x (1 + margin): one where its peak alone, plus the margin, would fit."""
    peak, u = record["peak_bytes"], record["uncertainty"]
    low, high = peak / (1 - MARGIN), min(peak * (1 + u) / (1 - MARGIN), peak * (1 + u) * (1 + MARGIN))
    assert peak * (1 + MARGIN) < low < high, "no budget in the range separates the two bookings"
    budget = int((low + high) / 2)
    exact = dict(copy.deepcopy(record), uncertainty=0.0)
    assert gate(C.load_preset("cpu_tiny"), "cuda", budget, GateSettings(MARGIN, "auto"), estimate=exact)["fits"] is True
    with pytest.raises(DoesNotFit) as refused:
        gate(C.load_preset("cpu_tiny"), "cuda", budget, GateSettings(MARGIN, "auto"), estimate=record)
    message = str(refused.value)
    assert f"+{u:.1%} uncertainty of its class" in message and f"estimated peak {peak / GIB:.2f} GiB" in message


def test_a_class_without_evidence_is_booked_conservatively_and_says_so():
    preset = C.set_field(C.load_preset("cpu_tiny"), "model.attention_backend", "math")   # math, expandable
    preset = C.set_field(preset, "model.checkpointing", True)        # math checkpointed: never measured
    math = estimate(preset, "trace", "cuda", calibration_spec="NVIDIA H100 80GB HBM3")
    assert math["uncertainty_class"]["attention"] == "math" and math["uncertainty_class"]["checkpointing"]
    assert not accuracy.has_evidence(math["uncertainty_class"])
    assert math["uncertainty"] == accuracy.NO_EVIDENCE_UNCERTAINTY
    assert "no GPU measurement of this class" in math["uncertainty_evidence"] and "conservatively" in math["uncertainty_evidence"]
    assert math["gate_required_bytes"] == round(math["peak_bytes"] * (1 + accuracy.NO_EVIDENCE_UNCERTAINTY))


@pytest.mark.parametrize("errors, booked", [([0.0001, -0.004], 0.015), ([0.02412, -0.0008], 0.015),
                                            ([-0.0231], 0.024), ([0.057, -0.0301], 0.031), ([], 0.015)])
def test_a_class_books_the_target_or_its_worst_under_estimate_rounded_up(errors, booked):
    """An over-estimate (0.02412, 0.057) is booked by the estimate itself: it adds nothing."""
    assert accuracy.uncertainty_of_errors(errors) == pytest.approx(booked)


def test_the_cpu_booking_is_unchanged():
    """On CPU the gate books the process RSS (memory.cpu_booking), not peak x (1 + u)."""
    cpu = estimate(C.load_preset("cpu_tiny"), "trace", "cpu", budget_bytes=64 * GIB)
    assert "uncertainty_class" not in cpu
    assert cpu["gate_required_bytes"] == cpu["cpu_process"]["rss_bytes"]


def test_the_report_shows_the_uncertainty_with_its_class(record):
    from tiersep.report.collect import Tier
    from tiersep.report.sections.estimates import _uncertainty

    u = record["uncertainty"] * 100
    assert _uncertainty(Tier("cpu_tiny", "tier", estimate=record)) == f"±{u:.1f} % (fused, expandable, eager)"
    unknown = dict(record, uncertainty=0.1, uncertainty_class=dict(record["uncertainty_class"], step="compiled"),
                   uncertainty_evidence="no GPU measurement of this class (...): booked conservatively at 10%")
    assert _uncertainty(Tier("x", "tier", estimate=unknown)) == "±10.0 % (fused, expandable, compiled; no evidence)"
    assert _uncertainty(Tier("cpu", "tier", estimate={"uncertainty": 0.03})) == "±3.0 %"      # cpu: no class
