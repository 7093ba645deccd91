"""A search trial's own gate books the figure it was admitted with.

The orchestrator admits a trial in its own process (search/admit.py) and writes the admission's
estimate for the trial's `tiersep train --estimate`. On a CPU that record's booking holds the
process allowance measured on the machine, which moves by a few hundred MiB between measurements
(memory/cpu_booking.py); the trial's train gate must book the record's figure, not measure another
that could refuse a trial the orchestrator admitted.
"""
from __future__ import annotations

from pathlib import Path

import torch

from test_train_support import REPO, tiny_preset
from tiersep import config as C
from tiersep.io import write_json
from tiersep.memory import cpu_booking, estimate
from tiersep.train.job import TrainJob
from tiersep.train.plan import plan_run


def test_a_trial_gates_with_the_allowance_of_its_admission(tmp_path, monkeypatch):
    preset = tiny_preset()
    admitted = estimate(preset, "trace", "cpu")
    moved = dict(admitted["cpu_process"], process_bytes=admitted["cpu_process"]["process_bytes"] + 64 * 2**20)
    admitted["cpu_process"] = moved          # a figure no measurement here gives: it must come from the file
    path = tmp_path / "estimate.json"
    write_json(path, {**admitted, "preset": preset["name"]})

    def measured(*args, **kwargs):
        raise AssertionError("the trial measured its own process allowance")

    monkeypatch.setattr(cpu_booking, "process_allowance", measured)
    monkeypatch.setattr(cpu_booking, "measure_process_allowance", measured)
    cfg = C.load_config(REPO / "config" / "config.yaml")
    plan = plan_run(TrainJob(cfg, preset, tmp_path / "data", tmp_path / "run", estimate_path=path))
    assert plan.device == torch.device("cpu") and plan.refusal is None
    assert plan.estimate["cpu_process"]["process_bytes"] == moved["process_bytes"]
    assert plan.estimate["gate_required_bytes"] == cpu_booking.choose_malloc(
        moved, plan.budget, plan.gate_settings.safety_margin)["rss_bytes"]
