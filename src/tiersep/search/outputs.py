"""What a finished study leaves besides trials.csv and best.yaml (table.py), so that tiers are found
by search rather than written by hand:

- pareto/<n>.yaml (two objectives): the preset of every trial on the front of validation SI-SDR
  (higher) against the predicted peak (the gate's booking, lower);
- best/<budget>gib.yaml: for each GPU budget of the config's fit_matrix.gpus, the preset of the best
  feasible trial whose booking fits that budget with the safety margin kept free (as the gate
  rules: booking + margin <= budget);
- best.json: the index of both, and of the best trial overall, each entry with its trial number,
  validation SI-SDR, booking, preset, model and (once evaluated) test scores;
- eval/<n>/: the test-set evaluation of the best trial and of each budget's best, by `tiersep
  evaluate` as a tier's (its own process: the orchestrator never opens CUDA).

A preset written here is the one the trial trained (its repaired variant when it was repaired):
`tiers: [results/search/<study>/best/80gib.yaml]` in a config trains it as a tier, and
`tiersep separate --model results/search/<study>/trials/<n>/model.pt` separates with its model.
Everything is derived from the study's storage again at each write, so a rerun never leaves a stale
front behind.
"""
from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import optuna
from optuna.trial import FrozenTrial, TrialState

from tiersep.io import write_json, write_text
from tiersep.memory.fit.matrix import Budget, parse_budgets
from tiersep.resources import command_module

from .table import infeasible

GIB = 2**30
INDEX = "best.json"


def done(study: optuna.Study) -> list[FrozenTrial]:
    """Feasible COMPLETE trials with a finite validation SI-SDR and a recorded booking."""
    return [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
            if not infeasible(t) and t.values and math.isfinite(t.values[0]) and "booking_bytes" in t.user_attrs]


def booking(trial: FrozenTrial) -> int:
    return int(trial.user_attrs["booking_bytes"])


def pareto(trials: list[FrozenTrial]) -> list[FrozenTrial]:
    """The trials no other trial beats on both: SI-SDR at least as high and booking at most as low,
    better on one. Ordered by booking (the smallest first)."""
    def dominated(t: FrozenTrial) -> bool:
        return any(o.values[0] >= t.values[0] and booking(o) <= booking(t)
                   and (o.values[0] > t.values[0] or booking(o) < booking(t)) for o in trials)

    return sorted((t for t in trials if not dominated(t)), key=lambda t: (booking(t), -t.values[0], t.number))


def fits(trial: FrozenTrial, budget: Budget, safety_margin: float) -> bool:
    """The gate's rule: the booking plus the margin kept free of the budget is within the budget."""
    return booking(trial) + int(safety_margin * budget.bytes) <= budget.bytes


def budget_file(budget: Budget) -> str:
    return f"{budget.bytes / GIB:g}gib.yaml"


def entry(trial: FrozenTrial, folder: Path) -> dict:
    """One trial of the index: what it scored, booked, trained and (when evaluated) scored on test."""
    scores = Path("eval") / str(trial.number) / "scores.json"
    out = {"trial": trial.number, "si_sdr": round(float(trial.values[0]), 4),
           "booking_gib": round(booking(trial) / GIB, 4), "verdict": trial.user_attrs.get("verdict"),
           "levers": trial.user_attrs.get("levers", []),
           "preset": f"trials/{trial.number}.preset.yaml", "model": f"trials/{trial.number}/model.pt",
           "scores": str(scores) if (folder / scores).is_file() else None}
    return out


def _write_preset(folder: Path, trial: FrozenTrial, path: Path, why: str) -> None:
    source = folder / "trials" / f"{trial.number}.preset.yaml"
    write_text(path, f"# trial {trial.number} of study {folder.name}: {why}; validation SI-SDR "
                     f"{trial.values[0]:.3f} dB, booked {booking(trial) / GIB:.3f} GiB\n" + source.read_text())


def _replace_folder(folder: Path, keep: set[str], study: str) -> None:
    """Drop the presets of an earlier write that the study no longer selects: only files this
    writer wrote (their first line names a trial of `study`, `_write_preset`); anything else in
    the folder is the user's and stays."""
    if folder.is_dir():
        for path in folder.glob("*.yaml"):
            if path.name not in keep and _written_here(path, study):
                path.unlink()


def _written_here(path: Path, study: str) -> bool:
    try:
        with path.open(encoding="utf-8", errors="replace") as f:
            first = f.readline(512)
    except OSError:
        return False
    return first.startswith("# trial ") and f" of study {study}: " in first


def write(study: optuna.Study, objectives: list[str], folder: Path, cfg: dict, device: str) -> dict:
    """pareto/, best/ and best.json from the study (see the module docstring); returns the index."""
    trials = [t for t in done(study) if (folder / "trials" / f"{t.number}.preset.yaml").is_file()]
    margin = float(cfg["estimate"]["safety_margin"])
    budgets = parse_budgets(list(cfg["fit_matrix"]["gpus"]), f"{cfg.get('_source', 'config')}: fit_matrix.gpus")
    best = max(trials, key=lambda t: (t.values[0], -t.number)) if trials else None
    index: dict = {"study": study.study_name, "objectives": list(objectives), "device": device,
                   "safety_margin": margin, "best": entry(best, folder) if best else None,
                   "budgets": [], "pareto": []}
    kept = set()
    for budget in budgets:
        fitting = [t for t in trials if fits(t, budget, margin)]
        chosen = max(fitting, key=lambda t: (t.values[0], -t.number)) if fitting else None
        item = {"label": budget.label, "budget_gib": round(budget.bytes / GIB, 4), "gpu": budget.gpu}
        if chosen is None:
            item.update(trial=None, reason=f"no feasible COMPLETE trial books less than {1 - margin:.0%} of "
                                           f"{budget.bytes / GIB:g} GiB")
        else:
            name = budget_file(budget)
            _write_preset(folder, chosen, folder / "best" / name, f"the best trial that fits {budget.label}")
            kept.add(name)
            item.update(entry(chosen, folder), preset=f"best/{name}")
        index["budgets"].append(item)
    _replace_folder(folder / "best", kept, folder.name)
    kept = set()
    if len(objectives) == 2:
        for trial in pareto(trials):
            name = f"{trial.number}.yaml"
            _write_preset(folder, trial, folder / "pareto" / name, "on the Pareto front")
            kept.add(name)
            index["pareto"].append({**entry(trial, folder), "preset": f"pareto/{name}"})
    _replace_folder(folder / "pareto", kept, folder.name)
    write_json(folder / INDEX, index)
    return index


def to_evaluate(index: dict) -> list[int]:
    """The trials evaluated on the test set: the best one and each budget's best, each once."""
    numbers = [index["best"]["trial"]] if index["best"] else []
    numbers += [b["trial"] for b in index["budgets"] if b.get("trial") is not None]
    return list(dict.fromkeys(numbers))


def evaluate(config_file: str, folder: Path, number: int, data: Path) -> str | None:
    """`tiersep evaluate` of trial `number` into eval/<n>/ (its log eval/<n>.log), as a tier is
    evaluated; None when done (or done before), else the one-line reason it failed."""
    out = folder / "eval" / str(number)
    if (out / "scores.json").is_file():
        return None
    model = folder / "trials" / str(number) / "model.pt"
    if not model.is_file():
        return f"trial {number} has no model.pt (train.export: none?)"
    out.parent.mkdir(parents=True, exist_ok=True)
    log = folder / "eval" / f"{number}.log"
    cmd = [sys.executable, "-m", command_module(), "evaluate", "--config", config_file,
           "--preset", str(folder / "trials" / f"{number}.preset.yaml"), "--model", str(model),
           "--data", str(data), "--out", str(out)]
    with open(log, "w") as f:
        code = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL).returncode
    if code == 0:
        return None
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return f"tiersep evaluate of trial {number} ended with exit {code}: {lines[-1] if lines else 'no output'} ({log})"
