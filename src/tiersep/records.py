"""The records stages write and the report reads, each checked against its JSON schema.

kind      file (writer)                                             schema
estimate  results/vram/<preset>.json (tiersep.memory.estimate)      workflow/schemas/records/estimate.schema.yaml
run       results/train/<preset>/run.json (train.endings.finish)    .../run.schema.yaml
failure   results/train/<preset>/failure.json (`_write_failure`)    .../failure.schema.yaml
scores    results/eval/<preset>/scores.json (tiersep.evaluate)      .../scores.schema.yaml
manifest  <prepared_dir>/<source>/<rate>/manifest.json (prepare)    .../manifest.schema.yaml
listen    results/eval/<preset>/listen/listen.json (evaluate)      .../listen.schema.yaml
fit_matrix results/vram/fit_matrix.json (tiersep fit --gpus --json)  .../fit_matrix.schema.yaml

Each schema requires what readers rely on and allows extra fields, so a writer may add some. A
writer calls `validate_record(kind, record, path)` before writing; the report calls `read_record`.
Errors are one line naming the file and the field, e.g.
`results/train/a/run.json: peak_allocated_bytes: missing (required)`.

Every number in a record is finite. Python's json module reads (and by default writes) the tokens
NaN, Infinity and -Infinity, which strict JSON has not; a JSON schema's `type: number` accepts them.
tiersep's writers write null for an undefined value, so a non-finite number anywhere in a record is
refused, e.g. `results/eval/a/scores.json: overall/si_sdr: NaN is not a finite number`, before the
schema is checked: a NaN score must never pass as "no value" nor be compared as a number.
"""
from __future__ import annotations

import json
import math
from functools import lru_cache
from pathlib import Path

from jsonschema import Draft202012Validator

from tiersep.config import ConfigError, load_schema

KINDS = ("estimate", "run", "failure", "scores", "manifest", "listen", "fit_matrix")


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


def non_finite(record) -> tuple[tuple, float] | None:
    """(field path, value) of the first NaN or ±inf in `record` (dicts and lists, in document
    order), or None. Iterative: a deeply nested record must not overflow the stack."""
    stack = [((), record)]
    while stack:
        where, value = stack.pop()
        if isinstance(value, float) and not math.isfinite(value):
            return where, value
        if isinstance(value, dict):
            stack += [(where + (key,), item) for key, item in reversed(value.items())]
        elif isinstance(value, (list, tuple)):
            stack += [(where + (index,), item) for index, item in reversed(list(enumerate(value)))]
    return None


def _json_spelling(value: float) -> str:
    """NaN, Infinity, -Infinity: as the token stands in the file."""
    return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")


def validate_record(kind: str, record, path: str | Path) -> dict:
    """Return `record` when every number in it is finite and it follows the `kind` schema (and its
    cross-field rules); otherwise raise RecordError '<path>: <field>: <problem>' (the first
    non-finite number, else the shallowest schema problem)."""
    if not isinstance(record, dict):
        raise RecordError(f"{path}: expected a JSON object, got {type(record).__name__}")
    bad = non_finite(record)
    if bad is not None:
        where, value = bad
        field = "/".join(map(str, where))
        raise RecordError(f"{path}: {field}: {_json_spelling(value)} is not a finite number", where)
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
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise RecordError(f"{path}: not valid JSON (not UTF-8 text: {err.reason} at byte {err.start})") from None
    except OSError as err:
        raise RecordError(f"{path}: cannot be read ({err.strerror or err})") from None
    try:
        record = json.loads(text)
    except (ValueError, RecursionError) as err:
        # ValueError: JSONDecodeError, and an integer over Python's digit limit; RecursionError:
        # nesting deeper than the parser's stack
        raise RecordError(f"{path}: not valid JSON ({str(err) or type(err).__name__})") from None
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


def _listen_files_add_up(listen: dict, path) -> None:
    """`bytes` is the total of the files (the report checks each against the disk), each named once;
    the mixture has no stem and every other file has one."""
    names = [entry["file"] for entry in listen["files"]]
    if len(set(names)) != len(names):
        raise RecordError(f"{path}: files: a file is listed twice")
    for index, entry in enumerate(listen["files"]):
        if (entry["role"] == "mixture") != (entry["stem"] is None):
            raise RecordError(f"{path}: files/{index}/stem: {entry['role']} with stem {entry['stem']!r}")
    total = sum(entry["bytes"] for entry in listen["files"])
    if total != listen["bytes"]:
        raise RecordError(f"{path}: bytes: {listen['bytes']}, but the files add up to {total}")


def _a_cell_per_budget(matrix: dict, path) -> None:
    """Every tier has one cell per budget, in the budgets' order; a cell that fits has its peak."""
    budgets = len(matrix["budgets"])
    for index, row in enumerate(matrix["tiers"]):
        if len(row["cells"]) != budgets:
            raise RecordError(f"{path}: tiers/{index}/cells: {len(row['cells'])} cells for {budgets} budgets")
        for column, cell in enumerate(row["cells"]):
            if cell["status"] != "no" and cell["peak_bytes"] is None:
                raise RecordError(f"{path}: tiers/{index}/cells/{column}/peak_bytes: null in a cell that fits")


CROSS_CHECKS = {"scores": (_scores_match_sources,), "listen": (_listen_files_add_up,),
                "fit_matrix": (_a_cell_per_budget,)}
