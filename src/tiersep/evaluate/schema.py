"""The schema of results/eval/<preset>/scores.json: workflow/schemas/records/scores.schema.yaml,
checked before the file is written (tiersep.evaluate.scoring.write_scores) and by the report.

Scores are in dB; null where a score is undefined (e.g. museval refused a track whose whole stem is
silent, or every frame of a stem was silent). Extra top-level fields may be added; the listed ones
are the contract the report and users rely on.
"""
from __future__ import annotations

from pathlib import Path

from tiersep import records

SCORES_SCHEMA = records.schema("scores")
# What evaluate writes into its folder (one holding nothing else, without a stamp, is adopted).
EVAL_FILES = {"scores.json", "museval", "estimates", "listen"}


def validate_scores(scores: dict, path: str | Path = "scores.json") -> None:
    """Raise ValueError (tiersep.records.RecordError) naming the first field of `scores` that
    breaks the schema, or a stem or track that does not match `sources` / `tracks`."""
    records.validate_record("scores", scores, path)
