"""Crash safety of `tiersep train` as a real process: SIGKILL + --resume gives bit-identical weights,
SIGTERM (cluster preemption) writes a checkpoint and exits 75."""
from __future__ import annotations

import json
import random
import signal
import time

import pytest
import torch

from test_train_support import cli_train, make_workspace, metrics_rows
from tiersep.train import trainer

# 1 layer x 8 with dropout 0.1; checkpoints every 3 steps, validation every 4 (so a kill can land
# between a validation and the next checkpoint).
SETS = ["--set", "train.steps=24", "--set", "train.checkpoint_every=3", "--set", "train.validate_every=4"]


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    return make_workspace(tmp_path_factory.mktemp("crash_ws"))


def wait_for_rows(proc, out, rows: int, timeout: float = 120.0) -> int:
    """Poll metrics.csv until it has `rows` rows (returns the count seen) or the process ends."""
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        seen = len(metrics_rows(out))
        if seen >= rows:
            return seen
        time.sleep(0.005)
    raise AssertionError(f"{out}: process ended (rc {proc.poll()}) or timed out before step {rows}")


def test_sigkill_then_resume_gives_identical_weights(ws, tmp_path):
    full = tmp_path / "uninterrupted"
    assert cli_train(ws, full, *SETS).wait(timeout=300) == 0

    # Killed at a random step (a few steps before the end, so the kill lands mid-run).
    killed = tmp_path / "killed"
    kill_at = random.Random().randint(5, 18)
    proc = cli_train(ws, killed, *SETS)
    wait_for_rows(proc, killed, kill_at)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL
    assert not (killed / "model.pt").exists() and not (killed / "run.json").exists()
    checkpoint_step = torch.load(killed / "checkpoints" / "last.pt", weights_only=False)["step"]
    assert 3 <= checkpoint_step < 24

    assert cli_train(ws, killed, *SETS, "--resume").wait(timeout=300) == 0
    run = json.loads((killed / "run.json").read_text())
    assert run["resumed_from"] == checkpoint_step and run["steps"] == 24

    a = torch.load(full / "checkpoints" / "last.pt", weights_only=False)
    b = torch.load(killed / "checkpoints" / "last.pt", weights_only=False)
    assert a["model"].keys() == b["model"].keys()
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key
    for sa, sb in zip(a["optimizer"]["state"].values(), b["optimizer"]["state"].values()):
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert torch.equal(a["rng"]["torch"], b["rng"]["torch"])
    ma = torch.load(full / "model.pt", weights_only=False)
    mb = torch.load(killed / "model.pt", weights_only=False)
    assert ma["step"] == mb["step"] and all(torch.equal(ma["model"][k], mb["model"][k]) for k in ma["model"])
    # The continued metrics.csv has every step once, with the same losses and validation scores.
    rows_a, rows_b = metrics_rows(full), metrics_rows(killed)
    assert [r["step"] for r in rows_b] == [str(s) for s in range(1, 25)]
    for ra, rb in zip(rows_a, rows_b):
        assert (ra["loss"], ra["val_si_sdr"]) == (rb["loss"], rb["val_si_sdr"]), ra["step"]
    assert len((killed / "memory.csv").read_text().splitlines()) == 25


def test_sigterm_writes_a_checkpoint_and_exits_75(ws, tmp_path):
    out = tmp_path / "preempted"
    many = ["--set", "train.steps=100000", "--set", "train.checkpoint_every=1000",
            "--set", "train.validate_every=1000"]
    proc = cli_train(ws, out, *many)
    wait_for_rows(proc, out, 3)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == trainer.EXIT_PREEMPTED
    state = torch.load(out / "checkpoints" / "last.pt", weights_only=False)
    rows = metrics_rows(out)
    assert state["step"] == int(rows[-1]["step"]) >= 3  # checkpoint at the step boundary reached
    assert not (out / "model.pt").exists() and not (out / "run.json").exists()
    assert "SIGTERM" in (out.parent / "preempted.log").read_text()

    # SIGUSR1 (SLURM's --signal) does the same; the run continues from where it stopped.
    proc = cli_train(ws, out, *many, "--resume")
    wait_for_rows(proc, out, state["step"] + 2)
    proc.send_signal(signal.SIGUSR1)
    assert proc.wait(timeout=60) == trainer.EXIT_PREEMPTED
    again = torch.load(out / "checkpoints" / "last.pt", weights_only=False)
    assert again["step"] > state["step"]
    steps = [int(r["step"]) for r in metrics_rows(out)]
    assert steps == list(range(1, again["step"] + 1))  # no duplicate or missing rows
