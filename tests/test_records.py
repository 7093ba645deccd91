"""Record schemas (workflow/schemas/records/): valid Draft 2020-12, followed by the real writers'
records and by every report fixture, and broken records named by file and field on one line."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from jsonschema import Draft202012Validator

from tiersep import config as C
from tiersep.records import KINDS, RecordError, read_record, schema, validate_record

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures"
SCHEMA_DIR = REPO / "workflow" / "schemas" / "records"


def fixture_records() -> list[tuple[str, Path]]:
    """(kind, path) of every record under tests/fixtures that the report reads."""
    found = [("fit_matrix" if p.stem == "fit_matrix" else "estimate", p)
             for p in (FIXTURES / "results" / "vram").glob("*.json")]
    found += [("run", p) for p in (FIXTURES / "results" / "train").glob("*/run.json")]
    found += [("failure", p) for p in (FIXTURES / "results" / "train").glob("*/failure.json")]
    found += [("scores", p) for p in (FIXTURES / "results" / "eval").glob("*/scores.json")]
    found += [("listen", p) for p in (FIXTURES / "results" / "eval").glob("*/listen/listen.json")]
    found += [("manifest", p) for p in FIXTURES.rglob("manifest.json")]
    return sorted(found)


def test_one_schema_per_record_kind_each_valid_draft_2020_12():
    assert sorted(p.name for p in SCHEMA_DIR.glob("*.schema.yaml")) == sorted(f"{k}.schema.yaml" for k in KINDS)
    for kind in KINDS:
        Draft202012Validator.check_schema(schema(kind))
        assert schema(kind)["$schema"] == "https://json-schema.org/draft/2020-12/schema"
        assert schema(kind)["additionalProperties"] is True, kind  # writers may add fields


def test_every_fixture_record_follows_its_schema():
    records = fixture_records()
    assert {kind for kind, _ in records} == set(KINDS)  # every kind is exercised
    for kind, path in records:
        read_record(kind, path)


def test_a_missing_field_is_one_line_naming_file_and_field(tmp_path):
    path = FIXTURES / "results" / "train" / "test_tiny" / "run.json"
    run = json.loads(path.read_text())
    del run["peak_allocated_bytes"]
    with pytest.raises(RecordError) as err:
        validate_record("run", run, path)
    assert str(err.value) == f"{path}: peak_allocated_bytes: missing (required)"


def test_a_wrong_type_names_the_nested_field():
    path = next(p for k, p in fixture_records() if k == "scores")
    scores = json.loads(path.read_text())
    track = next(iter(scores["per_track"]))
    scores["per_track"][track]["vocals"]["valid_frames"] = "12"
    with pytest.raises(RecordError, match=rf"^{path}: per_track/{track}/vocals/valid_frames: '12' is not of type"):
        validate_record("scores", scores, path)
    scores["per_track"][track]["vocals"]["valid_frames"] = scores["per_track"][track]["vocals"]["frames"] + 1
    with pytest.raises(RecordError, match=r"valid_frames: \d+ is more than frames"):
        validate_record("scores", scores, path)


def test_extra_fields_are_allowed_and_soon_fields_are_typed():
    path = FIXTURES / "results" / "vram" / "large.json"
    estimate = json.loads(path.read_text())
    validate_record("estimate", {**estimate, "a_field_a_writer_adds": [1, 2]}, path)
    validate_record("estimate", {**estimate, "budget": "auto", "compiled": False,
                                 "allocator": {"expandable_segments": True},
                                 "calibration": {"name": "NVIDIA H100 80GB HBM3", "source": "built-in"}}, path)
    with pytest.raises(RecordError, match=r"large\.json: calibration/source: missing"):
        validate_record("estimate", {**estimate, "calibration": {"name": "H100"}}, path)
    with pytest.raises(RecordError, match=r"large\.json: device: 'gpu' is not one of"):
        validate_record("estimate", {**estimate, "device": "gpu"}, path)


def test_unreadable_records(tmp_path):
    bad = tmp_path / "run.json"
    bad.write_text('{"pid": ')
    with pytest.raises(RecordError, match=rf"^{bad}: not valid JSON"):
        read_record("run", bad)
    bad.write_text("[1, 2]")
    with pytest.raises(RecordError, match=rf"^{bad}: expected a JSON object, got list"):
        read_record("run", bad)
    assert read_record("run", tmp_path / "absent.json") is None
    with pytest.raises(ValueError, match="unknown record kind 'runs'"):
        validate_record("runs", {}, bad)


# ---- the real writers -----------------------------------------------------------------------------
def tiny_config() -> dict:
    return C.load_config(REPO / "tests" / "configs" / "tiny.yaml",
                         overrides={"presets_dir": str(REPO / "tests" / "configs" / "presets")})


def test_a_real_estimate_follows_the_schema(single_thread):
    from tiersep.memory import estimate

    cfg = tiny_config()
    record = json.loads(json.dumps(estimate(C.load_preset("test_tiny", cfg), "trace", "cuda", 24 * 2**30, 0.08)))
    validate_record("estimate", record, "results/vram/test_tiny.json")
    broken = copy.deepcopy(record)
    broken["breakdown"].pop("activations")
    with pytest.raises(RecordError, match=r"test_tiny\.json: breakdown/activations: missing"):
        validate_record("estimate", broken, "results/vram/test_tiny.json")


def test_a_real_refusal_follows_the_schema(tmp_path, single_thread):
    """The trainer refuses a GPU-sized preset on this CPU before it reads a track: a real failure.json.
    It reads the data folder's manifest first (a folder prepare did not write is refused before the
    gate), so the folder has one and nothing else."""
    from tiersep.train.trainer import EXIT_REFUSED, train

    cfg = tiny_config()
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "manifest.json").write_text("{}")
    assert train(cfg, C.load_preset("large", cfg), tmp_path / "data", tmp_path / "out") == EXIT_REFUSED
    record = read_record("failure", tmp_path / "out" / "failure.json")
    assert record["kind"] == "refused" and "GPU-sized" in record["message"]
