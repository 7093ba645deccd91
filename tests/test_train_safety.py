"""A finished or changed run is never destroyed, one trainer per run folder, no code runs from a
checkpoint, and Ctrl-C is a stop, not a loss (issue 19). Real `tiersep train` processes on a tiny
real preset and dataset."""
from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from test_train_crash import wait_for_rows
from test_train_support import REPO, cli_train, make_workspace, metrics_rows
from tiersep.train import checkpoint as ckpt
from tiersep.train import trainer

# A constant lr without warm-up: then a run trained 5 steps and extended to 8 is the same
# computation as a run of 8 (batches are a pure function of seed and step).
CONSTANT = ["--set", "train.schedule=constant", "--set", "train.warmup_steps=0",
            "--set", "train.checkpoint_every=2", "--set", "train.validate_every=4"]


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    return make_workspace(tmp_path_factory.mktemp("safety_ws"))


def run(ws, out, *args, timeout=300) -> tuple[int, str]:
    """Run `tiersep train` to the end; (exit code, its log)."""
    log = Path(str(out) + ".log")
    start = log.stat().st_size if log.is_file() else 0
    code = cli_train(ws, out, *args).wait(timeout=timeout)
    return code, log.read_bytes()[start:].decode(errors="replace")


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def weights(path: Path) -> dict:
    return torch.load(path, weights_only=True)["model"]


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under `folder` (relative path -> sha256)."""
    return {str(p.relative_to(folder)): digest(p) for p in sorted(folder.rglob("*")) if p.is_file()}


def last_line(log: str) -> str:
    return log.strip().splitlines()[-1]


# ---------------------------------------------------------------------------------------------
# Training longer keeps and extends the model; a changed preset moves the old run aside
# ---------------------------------------------------------------------------------------------
def test_train_longer_extends_and_a_changed_preset_moves_the_run_aside(ws, tmp_path):
    straight = tmp_path / "straight"
    assert run(ws, straight, *CONSTANT, "--set", "train.steps=8")[0] == 0

    out = tmp_path / "run"
    assert run(ws, out, *CONSTANT, "--set", "train.steps=5", "--resume")[0] == 0
    short_model = digest(out / "model.pt")

    # train.steps 5 -> 8: the run continues from step 5, and the 5-step model is kept
    code, log = run(ws, out, *CONSTANT, "--set", "train.steps=8", "--resume")
    assert code == 0, log
    assert "training longer" in log and "continues from step 5" in log and "Traceback" not in log
    record = json.loads((out / "run.json").read_text())
    assert record["steps"] == 8 and record["resumed_from"] == 5
    assert record["extended_from"] == [{"steps": 5, "step": 5}]
    kept = [p for p in (out / "previous").iterdir()]
    assert len(kept) == 1 and digest(kept[0] / "model.pt") == short_model
    assert json.loads((kept[0] / "moved-aside.json").read_text())["reason"].startswith("train.steps grew")
    # ... and it ends where an uninterrupted 8-step run ends
    assert same(weights(out / "checkpoints" / "last.pt"), weights(straight / "checkpoints" / "last.pt"))
    assert [r["step"] for r in metrics_rows(out)] == [str(s) for s in range(1, 9)]

    # any other change (the lr): the finished run is moved aside whole, and a new one starts
    before = snapshot(out)
    code, log = run(ws, out, *CONSTANT, "--set", "train.steps=8", "--set", "train.lr=1e-3", "--resume")
    assert code == 0, log
    assert "differs in train.lr" in log and "the earlier run is kept in" in log
    record = json.loads((out / "run.json").read_text())
    assert record["resumed_from"] is None and record["lr"] == 1e-3
    moved = Path(record["moved_aside"]["to"])
    assert moved.parent == out / "previous"
    for name in ("model.pt", "run.json", "metrics.csv", "memory.csv", "checkpoints/last.pt", "checkpoints/best.pt"):
        assert digest(moved / name) == before[name], name          # byte for byte what was there
    assert sorted(p.name for p in (out / "previous").iterdir()) == sorted([kept[0].name, moved.name])


def test_a_new_run_without_resume_keeps_the_finished_one(ws, tmp_path):
    out = tmp_path / "run"
    assert run(ws, out, *CONSTANT, "--set", "train.steps=2")[0] == 0
    model = digest(out / "model.pt")
    code, log = run(ws, out, *CONSTANT, "--set", "train.steps=2")
    assert code == 0 and "a new run was asked for" in log
    (moved,) = (out / "previous").iterdir()
    assert digest(moved / "model.pt") == model


# ---------------------------------------------------------------------------------------------
# One writer per run folder
# ---------------------------------------------------------------------------------------------
def test_a_second_trainer_is_refused_while_the_first_finishes_untouched(ws, tmp_path):
    out = tmp_path / "shared"
    first = cli_train(ws, out, "--set", "train.steps=40", "--set", "train.checkpoint_every=5")
    wait_for_rows(first, out, 2)
    began = time.time()
    second_out = tmp_path / "second"   # its own log file, the same run folder
    proc = subprocess.run([sys.executable, "-m", "tiersep.cli", "train", "--config", str(ws["config_file"]),
                           "--preset", "train_test_tiny", "--data", str(ws["data"]), "--out", str(out),
                           "--set", "train.seed=1"], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 5, proc.stderr
    assert time.time() - began < 60
    line = last_line(proc.stderr)
    assert f"in use by pid {first.pid} on " in line and str(out) in line and "Traceback" not in proc.stderr
    assert first.poll() is None, "the second trainer must not disturb the first"
    assert first.wait(timeout=300) == 0
    record = json.loads((out / "run.json").read_text())
    assert record["pid"] == first.pid and record["seed"] == 0 and record["steps"] == 40
    assert [r["step"] for r in metrics_rows(out)] == [str(s) for s in range(1, 41)]
    assert not second_out.exists()


# ---------------------------------------------------------------------------------------------
# Output folders that are not tiersep's
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("stage", ["train", "evaluate"])
def test_a_users_folder_is_refused_as_output(ws, tmp_path, stage):
    folder = tmp_path / "myproject"
    (folder / "src").mkdir(parents=True)
    (folder / "src" / "thesis.tex").write_text("\\section{Results}\n")
    before = snapshot(folder)
    if stage == "train":
        args = ["--preset", "train_test_tiny", "--data", str(ws["data"])]
    else:
        model = tmp_path / "model.pt"
        model.write_bytes(b"not needed: the folder is refused first")
        args = ["--preset", "train_test_tiny", "--model", str(model), "--data", str(ws["data"])]
    proc = subprocess.run([sys.executable, "-m", "tiersep.cli", stage, "--config", str(ws["config_file"]),
                           *args, "--out", str(folder)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "holds files tiersep did not make ('src')" in last_line(proc.stderr)
    assert "Traceback" not in proc.stderr
    assert snapshot(folder) == before and sorted(p.name for p in folder.iterdir()) == ["src"]


# ---------------------------------------------------------------------------------------------
# No code runs from a checkpoint or model file
# ---------------------------------------------------------------------------------------------
class Payload:
    """What a malicious .pt carries: unpickling it calls os.system."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.fixture(scope="module")
def finished(ws, tmp_path_factory):
    out = tmp_path_factory.mktemp("finished") / "run"
    assert run(ws, out, *CONSTANT, "--set", "train.steps=4")[0] == 0
    return out


@pytest.mark.parametrize("target", ["last.pt", "best.pt", "last.prev.pt", "model.pt"])
def test_a_pickle_payload_never_runs(ws, finished, tmp_path, target):
    import shutil

    out = tmp_path / "run"
    shutil.copytree(finished, out)
    marker = tmp_path / "PAYLOAD_RAN"
    path = out / target if target == "model.pt" else out / "checkpoints" / target
    state = torch.load(path, weights_only=True)
    state["model"] = Payload(marker)    # a complete-looking file whose weights run code
    torch.save(state, path)
    if target == "last.prev.pt":
        ckpt.last_path(out).write_bytes(b"damaged")   # so the resume falls back to last.prev.pt
    if target == "model.pt":
        cmd = ["evaluate", "--model", str(path), "--out", str(tmp_path / "eval")]
    else:
        cmd = ["train", "--out", str(out), "--resume", *CONSTANT, "--set", "train.steps=4"]
    proc = subprocess.run([sys.executable, "-m", "tiersep.cli", cmd[0], "--config", str(ws["config_file"]),
                           "--preset", "train_test_tiny", "--data", str(ws["data"]), *cmd[1:]],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert not marker.exists(), "code ran from the file"
    assert proc.returncode == 2, proc.stderr
    line = last_line(proc.stderr)
    assert f"{path}: refused: " in line and "posix.system" in line and "could run code" in line
    assert "Traceback" not in proc.stderr
    # refused, not a quiet "start over": the run is where it was
    assert (out / "model.pt").is_file() and not (out / "previous").exists()


# ---------------------------------------------------------------------------------------------
# Ctrl-C is a stop, not a loss
# ---------------------------------------------------------------------------------------------
SIGINT_SETS = ["--set", "train.steps=24", "--set", "train.checkpoint_every=6", "--set", "train.validate_every=4"]


def test_sigint_checkpoints_exits_130_and_resumes_to_the_same_weights(ws, tmp_path):
    full = tmp_path / "uninterrupted"
    assert run(ws, full, *SIGINT_SETS)[0] == 0

    out = tmp_path / "interrupted"
    proc = cli_train(ws, out, *SIGINT_SETS, "--resume")
    wait_for_rows(proc, out, 8)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == trainer.EXIT_INTERRUPTED
    log = Path(str(out) + ".log").read_text()
    step = torch.load(ckpt.last_path(out), weights_only=True)["step"]
    assert 8 <= step < 24 and step == int(metrics_rows(out)[-1]["step"])   # at the step boundary
    assert f"interrupted at step {step} " in log and "run the same command to resume" in log
    assert "Traceback" not in log and not (out / "model.pt").exists()

    code, log = run(ws, out, *SIGINT_SETS, "--resume")
    assert code == 0 and f"resuming train_test_tiny from step {step}" in log
    assert same(weights(out / "checkpoints" / "last.pt"), weights(full / "checkpoints" / "last.pt"))
    assert same(weights(out / "model.pt"), weights(full / "model.pt"))


def test_the_first_sigint_sets_the_flag_and_a_second_stops_at_once():
    from tiersep.train.signals import StopFlag, stop_on_signals

    flag = StopFlag()
    # what was there before: default_int_handler, or SIG_IGN when pytest itself was started in the
    # background by a non-interactive shell (`cmd &`), which the CI harness may do
    before = signal.getsignal(signal.SIGINT)
    with stop_on_signals(flag):
        os.kill(os.getpid(), signal.SIGINT)          # Ctrl-C: noted, the step goes on
        assert flag.interrupted and flag.name == "SIGINT"
        with pytest.raises(KeyboardInterrupt):        # Ctrl-C again: stop now
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
    assert signal.getsignal(signal.SIGINT) is before   # restored after the run
