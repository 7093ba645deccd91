"""A 3-trial sweep through the real Snakemake: each trial its own train job (own process), so each
starts from the same memory baseline; one trial hits an injected out-of-memory error and Snakemake's
`retries` reruns it with the downshifted micro-batch."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import yaml

from conftest import REPO, copy_workflow, run_snakemake
from tiersep import config as C
from tiersep.train.sweep import expand_trials

CONFIG = {
    "data": {"source": "synthetic",
             "synthetic": {"seed": 1, "sample_rate": 16000, "train_tracks": 3, "valid_tracks": 1,
                           "test_tracks": 1, "track_seconds": 3}},
    "presets_dir": "tests/configs/presets",
    "tiers": ["test_tiny"],
    "estimate_tiers": [],
    "budget_gib": 24,
    "sweep": {"presets": ["test_tiny"], "grid": {"train.lr": [1.0e-3], "train.seed": [0, 1, 2]}},
}
OOM_TRIAL = "test_tiny--lr1e-3--seed1"


def spread(values) -> float:
    return (max(values) - min(values)) / max(values)


@pytest.mark.slow
def test_three_trial_sweep_in_separate_processes(tmp_path):
    """The OOM is a mock (TIERSEP_INJECT_OOM raises torch.OutOfMemoryError with CUDA's message):
    a real GPU out-of-memory error cannot happen on this CPU-only machine."""
    wf = copy_workflow(tmp_path / "wf")
    if (REPO / "envs").is_dir() and not (wf / "envs").exists():  # rules name envs/ (conda directive)
        shutil.copytree(REPO / "envs", wf / "envs")
    (wf / "sweep.yaml").write_text(yaml.safe_dump(CONFIG))
    cfg = C.load_config(wf / "sweep.yaml", {"presets_dir": str(wf / "tests/configs/presets")})
    trials = list(expand_trials(cfg))
    assert trials == ["test_tiny--lr1e-3--seed0", OOM_TRIAL, "test_tiny--lr1e-3--seed2"]
    targets = [f"results/train/{t}/outcome.json" for t in trials]   # the train checkpoint's output
    proc = run_snakemake(wf, *targets, "--cores", "1", "--configfile", "sweep.yaml", timeout=400,
                         env={"TIERSEP_INJECT_OOM": f"step=1,max_batch=1,preset={OOM_TRIAL}"})
    runs = {t: json.loads((wf / "results" / "train" / t / "run.json").read_text()) for t in trials}

    assert len({r["pid"] for r in runs.values()}) == 3  # three processes
    assert [r["preset"] for r in runs.values()] == trials
    assert [r["seed"] for r in runs.values()] == [0, 1, 2]
    # Same start-of-job baseline: each job's own footprint at start (nothing inherited from an
    # earlier trial), and every trial's process is gone, so the OS has released its memory. The
    # free memory each saw (start_free_bytes) is the whole machine's RAM on a CPU, moved by any
    # other work on the machine: it is no isolation figure here (bench/sweep_isolation.py reports
    # it; on a GPU it is the device's free memory).
    assert spread([r["start_process_bytes"] for r in runs.values()]) < 0.10
    for r in runs.values():
        with pytest.raises(ProcessLookupError):
            os.kill(r["pid"], 0)

    retried = runs[OOM_TRIAL]
    assert (retried["attempt"], retried["batch_size"], retried["grad_accum"]) == (2, 1, 2)
    assert retried["downshifted_from"] == {"batch_size": 2, "grad_accum": 1}
    assert retried["recovered_from"]["kind"] == "oom"
    assert not (wf / "results" / "train" / OOM_TRIAL / "failure.json").exists()
    assert all(runs[t]["attempt"] == 1 and runs[t]["batch_size"] == 2 for t in trials if t != OOM_TRIAL)
    assert proc.stdout.count("Error in rule train") == 1  # the one failed attempt, then its retry
