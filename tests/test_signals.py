"""SIGTERM to the whole process group of a real `tiersep train` with DataLoader workers (what
Snakemake and SLURM send): at 10 seeded points of a run, from start-up to validation and
checkpointing, the trainer checkpoints and exits 75, and resuming gives the weights of an
uninterrupted run, bit for bit.

The trainer's contract (train/trainer.py, train/signals.py): its SIGTERM handler is installed when
the run starts (Training.run); from then on the signal only sets a flag and the loop checkpoints at
the next step boundary (step 0 when no step ran yet) and exits 75. A SIGTERM that arrives earlier,
while Python imports torch or the fit gate runs, kills the process (-SIGTERM) before anything was
trained or written, and a resume starts from scratch.
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from test_train_support import REPO, TINY_PRESET, make_workspace, metrics_rows
from tiersep.train import checkpoint as ckpt
from tiersep.train.trainer import EXIT_PREEMPTED

pytestmark = pytest.mark.slow  # 21 real training processes: about 3 minutes on 2 busy cores

STEPS, CHECKPOINT_EVERY, VALIDATE_EVERY, WORKERS = 12, 3, 4, 2
SETS = ["--set", f"train.steps={STEPS}", "--set", f"train.checkpoint_every={CHECKPOINT_EVERY}",
        "--set", f"train.validate_every={VALIDATE_EVERY}", "--set", f"train.num_workers={WORKERS}",
        "--set", "train.validate_segments=8"]
SEED = 16
# What a worker that died of the signal makes torch print in the main process.
WORKER_DEATH = ("killed by signal", "exited unexpectedly")


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    ws = make_workspace(tmp_path_factory.mktemp("signals_ws"))
    # One CPU estimate for every run: the gate then reads it instead of tracing a step each start.
    ws["estimate"] = ws["root"] / "estimate.json"
    subprocess.run([sys.executable, "-m", "tiersep.cli", "estimate", "--config", str(ws["config_file"]),
                    "--preset", TINY_PRESET["name"], "--device", "cpu", "--out", str(ws["estimate"])],
                   check=True, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True)
    return ws


def start(ws: dict, out: Path, *extra: str) -> subprocess.Popen:
    """`tiersep train` as the leader of its own process group (as a Snakemake job is)."""
    cmd = [sys.executable, "-m", "tiersep.cli", "train", "--config", str(ws["config_file"]),
           "--preset", TINY_PRESET["name"], "--data", str(ws["data"]), "--out", str(out),
           "--estimate", str(ws["estimate"]), *SETS, *extra]
    log = open(str(out) + ".log", "a")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


def points(rng: random.Random) -> list[tuple[str, int, float]]:
    """(kind, step, delay in s) for 10 signals. Start-up: while Python starts ("launch"), once the
    trainer catches SIGTERM but has no workers yet ("caught": model and data being set up), once
    the workers exist but no step is done ("workers"). Then: during steps, right after a checkpoint
    step's row (the checkpoint is being written), late in a validation step (validation running)."""
    validation_steps = [s for s in range(VALIDATE_EVERY, STEPS - 1, VALIDATE_EVERY)]
    checkpoint_steps = [s for s in range(CHECKPOINT_EVERY, STEPS - 1, CHECKPOINT_EVERY)]
    return [("launch", 0, rng.uniform(0.3, 1.5)),
            ("caught", 0, rng.uniform(0.0, 0.02)),
            ("workers", 0, rng.uniform(0.0, 0.1)),
            ("step", rng.randint(1, STEPS - 3), rng.uniform(0.0, 0.1)),
            ("step", rng.randint(1, STEPS - 3), rng.uniform(0.0, 0.1)),
            ("checkpoint", rng.choice(checkpoint_steps), 0.0),
            ("checkpoint", rng.choice(checkpoint_steps), 0.0),
            ("validation", rng.choice(validation_steps), rng.uniform(0.6, 0.9)),
            ("validation", rng.choice(validation_steps), rng.uniform(0.6, 0.9)),
            ("step", rng.randint(1, STEPS - 3), rng.uniform(0.0, 0.1))]


def wait_for(proc: subprocess.Popen, ready, timeout: float = 180.0) -> None:
    deadline = time.time() + timeout
    while not ready():
        if proc.poll() is not None:
            raise AssertionError(f"trainer ended (rc {proc.returncode}) before the signal point")
        if time.time() > deadline:
            raise AssertionError("timed out waiting for the signal point")
        time.sleep(0.002)


def catches_sigterm(proc: subprocess.Popen) -> bool:
    """Whether the process has a SIGTERM handler installed (Linux: SigCgt in /proc/PID/status)."""
    try:
        status = Path(f"/proc/{proc.pid}/status").read_text()
    except OSError:
        return False
    caught = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), 16)
    return bool(caught >> (signal.SIGTERM - 1) & 1)


def workers_running(proc: subprocess.Popen) -> bool:
    try:
        return len(psutil.Process(proc.pid).children()) >= WORKERS
    except psutil.NoSuchProcess:
        return False


def signal_at(ws: dict, out: Path, kind: str, step: int, delay: float, step_seconds: float) -> int:
    """Start a run, SIGTERM its process group at the point, return its exit status."""
    proc = start(ws, out)
    if kind == "caught":
        wait_for(proc, lambda: catches_sigterm(proc) and not workers_running(proc))
    elif kind == "workers":
        wait_for(proc, lambda: workers_running(proc) and not metrics_rows(out))
    elif kind == "validation":   # the validation step's row comes after its training and validation
        wait_for(proc, lambda: len(metrics_rows(out)) >= step - 1)
        delay *= step_seconds
    elif kind in ("step", "checkpoint"):   # a step's row is written just before its checkpoint
        wait_for(proc, lambda: len(metrics_rows(out)) >= step)
    time.sleep(delay)
    os.killpg(proc.pid, signal.SIGTERM)
    return proc.wait(timeout=120)


def weights(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False)["model"]


def test_sigterm_to_the_process_group_checkpoints_and_resumes_bit_identical(ws, tmp_path):
    reference = tmp_path / "uninterrupted"
    proc = start(ws, reference)
    assert proc.wait(timeout=300) == 0, Path(str(reference) + ".log").read_text()[-3000:]
    rows = metrics_rows(reference)
    # Seconds per validation step (its training + validation), to place points inside validation.
    step_seconds = max(float(rows[VALIDATE_EVERY - 1]["time_s"]) - float(rows[VALIDATE_EVERY - 2]["time_s"]),
                       0.05)
    expected_model = weights(reference / "model.pt")
    expected_last = weights(ckpt.last_path(reference))

    outcomes, resuming = [], []
    for i, (kind, step, delay) in enumerate(points(random.Random(SEED))):
        out = tmp_path / f"point{i}"
        rc = signal_at(ws, out, kind, step, delay, step_seconds)
        log = Path(str(out) + ".log").read_text()
        where = f"point {i} ({kind}, step {step}, +{delay:.3f} s): rc {rc}\n{log[-3000:]}"
        assert not any(text in log for text in WORKER_DEATH), where
        assert "Traceback" not in log, where
        if rc == -signal.SIGTERM:
            # Only before the run started: nothing trained, nothing written.
            assert kind == "launch", where
            assert not ckpt.last_path(out).exists() and not metrics_rows(out), where
            checkpoint_step = None
        else:
            assert rc == EXIT_PREEMPTED, where
            state = ckpt.load_checkpoint(ckpt.last_path(out))
            checkpoint_step = state["step"]
            done = metrics_rows(out)
            # the checkpoint holds the last step the loop completed, and nothing is marked finished
            assert checkpoint_step == (int(done[-1]["step"]) if done else 0) < STEPS, where
            assert not (out / "model.pt").exists() and not (out / "run.json").exists(), where
            assert "SIGTERM at step" in log, where
            if kind in ("caught", "workers"):  # before the first step, or during it
                assert checkpoint_step <= 1, where
        outcomes.append((kind, rc, checkpoint_step))
        # The resume runs while the next point's run starts (at most two trainers at a time).
        resuming.append((where, out, checkpoint_step, start(ws, out, "--resume")))
        if len(resuming) == 2:
            check_resumed(*resuming.pop(0), expected_model, expected_last)
    for pending in resuming:
        check_resumed(*pending, expected_model, expected_last)

    preempted = [o for o in outcomes if o[1] == EXIT_PREEMPTED]
    # Everything after start-up exits 75; the points cover step 0 and later steps.
    assert len(preempted) >= 9, outcomes
    assert 0 in {o[2] for o in preempted}, outcomes
    assert any(o[2] and o[2] > 1 for o in preempted), outcomes


def check_resumed(where: str, out: Path, checkpoint_step: int | None, proc: subprocess.Popen,
                  expected_model: dict, expected_last: dict) -> None:
    """The resumed run finishes from the checkpoint with the uninterrupted run's weights."""
    assert proc.wait(timeout=300) == 0, (where, Path(str(out) + ".log").read_text()[-3000:])
    run = json.loads((out / "run.json").read_text())
    assert run["steps"] == STEPS and run["resumed_from"] == checkpoint_step, (where, run["resumed_from"])
    for name, got, expected in (("model.pt", weights(out / "model.pt"), expected_model),
                                ("last.pt", weights(ckpt.last_path(out)), expected_last)):
        assert got.keys() == expected.keys()
        for key in expected:
            assert torch.equal(got[key], expected[key]), (where, name, key)


def test_a_worker_killed_for_real_is_an_error_naming_it(ws, tmp_path):
    """A worker that really dies (SIGKILL, as the kernel's OOM killer sends) is not a preemption:
    the trainer fails, and failure.json (kind error) names the worker and its signal."""
    out = tmp_path / "killed_worker"
    proc = start(ws, out, "--set", "train.steps=100000")
    wait_for(proc, lambda: len(metrics_rows(out)) >= 2)
    victim = psutil.Process(proc.pid).children()[0].pid
    os.kill(victim, signal.SIGKILL)
    rc = proc.wait(timeout=120)
    log = Path(str(out) + ".log").read_text()
    assert rc not in (0, EXIT_PREEMPTED), log[-3000:]
    failure = json.loads((out / "failure.json").read_text())
    assert failure["kind"] == "error", failure
    assert failure["worker_signal"]["signal"] == "SIGKILL" and victim in failure["worker_signal"]["pids"], failure
