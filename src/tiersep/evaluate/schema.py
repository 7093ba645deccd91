"""JSON schema of results/eval/<preset>/scores.json (checked before it is written, and by tests).

Scores are in dB; null where a score is undefined (e.g. museval refused a track whose whole stem is
silent, or every frame of a stem was silent). Extra top-level fields may be added; the listed ones
are the contract the report and users rely on.
"""
from __future__ import annotations

from jsonschema import Draft202012Validator

TRACK_KEYS = ("si_sdr", "sdr", "sir", "isr", "sar", "si_sdr_mixture", "sdr_mixture")
AGGREGATE_KEYS = TRACK_KEYS + ("si_sdr_improvement", "sdr_improvement")

_SCORE = {"type": ["number", "null"]}


def _scores(keys) -> dict:
    return {"type": "object", "additionalProperties": False, "required": list(keys),
            "properties": {k: _SCORE for k in keys}}


SCORES_SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "required": ["preset", "sources", "sample_rate", "tracks", "overall", "per_stem", "per_track",
                 "protocol", "seconds"],
    "properties": {
        "preset": {"type": "string", "minLength": 1},
        "sources": {"type": "array", "minItems": 1, "uniqueItems": True, "items": {"type": "string"}},
        "sample_rate": {"type": "integer", "minimum": 1},
        "tracks": {"type": "integer", "minimum": 1},
        "overall": _scores(AGGREGATE_KEYS),
        "per_stem": {"type": "object", "minProperties": 1, "additionalProperties": _scores(AGGREGATE_KEYS)},
        "per_track": {"type": "object", "minProperties": 1,
                      "additionalProperties": {"type": "object", "minProperties": 1,
                                               "additionalProperties": _scores(TRACK_KEYS)}},
        "protocol": {"type": "string", "minLength": 1},
        "seconds": {"type": "number", "minimum": 0},
        "skipped": {"type": "object", "additionalProperties": {"type": "string"}},
        "model": {"type": ["string", "null"]},
        "step": {"type": ["integer", "null"]},
        "device": {"type": "string"},
        "precision": {"enum": ["fp32", "bf16"]},
        "chunk_seconds": {"type": "number", "exclusiveMinimum": 0},
        "overlap": {"type": "number", "minimum": 0, "exclusiveMaximum": 1},
        "workers": {"type": "integer", "minimum": 1},
        "museval_version": {"type": "string"},
    },
}


def validate_scores(scores: dict) -> None:
    """Raise ValueError naming the first field of `scores` that breaks the schema, or a stem or
    track that does not match `sources` / `tracks`."""
    errors = sorted(Draft202012Validator(SCORES_SCHEMA).iter_errors(scores), key=lambda e: list(e.path))
    if errors:
        where = "/".join(map(str, errors[0].absolute_path)) or "(top level)"
        raise ValueError(f"scores.json: {where}: {errors[0].message}")
    sources = scores["sources"]
    if list(scores["per_stem"]) != sources:
        raise ValueError(f"scores.json: per_stem has {list(scores['per_stem'])}, sources are {sources}")
    if len(scores["per_track"]) != scores["tracks"]:
        raise ValueError(f"scores.json: {len(scores['per_track'])} per_track entries, tracks = {scores['tracks']}")
    for track, stems in scores["per_track"].items():
        if list(stems) != sources:
            raise ValueError(f"scores.json: per_track/{track} has {list(stems)}, sources are {sources}")
