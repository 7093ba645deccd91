"""`sweep:` is a thin alias of the search (issue 30: "do not keep two engines"): config.sweep_as_search
reads it as a `search:` with the grid sampler, and the real `tiersep search` runs it: every grid
point once, each estimated before launch and trained in its own `tiersep train` process. No mocks."""
from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from test_search_support import env, load_study, search_workspace, trials_csv, write_search_config
from test_train_support import REPO
from tiersep import config as C

GRID = {"train.lr": [1.0e-3, 3.0e-3], "train.seed": [0]}   # 2 x 1 grid points


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    return search_workspace(tmp_path_factory.mktemp("sweep"))


def write_sweep_config(ws: dict, name: str, **sweep) -> Path:
    """The search tests' config file `name`.yaml (write_search_config) with `sweep` instead of `search`."""
    path = write_search_config(ws, name, space={})
    raw = yaml.safe_load(path.read_text())
    del raw["search"]
    raw["sweep"] = {"presets": [str(ws["base_file"])], "grid": GRID, **sweep}
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def search(config) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tiersep.cli", "search", "--config", str(config)],
                          capture_output=True, text=True, cwd=REPO, env=env(), timeout=600)


def test_a_sweep_is_read_as_a_grid_search(ws):
    cfg = C.load_config(write_sweep_config(ws, "read"))
    assert cfg["sweep"] is None   # the search is all that is left: a merged config read again is the same
    s = cfg["search"]
    assert (s["preset"], s["sampler"], s["pruner"], s["trials"], s["study"]) == \
        (str(ws["base_file"]), "grid", "none", 2, "sweep")
    assert {k: d["choices"] for k, d in s["space"].items()} == GRID
    # the rest is the schema's defaults, filled as for a search written by hand
    assert (s["budget_gib"], s["on_oversize"], s["parallel"], s["evaluate"]) == ("auto", "repair", 1, True)
    merged = ws["root"] / "merged.yaml"
    merged.write_text(yaml.safe_dump({k: v for k, v in cfg.items() if not k.startswith("_")}))
    assert {k: v for k, v in C.load_config(merged).items() if k != "_source"} == \
        {k: v for k, v in cfg.items() if k != "_source"}


@pytest.mark.parametrize("case, expected", [
    ("presets", "sweep.presets: one preset per sweep"),
    ("both", "sweep: a sweep is a grid search; give sweep or search, not both"),
])
def test_what_the_alias_cannot_say_ends_in_one_line(ws, case, expected):
    path = write_sweep_config(ws, case)
    raw = yaml.safe_load(path.read_text())
    if case == "presets":
        raw["sweep"]["presets"] = [str(ws["base_file"]), "cpu_tiny"]
    else:
        raw["search"] = {"preset": "cpu_tiny", "space": {"train.lr": {"choices": [1.0e-3]}}}
    path.write_text(yaml.safe_dump(raw))
    done = search(path)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and done.stderr.startswith(f"tiersep search: error: {path}: {expected}")
    assert not (ws["root"] / f"results-{case}").exists()   # refused before any study or trial


@pytest.mark.slow   # two real training processes and the best trial's test evaluation: ~1 minute on 2 cores
def test_a_two_point_sweep_runs_each_grid_point_once_in_its_own_process(ws):
    done = search(write_sweep_config(ws, "grid"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "grid sampler, no pruner" in done.stderr
    folder = ws["root"] / "results-grid" / "search" / "sweep"
    rows = trials_csv(folder)
    assert [r["state"] for r in rows] == ["COMPLETE", "COMPLETE"], rows
    assert all(r["verdict"] == "fits" and float(r["estimate_gib"]) > 0 and int(r["steps"]) == 12 for r in rows)
    study = load_study(folder, "sweep")
    # every grid point exactly once, as Optuna's grid sampler handed it out
    assert sorted(tuple(t.params[k] for k in GRID) for t in study.trials) == sorted(itertools.product(*GRID.values()))
    assert all("grid_id" in t.system_attrs for t in study.trials)
    pids = [t.user_attrs["pid"] for t in study.trials]
    assert len(set(pids)) == 2 and os.getpid() not in pids
    for trial in study.trials:
        run_dir = folder / "trials" / str(trial.number)
        trained = yaml.safe_load((folder / "trials" / f"{trial.number}.preset.yaml").read_text())
        assert trained["train"]["lr"] == trial.params["train.lr"]
        assert (run_dir / "metrics.csv").is_file()
        with pytest.raises(ProcessLookupError):   # each trial's process has ended
            os.kill(trial.user_attrs["pid"], 0)
    # the search's end: the best trial is evaluated on the test set, as a sweep's trials were
    assert (folder / "best.yaml").is_file() and list((folder / "eval").glob("*/scores.json"))
