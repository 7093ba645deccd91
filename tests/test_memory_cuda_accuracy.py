"""The CUDA trace estimate against real device use on an NVIDIA H100 (no GPU needed).

Every configuration of the shared measurements (tests/data/gpu/h100-2026-11-22: 10 with the native
caching allocator, 3 steps; 6 with expandable segments, 2 steps) is estimated with
`estimate(preset, "trace", "cuda", calibration_spec="NVIDIA H100 80GB HBM3")` and compared with what
torch and the driver reported on the GPU:
- allocated_peak_bytes vs torch.cuda.max_memory_allocated: within 0.5%;
- reserved_peak_bytes vs torch.cuda.max_memory_reserved and peak_bytes vs the device use
  (total - free): within 1.5% either way.

The measurements ran the model of commit e74010960b93 (the data's README.md); the model has changed
since (tiersep/model), so the estimate here traces that commit's model, read from git, in place of
the working tree's: the same code on both sides of the comparison.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tiersep import config as C
from tiersep.memory.estimate import estimate
from tiersep.model.at_revision import model_at

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "gpu" / "h100-2026-11-22"
MEASURED_COMMIT = "e74010960b93"
GPU = "NVIDIA H100 80GB HBM3"
ALLOCATED_TOLERANCE = 0.005
RESERVED_TOLERANCE = 0.015


def _configurations() -> list[dict]:
    rows = []
    for name, expandable in (("measurements.jsonl", False), ("expandable_segments.jsonl", True)):
        for line in (DATA / name).read_text().splitlines():
            if line.strip():
                rows.append(dict(json.loads(line), expandable_segments=expandable, source=name))
    return rows


CONFIGURATIONS = _configurations()


@pytest.fixture(scope="module")
def measured_model():
    """tiersep.model's build_model and build_loss as they were at the measured commit."""
    try:
        return model_at(MEASURED_COMMIT, ROOT)
    except LookupError as err:
        pytest.fail(str(err), pytrace=False)


def _preset(row: dict) -> dict:
    preset = C.load_preset(row["preset"])
    for key, value in row["set"].items():
        preset = C.set_field(preset, key, value)
    preset = C.set_field(preset, "train.cuda_expandable_segments", row["expandable_segments"])
    return C.validate(preset, "preset.schema.yaml", f"{row['source']}: {row['name']}")


def _table(row: dict, checks: list) -> str:
    lines = [f"{row['name']} ({row['source']}, {'expandable segments' if row['expandable_segments'] else 'native'}, "
             f"{row['steps']} steps):", f"  {'quantity':<32} {'measured':>16} {'predicted':>16} {'error':>9}"]
    for what, measured, predicted, error, ok in checks:
        lines.append(f"  {what:<32} {measured:>16,} {predicted:>16,} {error:>+9.3%}{'' if ok else '  <- out of bounds'}")
    return "\n".join(lines)


# Known open gap (issue 12): with the math SDPA kernel the trace still misses allocations (allocated
# -2.3%, device use -9.2% on `small bf16 math`). Strict: the day it passes, this mark must go.
MATH_GAP = pytest.mark.xfail(strict=True, reason="math attention: trace under the H100 by 2.3% allocated, "
                             "9.2% device use (issue 12, open)")


def _case(row):
    marks = [MATH_GAP] if row["set"].get("model.attention_backend") == "math" else []
    return pytest.param(row, marks=marks, id=f"{row['name']}-{'exp' if row['expandable_segments'] else 'native'}")


@pytest.mark.parametrize("row", [_case(r) for r in CONFIGURATIONS])
def test_cuda_estimate_matches_the_h100(row, measured_model, monkeypatch):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)     # the mode is the preset's
    monkeypatch.setattr("tiersep.model.build_model", measured_model.build_model)
    monkeypatch.setattr("tiersep.model.build_loss", measured_model.build_loss)
    # the H100 ran these eagerly: the eager step, whatever train.compile says
    record = estimate(_preset(row), "trace", "cuda", calibration_spec=GPU, compiled=False)
    assert record["allocator"] == {"expandable_segments": row["expandable_segments"]}

    checks = []
    for what, key, measured_key, low, high in (
            ("allocated (max_memory_allocated)", "allocated_peak_bytes", "max_memory_allocated",
             -ALLOCATED_TOLERANCE, ALLOCATED_TOLERANCE),
            ("reserved (max_memory_reserved)", "reserved_peak_bytes", "max_memory_reserved",
             -RESERVED_TOLERANCE, RESERVED_TOLERANCE),
            ("peak_bytes (device use)", "peak_bytes", "device_used_bytes", -RESERVED_TOLERANCE, RESERVED_TOLERANCE)):
        measured, predicted = row[measured_key], record[key]
        error = predicted / measured - 1
        checks.append((what, measured, predicted, error, low <= error <= high))
    assert all(ok for *_, ok in checks), "\n" + _table(row, checks)
