"""Shared pieces of the search tests (no tests here): a workspace with a tiny prepared dataset, a
short cpu_tiny base preset, a config with a `search:` section, and readers of the study."""
from __future__ import annotations

import csv
import os
from pathlib import Path

import pytest
import yaml

from test_train_support import CPU_TINY_FILE, make_workspace
from tiersep import config as C

# cpu_tiny, short: 0.5 s segments, 12 steps, a validation every 4 and a checkpoint every 2.
BASE_TRAIN = {"steps": 12, "validate_every": 4, "checkpoint_every": 2, "validate_segments": 1,
              "warmup_steps": 2, "export": "last"}
STEP_ENV = {"OMP_NUM_THREADS": "1"}


def search_workspace(root: Path) -> dict:
    ws = make_workspace(root)
    base = yaml.safe_load(open(CPU_TINY_FILE))
    base["name"] = "search_base"
    base["audio"]["segment_samples"] = 4000
    base["train"].update(BASE_TRAIN)
    ws["base_file"] = root / "search_base.yaml"
    ws["base_file"].write_text(yaml.safe_dump(base, sort_keys=False))
    ws["raw"] = yaml.safe_load(ws["config_file"].read_text())
    return ws


def write_search_config(ws: dict, name: str, **search) -> Path:
    """A config file `name`.yaml in the workspace with results under results-<name>/ and `search`.
    The study's test-set evaluation is off unless asked for (evaluate=True): it is tested in
    tests/test_search_report.py, and it tripled the other search tests' time."""
    raw = dict(ws["raw"])
    raw["results_dir"] = str(ws["root"] / f"results-{name}")
    raw["search"] = {"preset": str(ws["base_file"]), "evaluate": False, **search}
    path = ws["root"] / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def base_preset(ws: dict, **sets) -> dict:
    """The base preset with {dotted field: value} `sets`."""
    preset = C.load_preset(str(ws["base_file"]))
    for key, value in sets.items():
        preset = C.set_field(preset, key, value)
    return C.validate(preset, "preset.schema.yaml", "test")


def fresh_allowance() -> dict:
    """Measure the CPU booking's process allowance now, for this process and for the cache file the
    search's processes read (memory/cpu_booking.py: a figure is kept 15 minutes, then measured
    again, and moves by up to a few hundred MiB between measurements). A module whose budgets sit
    within that of a booking calls this first, so its bookings and its trials' gates read one
    figure: the pytest worker had kept an older one in memory, and a trial started 15 minutes after
    the file's measurement measured again (CI, 2026-11-27: every trial of test_search_report's
    study INFEASIBLE, with a budget 1 % over the booking)."""
    from tiersep.memory import cpu_booking

    cache = cpu_booking.allowance_cache_file()
    if cache is not None:
        cache.unlink(missing_ok=True)
    cpu_booking.process_allowance.cache_clear()
    allowance = cpu_booking.process_allowance()
    assert allowance["probe_peak_bytes"] is not None, allowance["source"]
    return allowance


def booking(ws: dict, sets: dict, tight: bool = False) -> int:
    """The CPU booking the fit gate makes for the base preset with `sets` ({dotted field: value}):
    under a roomy budget (glibc's own malloc), or with `tight` under one it cannot meet, where the
    gate books the tuned malloc's smaller figure (as it does whenever glibc's own does not fit)."""
    from tiersep.memory import DoesNotFit, GateSettings, gate

    preset = base_preset(ws, **sets)
    if not tight:
        return int(gate(preset, "cpu", 64 * 2**30, GateSettings(0.08, "auto"))["gate_required_bytes"])
    with pytest.raises(DoesNotFit) as refused:
        gate(preset, "cpu", 1, GateSettings(0.08, "auto"))
    assert refused.value.estimate["cpu_process"]["malloc"] == "tuned"
    return int(refused.value.estimate["gate_required_bytes"])


def budget_between(fits: int, does_not: int, margin: float = 0.08) -> float:
    """A budget in GiB that a booking of `fits` passes with the margin and `does_not` fails."""
    low, high = fits / (1 - margin), does_not / (1 - margin)
    assert low < high, (fits, does_not)
    return (low + high) / 2 / 2**30


def trials_csv(folder: Path) -> list[dict]:
    with open(folder / "trials.csv", newline="") as f:
        return list(csv.DictReader(f))


def load_study(folder: Path, name: str):
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    storage = JournalStorage(JournalFileBackend(str(folder / "journal.log")))
    return optuna.load_study(study_name=name, storage=storage)


def env() -> dict:
    return {**os.environ, **STEP_ENV}
