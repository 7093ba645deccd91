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
    """A CUDA trace record of a class with GPU evidence (efficient attention, fp32, expandable, eager,
    Hopper: the H100 calibration names the card)."""
    return estimate(C.load_preset("cpu_tiny"), "trace", "cuda", calibration_spec="NVIDIA H100 80GB HBM3")


def test_a_cuda_record_states_its_class_and_the_evidence(record):
    cls = record["uncertainty_class"]
    assert cls == {"attention": "efficient", "dtype": "fp32", "checkpointing": False, "allocator": "expandable",
                   "step": "eager", "generation": "Hopper"}
    assert record["gpu"]["name"] == "h100"
    assert record["uncertainty"] == accuracy.uncertainty(cls)[0] >= accuracy.TARGET
    assert "GPU measurement of this class" in record["uncertainty_evidence"]
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
    preset = C.set_field(preset, "model.checkpointing", True)
    preset = C.set_field(preset, "train.precision", "fp16")          # math fp16 checkpointed
    # Hopper has measured it since the H200's fourth run of 2026-11-27 (+0.02% device use); no Ampere card has
    hopper = estimate(preset, "trace", "cuda", calibration_spec="NVIDIA H100 80GB HBM3")
    assert accuracy.has_evidence(hopper["uncertainty_class"]) and hopper["uncertainty"] == accuracy.TARGET
    math = estimate(preset, "trace", "cuda", gpu="a100-80gb")
    assert math["uncertainty_class"] == dict(hopper["uncertainty_class"], generation="Ampere")
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
    assert _uncertainty(Tier("cpu_tiny", "tier", estimate=record)) == f"±{u:.1f} % (efficient, fp32, expandable, eager, Hopper)"
    unknown = dict(record, uncertainty=0.1, uncertainty_class=dict(record["uncertainty_class"], step="compiled"),
                   uncertainty_evidence="no GPU measurement of this class (...): booked conservatively at 10%")
    assert _uncertainty(Tier("x", "tier", estimate=unknown)) == \
        "±10.0 % (efficient, fp32, expandable, compiled, Hopper; no evidence)"
    fitted = dict(unknown, uncertainty_evidence=(
                  "no out-of-sample GPU measurement of this class (...): booked conservatively at 10%"))
    assert _uncertainty(Tier("y", "tier", estimate=fitted)) == \
        "±10.0 % (efficient, fp32, expandable, compiled, Hopper; none out of sample)"
    assert _uncertainty(Tier("cpu", "tier", estimate={"uncertainty": 0.03})) == "±3.0 %"      # cpu: no class


def _row(name, folder, reserved, device, preset="small", set_=None):
    return {"name": name, "folder": folder, "source": "m.jsonl", "preset": preset, "set": set_ or {},
            "expandable_segments": False, "compiled": False, "max_memory_allocated": reserved,
            "max_memory_reserved": reserved, "device_used_bytes": device}


def _record(reserved, context, **cls):
    return {"reserved_peak_bytes": reserved, "allocated_peak_bytes": reserved, "peak_bytes": reserved + context,
            "attention_backend": cls.get("attention", "flash"), "checkpointing": cls.get("checkpointing", False),
            "allocator": {"expandable_segments": False}, "compiled": False}


def test_out_of_sample_refits_the_context_without_the_row_and_keeps_rule_rows_in_sample():
    """Issue 34: a figure fitted on rows is refitted without the row it is judged on. The context
    fitted as the largest outside-reserved use (here 300, seen only in row c) is 200 for c left out,
    so c's out-of-sample error is below its in-sample one; a configuration the workspace rules were
    read off has no out-of-sample error at all; a folder whose context was measured apart (calibrate)
    keeps its error."""
    from tiersep.memory import evidence

    fitted = next(iter(evidence.CONTEXT_FITTED_ON))
    rows = [_row("a", fitted, 1000, 1200), _row("b", fitted, 2000, 2200), _row("c", fitted, 3000, 3300),
            _row("logged", fitted, 1000, 1200, set_={"model.checkpointing": True}),
            _row("apart", "h200-x", 1000, 1300)]
    records = {evidence.row_id(r): _record(r["max_memory_reserved"], 300) for r in rows}
    oos = evidence.out_of_sample(rows, records, rules_from=[("small", '{"model.checkpointing": true}')])
    assert oos[evidence.row_id(rows[0])][0] == pytest.approx(1300 / 1200 - 1, abs=1e-5)     # still meets 300 in c
    assert oos[evidence.row_id(rows[2])][0] == pytest.approx(3200 / 3300 - 1, abs=1e-5)     # c left out: 200
    assert oos[evidence.row_id(rows[3])] == (None, ["context_bytes (refitted leaving it out)",
                                                    "workspace rules (read off its event log)"])
    assert oos[evidence.row_id(rows[4])] == (0.0, [])
    alone = evidence.out_of_sample(rows[:1], {evidence.row_id(rows[0]): records[evidence.row_id(rows[0])]}, [])
    assert alone[evidence.row_id(rows[0])] == (None, ["context_bytes (no other row to refit it on)"])
    built = evidence.build(rows, records, rules_from=[("small", '{"model.checkpointing": true}')])
    (entry,) = built["classes"]
    assert entry["uncertainty"] == accuracy.uncertainty_of_errors([0.08333, 0.04545, -0.0303, 0.0])
    assert entry["uncertainty"] == pytest.approx(0.031)       # c's out-of-sample -3.03%, not its in-sample 0%


def test_a_class_with_no_out_of_sample_row_books_the_conservative_figure_and_says_so(monkeypatch):
    from tiersep.memory import evidence

    fitted = next(iter(evidence.CONTEXT_FITTED_ON))
    rows = [_row("logged", fitted, 1000, 1000)]
    records = {evidence.row_id(rows[0]): _record(1000, 0)}
    built = evidence.build(rows, records, rules_from=[("small", "{}")])
    (entry,) = built["classes"]
    assert entry["uncertainty"] == accuracy.NO_EVIDENCE_UNCERTAINTY
    assert entry["leave_one_out"] == {"covered": 0, "of": 0, "worst_gap": 0.0}
    cls = entry["class"]
    monkeypatch.setattr(accuracy, "load_evidence", lambda: {accuracy.class_key(cls): entry})
    u, why = accuracy.uncertainty(cls)
    assert u == accuracy.NO_EVIDENCE_UNCERTAINTY and "no out-of-sample GPU measurement" in why
    assert accuracy.worst_under(cls) == 0.0     # the in-sample row still counts as evidence of an error


def test_the_shipped_evidence_books_only_out_of_sample_errors():
    """accuracy_evidence.json as the estimate reads it: each class's uncertainty is computed from its
    out-of-sample errors, and the seven rows of the logged configurations have none: one of them,
    `held-out small bf16 ckpt` (H200, 2026-11-28), repeats small_bf16_ckpt, whose log the rules were
    read off, so it is not counted held out either."""
    classes = accuracy.load_evidence().values()
    in_sample = [c for e in classes for c in e["configurations"] if c["out_of_sample_error"] is None]
    assert len(in_sample) == 7, [c["name"] for c in in_sample]
    assert "held-out small bf16 ckpt" in [c["name"] for c in in_sample]
    assert not any(c["held_out"] for c in in_sample)
    for entry in classes:
        errors = [c["out_of_sample_error"] for c in entry["configurations"] if c["out_of_sample_error"] is not None]
        assert entry["uncertainty"] == (accuracy.uncertainty_of_errors(errors) if errors
                                        else accuracy.NO_EVIDENCE_UNCERTAINTY)


def test_leaving_a_configuration_out_leaves_out_its_twin_on_another_card():
    """The same configuration measured on two cards (an H100 and an H200 read -5.66% and -5.67%) is
    one configuration: judged out of sample, its twin must not book the uncertainty that covers it."""
    from tiersep.memory import evidence

    twins = [("bf16 math b2", -0.0566), ("bf16 math b2", -0.0567), ("bf16 math", -0.0072)]
    loo = evidence.leave_one_out(twins)
    assert loo["covered"] == 1 and loo["of"] == 3          # only the -0.72% row, against the twins' 5.7%
    assert loo["worst_gap"] == pytest.approx(0.0567 - accuracy.TARGET, abs=1e-5)
    # as two independent configurations, each twin would have covered the other
    assert evidence.leave_one_out([("a", -0.0566), ("b", -0.0567), ("c", -0.0072)])["covered"] == 3
