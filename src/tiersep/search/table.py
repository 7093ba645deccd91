"""What a search leaves under results/search/<study>/, read back from the study's storage (the
source of truth): trials.csv (one row per trial) and best.yaml (the preset the best trial trained).
The other outputs of a finished study (Pareto presets, the best trial per GPU budget, their test
scores) are tiersep.search.outputs."""
from __future__ import annotations

import csv
import io
import math
from pathlib import Path

import optuna
from optuna.trial import FrozenTrial, TrialState

from tiersep.io import write_text

GIB = 2**30
COLUMNS = ["number", "state", "reason", "verdict", "levers", "estimate_gib", "booking_gib", "budget_gib",
           "measured_peak_gib", "steps", "si_sdr", "predicted_peak_gib", "seconds", "started", "ended"]


def infeasible(trial: FrozenTrial) -> bool:
    return any(v > 0 for v in trial.constraints.values())


def state_of(trial: FrozenTrial) -> str:
    """COMPLETE, PRUNED, INFEASIBLE (told COMPLETE with a violated constraint), FAIL, RUNNING or WAITING."""
    if trial.state == TrialState.COMPLETE and infeasible(trial):
        return "INFEASIBLE"
    return trial.state.name


def _time(value) -> str:
    """A trial's datetime_start / datetime_complete as ISO text (the report's timeline)."""
    return "" if value is None else value.isoformat(timespec="milliseconds")


def _gib(value) -> str:
    return "" if value is None else f"{value / GIB:.3f}"


def row(trial: FrozenTrial, fields: list[str], objectives: list[str]) -> dict:
    a = trial.user_attrs
    values = dict(zip(objectives, trial.values or [])) if trial.state == TrialState.COMPLETE else {}
    si_sdr = values.get("si_sdr")
    return {"number": trial.number, **{f: trial.params.get(f, "") for f in fields},
            "state": state_of(trial), "reason": a.get("reason", ""), "verdict": a.get("verdict", ""),
            "levers": "; ".join(a.get("levers", [])), "estimate_gib": _gib(a.get("estimate_bytes")),
            "booking_gib": _gib(a.get("booking_bytes")), "budget_gib": _gib(a.get("budget_bytes")),
            "measured_peak_gib": _gib(a.get("measured_peak_bytes")), "steps": a.get("steps", ""),
            "si_sdr": "" if si_sdr is None or not math.isfinite(si_sdr) else f"{si_sdr:.4f}",
            "predicted_peak_gib": _gib(a.get("booking_bytes")) if "predicted_peak" in objectives else "",
            "seconds": f"{a.get('train_seconds', 0.0):.1f}",
            "started": _time(trial.datetime_start), "ended": _time(trial.datetime_complete)}


def write_trials_csv(study: optuna.Study, fields: list[str], objectives: list[str], path: Path) -> None:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=["number", *fields, *COLUMNS[1:]], lineterminator="\n")
    writer.writeheader()
    for trial in study.get_trials(deepcopy=False):
        writer.writerow(row(trial, fields, objectives))
    write_text(path, buffer.getvalue())


def best_trial(study: optuna.Study, objectives: list[str]) -> FrozenTrial | None:
    """The feasible COMPLETE trial with the highest validation SI-SDR (the first objective)."""
    done = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
            if not infeasible(t) and t.values and math.isfinite(t.values[0])]
    return max(done, key=lambda t: t.values[0]) if done else None


def write_best(study: optuna.Study, objectives: list[str], trials_dir: Path, path: Path) -> FrozenTrial | None:
    """best.yaml: the preset the best trial trained (its repaired variant when it was repaired)."""
    best = best_trial(study, objectives)
    if best is not None:
        source = trials_dir / f"{best.number}.preset.yaml"
        if source.is_file():
            write_text(path, f"# best trial {best.number} of study {study.study_name}: validation SI-SDR "
                             f"{best.values[0]:.3f} dB\n" + source.read_text())
    return best
