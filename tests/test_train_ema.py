"""train.ema: the EMA weights against a hand-computed average of the raw ones, best.pt/model.pt's
choice between raw and EMA, and an EMA run killed and resumed bit for bit. (The estimate's EMA copy:
tests/test_memory_estimate.py.)"""
from __future__ import annotations

import csv
import json
import random
import signal

import pytest
import torch

from test_train_crash import wait_for_rows
from conftest import one_torch_thread
from test_train_support import cli_train, make_workspace, metrics_rows, tiny_preset
from tiersep.train import loop, trainer

DECAY, EVERY, STEPS = 0.8, 2, 10


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    with one_torch_thread():
        yield make_workspace(tmp_path_factory.mktemp("ema_ws"))


def test_ema_weights_are_the_average_of_the_raw_ones_and_best_keeps_the_better(ws, tmp_path, monkeypatch):
    preset = tiny_preset(**{"train.steps": STEPS, "train.validate_every": 5, "train.checkpoint_every": 5,
                            "train.ema": {"decay": DECAY, "every": EVERY}})
    raw = []   # the raw weights before the first step and after each one, as the trainer left them

    def recording_step(model, *args, **kwargs):
        unwrapped = getattr(model, "module", model)
        if not raw:
            raw.append({k: v.detach().double().clone() for k, v in unwrapped.named_parameters()})
        out = loop_train_step(model, *args, **kwargs)
        raw.append({k: v.detach().double().clone() for k, v in unwrapped.named_parameters()})
        return out

    loop_train_step = loop.train_step
    monkeypatch.setattr(loop, "train_step", recording_step)
    out = tmp_path / "run"
    assert trainer.train(ws["cfg"], preset, ws["data"], out) == 0
    assert len(raw) == STEPS + 1

    # by hand, in float64: e_0 = w_0; after every EVERY-th step e = DECAY * e + (1 - DECAY) * w
    expected = dict(raw[0])
    for step in range(1, STEPS + 1):
        if step % EVERY == 0:
            expected = {k: DECAY * expected[k] + (1 - DECAY) * raw[step][k] for k in expected}
    last = torch.load(out / "checkpoints" / "last.pt", weights_only=True)
    averaged = last["ema"]["params"]
    assert averaged.keys() == expected.keys() and last["ema"]["steps"] == STEPS
    for key in expected:
        torch.testing.assert_close(averaged[key].double(), expected[key], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(last["model"][key].double(), raw[-1][key], rtol=0, atol=0)
    assert any(not torch.allclose(averaged[k].double(), raw[-1][k]) for k in expected)  # not the raw weights

    # both scored at each validation; best.pt and model.pt hold the better of the two, and say which
    with open(out / "metrics.csv", newline="") as f:
        scored = [r for r in csv.DictReader(f) if r["val_si_sdr"]]
    assert [int(r["step"]) for r in scored] == [5, 10] and all(r["val_si_sdr_ema"] for r in scored)
    top = max([(float(r["val_si_sdr"]), int(r["step"]), "raw") for r in scored]
              + [(float(r["val_si_sdr_ema"]), int(r["step"]), "ema") for r in scored])
    best = torch.load(out / "checkpoints" / "best.pt", weights_only=True)
    assert (best["best"]["step"], best["best"]["weights"]) == (top[1], top[2])
    assert best["best"]["val_si_sdr"] == pytest.approx(top[0], rel=1e-5)
    exported = torch.load(out / "model.pt", weights_only=True)
    held = best["ema"]["params"] if top[2] == "ema" else best["model"]
    assert exported["weights"] == top[2] and exported["step"] == top[1]
    assert all(torch.equal(exported["model"][k], held[k]) for k in held)
    run = json.loads((out / "run.json").read_text())
    assert run["exported"]["holds"] == top[2] and run["best"]["weights"] == top[2]
    assert run["ema"] == {"decay": DECAY, "every": EVERY}
    assert run["estimate"]["ema"]["copy_bytes"] > 0


def test_an_ema_run_without_validation_exports_its_last_ema_weights(ws, tmp_path):
    preset = tiny_preset(**{"train.steps": 3, "train.validate_every": 100, "train.checkpoint_every": 100,
                            "train.export": "last", "train.ema": {"decay": 0.5, "every": 1}})
    out = tmp_path / "run"
    assert trainer.train(ws["cfg"], preset, ws["data"], out) == 0
    last = torch.load(out / "checkpoints" / "last.pt", weights_only=True)
    exported = torch.load(out / "model.pt", weights_only=True)
    assert exported["weights"] == "ema"
    assert all(torch.equal(exported["model"][k], v) for k, v in last["ema"]["params"].items())


def test_a_plain_run_says_it_holds_raw_weights(ws, tmp_path):
    out = tmp_path / "run"
    preset = tiny_preset(**{"train.steps": 2, "train.validate_every": 2, "train.checkpoint_every": 2})
    assert trainer.train(ws["cfg"], preset, ws["data"], out) == 0
    assert torch.load(out / "checkpoints" / "last.pt", weights_only=True)["ema"] is None
    assert torch.load(out / "model.pt", weights_only=True)["weights"] == "raw"
    with open(out / "metrics.csv", newline="") as f:
        assert all(r["val_si_sdr_ema"] == "" for r in csv.DictReader(f))


# validation every 4 steps, checkpoints every 3: a kill can land between a validation and a checkpoint
SETS = ["--set", "train.steps=16", "--set", "train.checkpoint_every=3", "--set", "train.validate_every=4",
        "--set", "train.ema={decay: 0.9, every: 2}"]


def test_sigkill_then_resume_gives_identical_ema_weights(ws, tmp_path):
    full = tmp_path / "uninterrupted"
    assert cli_train(ws, full, *SETS).wait(timeout=300) == 0
    killed = tmp_path / "killed"
    proc = cli_train(ws, killed, *SETS)
    wait_for_rows(proc, killed, random.Random().randint(5, 12))
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL
    resumed_from = torch.load(killed / "checkpoints" / "last.pt", weights_only=True)["step"]
    assert 3 <= resumed_from < 16
    assert cli_train(ws, killed, *SETS, "--resume").wait(timeout=300) == 0
    assert json.loads((killed / "run.json").read_text())["resumed_from"] == resumed_from

    a = torch.load(full / "checkpoints" / "last.pt", weights_only=True)
    b = torch.load(killed / "checkpoints" / "last.pt", weights_only=True)
    assert a["ema"]["steps"] == b["ema"]["steps"] == 16
    for state in ("model", "ema"):
        tensors_a = a[state] if state == "model" else a[state]["params"]
        tensors_b = b[state] if state == "model" else b[state]["params"]
        assert tensors_a.keys() == tensors_b.keys()
        assert all(torch.equal(tensors_a[k], tensors_b[k]) for k in tensors_a), state
    ma, mb = (torch.load(d / "model.pt", weights_only=True) for d in (full, killed))
    assert (ma["step"], ma["weights"]) == (mb["step"], mb["weights"])
    assert all(torch.equal(ma["model"][k], mb["model"][k]) for k in ma["model"])
    columns = ("loss", "val_si_sdr", "val_si_sdr_ema", "val_loss_ema")
    assert [[r[c] for c in columns] for r in metrics_rows(full)] == \
        [[r[c] for c in columns] for r in metrics_rows(killed)]


def test_an_estimate_made_without_ema_is_not_trusted_for_an_ema_run(tmp_path):
    """A train job given an estimate file re-estimates when the file did not book the EMA copy."""
    from tiersep.io import write_json
    from tiersep.memory import estimate
    from tiersep.train.plan import usable_estimate

    plain = tiny_preset()
    ema = tiny_preset(**{"train.ema": {"decay": 0.999, "every": 1}})
    path = tmp_path / "estimate.json"
    write_json(path, estimate(plain, "trace", "cpu"))
    cpu, allocator = torch.device("cpu"), {"expandable_segments": False}
    assert usable_estimate(path, plain, cpu, allocator, False)[0] is not None
    record, why = usable_estimate(path, ema, cpu, allocator, False)
    assert record is None and why == f"{path} was made without train.ema; estimating again"
