"""The records stages write and the report reads, each checked against its JSON schema.

kind      file (writer)                                             schema
estimate  results/vram/<preset>.json (tiersep.memory.estimate)      workflow/schemas/records/estimate.schema.yaml
run       results/train/<preset>/run.json (trainer `_finish`)       .../run.schema.yaml
failure   results/train/<preset>/failure.json (`_write_failure`)    .../failure.schema.yaml
scores    results/eval/<preset>/scores.json (tiersep.evaluate)      .../scores.schema.yaml
manifest  <prepared_dir>/<source>/<rate>/manifest.json (prepare)    .../manifest.schema.yaml

Each schema requires what readers rely on and allows extra fields, so a writer may add some. A
writer calls `validate_record(kind, record, path)` before writing; the report calls `read_record`.
Errors are one line naming the file and the field, e.g.
`results/train/a/run.json: peak_allocated_bytes: missing (required)`.
"""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

from jsonschema import Draft202012Validator

from tiersep.config import ConfigError, load_schema

KINDS = ("estimate", "run", "failure", "scores", "manifest")


class RecordError(ConfigError):
    """A record that cannot be read or breaks its schema; the message names the file and field."""


@lru_cache(maxsize=None)
def _validator(kind: str) -> Draft202012Validator:
    if kind not in KINDS:
        raise ValueError(f"unknown record kind {kind!r} (known: {', '.join(KINDS)})")
    return Draft202012Validator(load_schema(f"records/{kind}.schema.yaml"))


def schema(kind: str) -> dict:
    return _validator(kind).schema


def _field_and_problem(error) -> tuple[str, str]:
    """('per_track/A - B/bass/sdr', "'7 dB' is not of type 'number', 'null'") for one error. Fields
    are joined with '/': track names may hold dots."""
    path = [str(p) for p in error.absolute_path]
    if error.validator == "required" and isinstance(error.instance, dict):
        missing = [key for key in error.validator_value if key not in error.instance]
        return "/".join(path + missing[:1]), "missing (required)"
    if error.validator == "additionalProperties" and isinstance(error.instance, dict):
        known = set(error.schema.get("properties", {}))
        extra = sorted(set(error.instance) - known)
        return "/".join(path + extra[:1]), f"unknown field (allowed: {', '.join(sorted(known))})"
    return "/".join(path) or "(top level)", error.message


def validate_record(kind: str, record, path: str | Path) -> dict:
    """Return `record` when it follows the `kind` schema (and its cross-field rules); otherwise
    raise RecordError '<path>: <field>: <problem>' for the shallowest problem."""
    if not isinstance(record, dict):
        raise RecordError(f"{path}: expected a JSON object, got {type(record).__name__}")
    errors = sorted(_validator(kind).iter_errors(record),
                    key=lambda e: (len(e.absolute_path), list(map(str, e.absolute_path))))
    if errors:
        field, problem = _field_and_problem(errors[0])
        raise RecordError(f"{path}: {field}: {problem}", tuple(errors[0].absolute_path))
    for check in CROSS_CHECKS.get(kind, ()):
        check(record, path)
    return record


def read_record(kind: str, path: str | Path) -> dict | None:
    """The validated record at `path`, or None when there is no such file."""
    path = Path(path)
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise RecordError(f"{path}: not valid JSON ({err})") from None
    return validate_record(kind, record, path)


# ---- rules a JSON schema cannot state ---------------------------------------------------------
def _scores_match_sources(scores: dict, path) -> None:
    sources = scores["sources"]
    if list(scores["per_stem"]) != sources:
        raise RecordError(f"{path}: per_stem: has {list(scores['per_stem'])}, sources are {sources}")
    if len(scores["per_track"]) != scores["tracks"]:
        raise RecordError(f"{path}: per_track: {len(scores['per_track'])} per_track entries, "
                          f"tracks = {scores['tracks']}")
    for track, stems in scores["per_track"].items():
        if list(stems) != sources:
            raise RecordError(f"{path}: per_track/{track}: has {list(stems)}, sources are {sources}")
        for stem, entry in stems.items():
            if entry["valid_frames"] > entry["frames"]:
                raise RecordError(f"{path}: per_track/{track}/{stem}/valid_frames: "
                                  f"{entry['valid_frames']} is more than frames ({entry['frames']})")


CROSS_CHECKS = {"scores": (_scores_match_sources,)}
