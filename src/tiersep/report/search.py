"""The report's view of a hyperparameter search: results/search/<study>/ read from the files the
search writes (trials.csv, best.json, eval/<n>/scores.json), never from the study's storage, so the
report needs neither Optuna nor a database and cannot disturb a study that is running.

The study shown is the config's `search.study` ("search" when the config has no `search:`); when
its folder holds no trials.csv the report has no Search section. A file that exists but cannot be
read becomes a problem of the run (a failure row naming it), as every other record does.
"""
from __future__ import annotations

import csv
import io
import json
import math
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from tiersep.records import RecordError, read_record

# trials.csv's columns after the parameters (tiersep.search.table.COLUMNS)
FIXED = ("number", "state", "reason", "verdict", "levers", "estimate_gib", "booking_gib", "budget_gib",
         "measured_peak_gib", "steps", "si_sdr", "predicted_peak_gib", "seconds", "started", "ended")
STATES = ("COMPLETE", "PRUNED", "INFEASIBLE", "FAIL", "RUNNING", "WAITING")


def number(text: str | None) -> float | None:
    try:
        value = float(text) if text not in (None, "") else None
    except ValueError:
        return None
    return value if value is not None and math.isfinite(value) else None


def when(text: str | None) -> datetime | None:
    try:
        return datetime.fromisoformat(text) if text else None
    except ValueError:
        return None


@dataclass
class Trial:
    number: int
    state: str
    reason: str
    verdict: str
    levers: str
    params: dict[str, str]
    booking_gib: float | None
    budget_gib: float | None
    measured_peak_gib: float | None
    steps: float | None
    si_sdr: float | None          # validation SI-SDR (the objective)
    seconds: float | None         # training seconds, over every launch
    started: datetime | None
    ended: datetime | None

    @property
    def ran(self) -> bool:
        """Whether a process ran for it (an infeasible trial never starts one)."""
        return self.state != "INFEASIBLE" and self.started is not None and self.ended is not None

    @property
    def duration(self) -> float:
        return (self.ended - self.started).total_seconds() if self.ran else 0.0


@dataclass
class Study:
    name: str
    folder: Path
    fields: list[str]
    trials: list[Trial]
    index: dict | None = None                         # best.json
    scores: dict[int, dict] = field(default_factory=dict)   # eval/<n>/scores.json

    def counts(self) -> dict[str, int]:
        out = {s: sum(t.state == s for t in self.trials) for s in STATES}
        return {s: n for s, n in out.items() if n}

    def packing(self) -> tuple[float, float, int] | None:
        """(trial-seconds run, wall seconds during which at least one trial ran, trials that ran):
        their ratio is how many trials ran side by side on average. None when none ran."""
        spans = sorted((t.started, t.ended) for t in self.trials if t.ran)
        if not spans:
            return None
        wall, (start, end) = 0.0, spans[0]
        for s, e in spans[1:]:
            if s > end:
                wall += (end - start).total_seconds()
                start, end = s, e
            else:
                end = max(end, e)
        wall += (end - start).total_seconds()
        return sum((e - s).total_seconds() for s, e in spans), wall, len(spans)

    def test_si_sdr(self, trial: int) -> float | None:
        value = ((self.scores.get(trial) or {}).get("overall") or {}).get("si_sdr")
        return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def study_name(cfg: dict) -> str:
    return (cfg.get("search") or {}).get("study") or "search"


def read_trials(path: Path) -> tuple[list[str], list[Trial]]:
    """trials.csv as (parameter columns, trials); a file the search cannot have written raises
    RecordError naming it."""
    try:
        text = path.read_bytes().decode("utf-8")
    except (UnicodeDecodeError, OSError) as err:
        raise RecordError(f"{path}: not a trials.csv tiersep search wrote ({err})") from None
    reader = csv.DictReader(io.StringIO(text, newline=""))
    try:
        header = reader.fieldnames or []
        if header[:1] != ["number"] or "state" not in header or "\x00" in text:
            raise RecordError(f"{path}: expected the header of tiersep search's trials.csv (number, ..., state, ...)")
        fields = [h for h in header if h not in FIXED]
        trials = []
        for row in reader:
            if not (row.get("number") or "").isdigit() or row.get("state") not in STATES:
                raise RecordError(f"{path}: line {reader.line_num}: number {row.get('number')!r} / state "
                                  f"{row.get('state')!r} is not a trial of tiersep search")
            trials.append(Trial(int(row["number"]), row["state"], row.get("reason") or "", row.get("verdict") or "",
                                row.get("levers") or "", {f: row.get(f) or "" for f in fields},
                                number(row.get("booking_gib")), number(row.get("budget_gib")),
                                number(row.get("measured_peak_gib")), number(row.get("steps")),
                                number(row.get("si_sdr")), number(row.get("seconds")),
                                when(row.get("started")), when(row.get("ended"))))
    except csv.Error as err:
        raise RecordError(f"{path}: line {reader.line_num}: not a CSV ({err})") from None
    return fields, trials


def collect_study(cfg: dict, results_dir: Path, problems: list[str]) -> Study | None:
    """The config's study, or None when it has no trials.csv (or one that cannot be read: then a
    problem names it)."""
    name = study_name(cfg)
    folder = results_dir / "search" / name
    if not (folder / "trials.csv").is_file():
        return None
    try:
        fields, trials = read_trials(folder / "trials.csv")
    except RecordError as err:
        problems.append(str(err))
        return None
    study = Study(name, folder, fields, trials)
    if (folder / "best.json").is_file():
        try:
            index = json.loads((folder / "best.json").read_text())
            study.index = index if isinstance(index, dict) else None
        except (OSError, UnicodeDecodeError, ValueError) as err:
            problems.append(f"{folder / 'best.json'}: not the index tiersep search wrote ({err})")
    for path in sorted(folder.glob("eval/*/scores.json")):
        if path.parent.name.isdigit():
            try:
                study.scores[int(path.parent.name)] = read_record("scores", path)
            except RecordError as err:
                problems.append(str(err))
    return study
