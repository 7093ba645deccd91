"""Damaged state is refused clearly, and a crash loses at most one checkpoint interval.

- checkpoints: a truncated or corrupt file is one line naming it; every new last.pt keeps the one
  before it (last.prev.pt), and a resume falls back to it, or starts over with a warning;
- `tiersep evaluate` with a damaged model.pt: one line naming the file, no traceback;
- `tiersep train --resume` over a truncated last.pt (the trainer wiring);
- Snakemake killed with SIGKILL mid-train: the stale lock is found and removed, the same command
  runs again and the tier resumes from its checkpoint; a live run's lock is never removed.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO, TINY_CONFIG
from test_train_support import tiny_preset
from tiersep.train import checkpoint as ckpt
from tiersep.train.schedule import Schedule


# ---------------------------------------------------------------------------------------------
# Checkpoint files
# ---------------------------------------------------------------------------------------------
def save(out_dir: Path, step: int) -> dict:
    """A real checkpoint of a small model at `step` (its weights filled with the step number)."""
    model = torch.nn.Linear(4, 2)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float(step))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ckpt.save_checkpoint(ckpt.last_path(out_dir), model=model, optimizer=optimizer,
                         schedule=Schedule(tiny_preset()["train"]), step=step, best={"step": None},
                         preset={"name": "p"}, run={"attempt": 1})
    return model.state_dict()


def truncate(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def test_each_new_last_keeps_the_previous_one(tmp_path):
    save(tmp_path, 3)
    assert not ckpt.previous_path(ckpt.last_path(tmp_path)).exists()
    save(tmp_path, 6)
    save(tmp_path, 9)
    assert ckpt.load_checkpoint(ckpt.last_path(tmp_path))["step"] == 9
    previous = ckpt.load_checkpoint(ckpt.previous_path(ckpt.last_path(tmp_path)))
    assert previous["step"] == 6 and torch.equal(previous["model"]["weight"], torch.full((2, 4), 6.0))


def test_a_damaged_last_is_not_kept_as_previous(tmp_path):
    save(tmp_path, 3)
    save(tmp_path, 6)
    truncate(ckpt.last_path(tmp_path))          # step 6 damaged after it was written
    save(tmp_path, 9)
    assert ckpt.load_checkpoint(ckpt.previous_path(ckpt.last_path(tmp_path)))["step"] == 3


def test_a_fresh_sequence_drops_an_older_previous(tmp_path):
    save(tmp_path, 3)
    save(tmp_path, 6)
    ckpt.last_path(tmp_path).unlink()           # what a run that starts over does
    save(tmp_path, 1)
    assert not ckpt.previous_path(ckpt.last_path(tmp_path)).exists()


@pytest.mark.parametrize("damage, expected", [
    ("truncated", r"unreadable checkpoint \(\d+ bytes: .*\); it is truncated or corrupt"),
    ("garbage", r"unreadable checkpoint \(\d+ bytes: .*\); it is truncated or corrupt"),
    ("empty", r"unreadable checkpoint \(0 bytes: .*\); it is truncated or corrupt"),
    ("other", r"not a tiersep checkpoint \(missing model, optimizer, schedule, step, best, rng, preset, run\)"),
    ("missing", r"checkpoint not found"),
])
def test_damaged_checkpoint_is_one_line_naming_the_file(tmp_path, damage, expected):
    save(tmp_path, 3)
    path = ckpt.last_path(tmp_path)
    if damage == "truncated":
        truncate(path, 0.7)
    elif damage == "garbage":
        path.write_bytes(os.urandom(4096))
    elif damage == "empty":
        path.write_bytes(b"")
    elif damage == "other":
        torch.save([1, 2, 3], path)
    else:
        path.unlink()
    with pytest.raises(ckpt.CheckpointError, match=rf"^{path}: {expected}$") as caught:
        ckpt.load_checkpoint(path)
    assert "\n" not in str(caught.value)


def test_resume_checkpoint_falls_back_to_the_previous(tmp_path):
    last = ckpt.last_path(tmp_path)
    assert ckpt.load_resume_checkpoint(tmp_path) == (None, None)          # nothing to resume
    save(tmp_path, 3)
    state, warning = ckpt.load_resume_checkpoint(tmp_path)
    assert state["step"] == 3 and warning is None
    weights = save(tmp_path, 6)
    save(tmp_path, 9)
    truncate(last)
    state, warning = ckpt.load_resume_checkpoint(tmp_path)
    assert state["step"] == 6 and torch.equal(state["model"]["weight"], weights["weight"])
    assert f"{last}: unreadable checkpoint" in warning and "last.prev.pt at step 6" in warning
    assert "\n" not in warning
    # last.pt is the checkpoint the run continues from; the damaged one is kept aside
    assert ckpt.load_checkpoint(last)["step"] == 6
    assert last.with_name("last.corrupt.pt").is_file()


def test_resume_checkpoint_starts_over_when_nothing_is_readable(tmp_path):
    last = ckpt.last_path(tmp_path)
    save(tmp_path, 3)
    save(tmp_path, 6)
    truncate(last)
    truncate(ckpt.previous_path(last))
    state, warning = ckpt.load_resume_checkpoint(tmp_path)
    assert state is None
    assert f"{last}: unreadable checkpoint" in warning and "the previous checkpoint is not usable" in warning
    assert not last.exists()


def test_evaluate_with_a_damaged_model_file_is_one_line(tmp_path):
    model = tmp_path / "model.pt"
    torch.save({"model": torch.nn.Linear(2, 2).state_dict(), "preset": {}, "step": 1}, model)
    truncate(model)
    (tmp_path / "data").mkdir()    # the model is read before any track: a manifest is all it needs here,
    (tmp_path / "data" / "manifest.json").write_text("{}")   # and a missing one is refused first
    proc = subprocess.run([sys.executable, "-m", "tiersep.cli", "evaluate", "--config", str(TINY_CONFIG),
                           "--preset", "test_tiny", "--model", str(model), "--data", str(tmp_path / "data"),
                           "--out", str(tmp_path / "eval")], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert lines[0].startswith(f"tiersep evaluate: error: {model}: unreadable model file (")
    assert not (tmp_path / "eval").exists()


# ---------------------------------------------------------------------------------------------
# The trainer over a damaged last.pt (real `tiersep train --resume` processes)
# ---------------------------------------------------------------------------------------------
RESUME_SETS = ["--set", "train.steps=12", "--set", "train.checkpoint_every=3", "--set", "train.validate_every=4"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A finished 12-step run (checkpoints at 3, 6, 9, 12) and its exported weights."""
    from test_train_support import cli_train, make_workspace

    ws = make_workspace(tmp_path_factory.mktemp("resume_ws"))
    out = ws["root"] / "reference"
    assert cli_train(ws, out, *RESUME_SETS).wait(timeout=600) == 0
    return ws, out, torch.load(out / "model.pt", weights_only=False)["model"]


def rerun_damaged(trained, tmp_path, damage_previous: bool) -> tuple[Path, dict, str]:
    """Copy the finished run, truncate its last.pt (and last.prev.pt), resume it to the end."""
    import shutil

    from test_train_support import cli_train

    ws, reference, _ = trained
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    (out / "model.pt").unlink()
    (out / "run.json").unlink()
    last = ckpt.last_path(out)
    truncate(last)
    if damage_previous:
        truncate(ckpt.previous_path(last))
    assert cli_train(ws, out, *RESUME_SETS, "--resume").wait(timeout=600) == 0, \
        Path(str(out) + ".log").read_text()[-3000:]
    return out, json.loads((out / "run.json").read_text()), Path(str(out) + ".log").read_text()


def assert_same_weights(out: Path, expected: dict) -> None:
    got = torch.load(out / "model.pt", weights_only=False)["model"]
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in expected)


@pytest.mark.slow  # real training processes
def test_resume_over_a_truncated_last_continues_from_the_previous(trained, tmp_path):
    out, run, log = rerun_damaged(trained, tmp_path, damage_previous=False)
    assert run["resumed_from"] == 9 and run["steps"] == 12
    assert "unreadable checkpoint" in run["resume_warning"] and "last.prev.pt at step 9" in run["resume_warning"]
    assert "tiersep train: warning: " in log and "Traceback" not in log
    assert ckpt.last_path(out).with_name("last.corrupt.pt").is_file()
    assert_same_weights(out, trained[2])


@pytest.mark.slow  # real training processes
def test_resume_with_no_readable_checkpoint_starts_over_with_a_warning(trained, tmp_path):
    out, run, log = rerun_damaged(trained, tmp_path, damage_previous=True)
    assert run["resumed_from"] is None and run["steps"] == 12
    assert "the previous checkpoint is not usable either" in run["resume_warning"]
    assert "; the earlier run is kept in " in log and "; starting a new run" in log and "Traceback" not in log
    # nothing deleted: the damaged checkpoints and the logs of the earlier run are moved aside
    kept = Path(run["moved_aside"]["to"])
    assert kept.parent == out / "previous" and (kept / "checkpoints" / "last.corrupt.pt").is_file()
    assert (kept / "metrics.csv").is_file()
    assert_same_weights(out, trained[2])


# ---------------------------------------------------------------------------------------------
# Snakemake killed with SIGKILL mid-train (real snakemake on a copy of the workflow)
# ---------------------------------------------------------------------------------------------
def _crash_workflow(tmp_path: Path) -> tuple[Path, list[str]]:
    """A workflow copy whose one tier trains long enough to be killed mid-run, and its command."""
    import yaml

    from conftest import copy_workflow, tiny_config

    wf = copy_workflow(tmp_path / "wf")
    preset = yaml.safe_load((wf / "tests/configs/presets/test_tiny.yaml").read_text())
    preset["name"] = "crash_tiny"
    preset["train"].update(steps=40, checkpoint_every=5, validate_every=20)
    (wf / "tests/configs/presets/crash_tiny.yaml").write_text(yaml.safe_dump(preset))
    tiny_config(wf / "crash.yaml", tiers=["crash_tiny"])
    return wf, ["--cores", "2", "--resources", "gpu=1", "--configfile", "crash.yaml"]


def _snakemake_env() -> dict:
    from conftest import BIN

    return {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", "OMP_NUM_THREADS": "1"}


def _lock_check(wf: Path) -> subprocess.CompletedProcess:
    """What `make run` does before snakemake: python -m tiersep.lock --snakemake <snakemake>."""
    from conftest import BIN

    return subprocess.run([sys.executable, "-m", "tiersep.lock", "--workdir", str(wf), "--snakemake",
                           str(BIN / "snakemake")], cwd=wf, env=_snakemake_env(), capture_output=True,
                          text=True, timeout=300)


@pytest.mark.slow  # the real pipeline, twice
def test_snakemake_killed_mid_train_then_the_same_command_resumes(tmp_path):
    import signal
    import time

    from conftest import BIN, run_snakemake
    from tiersep import lock

    wf, command = _crash_workflow(tmp_path)
    first = subprocess.Popen([str(BIN / "snakemake"), *command], cwd=wf, env=_snakemake_env(),
                             stdout=open(tmp_path / "first.log", "w"), stderr=subprocess.STDOUT,
                             start_new_session=True)
    run_dir = wf / "results" / "train" / "crash_tiny"
    deadline = time.time() + 600
    while not (ckpt.last_path(run_dir).is_file() and ckpt.load_checkpoint(ckpt.last_path(run_dir))["step"] >= 5):
        assert first.poll() is None and time.time() < deadline, (tmp_path / "first.log").read_text()[-3000:]
        time.sleep(0.5)

    # While it runs, its lock is live: the check leaves it alone.
    live = _lock_check(wf)
    assert live.returncode == 0 and "left alone" in live.stderr and "held by a running process" in live.stderr
    assert lock.lock_files(wf) and first.poll() is None

    os.killpg(first.pid, signal.SIGKILL)   # snakemake and its job, no chance to clean up
    first.wait(timeout=60)
    killed_at = ckpt.load_checkpoint(ckpt.last_path(run_dir))["step"]
    assert killed_at < 40 and lock.lock_files(wf) and not (run_dir / "run.json").exists()
    assert lock.stale_lock(wf)[0]

    # The same command, as the README gives it: it unlocks the stale lock and finishes.
    again = run_snakemake(wf, *command, env={"OMP_NUM_THREADS": "1"}, timeout=900)
    assert "tiersep: unlocked" in again.stdout and "stale" in again.stdout, again.stdout[-3000:]
    assert "Using workflow specific profile profiles/default" in again.stdout
    run = json.loads((run_dir / "run.json").read_text())
    assert run["resumed_from"] is not None and run["resumed_from"] >= killed_at >= 5 and run["steps"] == 40
    assert (wf / "results" / "report" / "index.html").is_file()
    assert not lock.lock_files(wf)


def test_lock_check_unlocks_only_a_stale_lock(tmp_path):
    """python -m tiersep.lock on a lock nobody holds (what a SIGKILLed run leaves): removed through
    `snakemake --unlock`; on an unlocked directory: nothing to do."""
    from tiersep import lock

    wf, _ = _crash_workflow(tmp_path)
    locks = wf / ".snakemake" / "locks"
    locks.mkdir(parents=True)
    (locks / "0.input.lock").write_text("results/report/index.html\n")
    (locks / "0.output.lock").write_text("results/report/index.html\n")
    assert lock.stale_lock(wf) == (True, f"{locks}: stale (2 lock files, no snakemake or tiersep "
                                         "process is running in this directory)")
    done = _lock_check(wf)
    assert done.returncode == 0 and done.stderr.startswith(f"tiersep: unlocked {locks}: stale"), done.stderr
    assert not lock.lock_files(wf)
    assert _lock_check(wf).stderr == ""


def test_a_process_of_the_directory_keeps_the_lock(tmp_path):
    """A tiersep job still running in the directory (e.g. orphaned by a killed snakemake) counts as
    live: unlocking then would let a second run train into the same folder. The job is a real
    process with a train job's command line, `python -m tiersep.cli train ...`, running a stand-in
    tiersep.cli that only waits (a real training run is what the slow test above uses)."""
    from tiersep import lock

    (tmp_path / ".snakemake" / "locks").mkdir(parents=True)
    (tmp_path / ".snakemake" / "locks" / "0.input.lock").write_text("results/train/t/outcome.json\n")
    stub = tmp_path / "stub" / "tiersep"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("")
    (stub / "cli.py").write_text("import sys, time\nprint('up', flush=True)\ntime.sleep(120)\n")
    job = subprocess.Popen([sys.executable, "-m", "tiersep.cli", "train", "--preset", "t"], cwd=tmp_path,
                           env={**os.environ, "PYTHONPATH": str(stub.parent)}, stdout=subprocess.PIPE, text=True)
    try:
        assert job.stdout.readline() == "up\n"
        stale, why = lock.stale_lock(tmp_path)
        assert not stale and f"pid {job.pid}: " in why and "-m tiersep.cli train" in why
        assert lock.remove_stale_lock(tmp_path).startswith("left alone: ")
        assert lock.lock_files(tmp_path)
    finally:
        job.kill()
        job.wait()
    assert lock.remove_stale_lock(tmp_path).startswith("unlocked ")
    assert not lock.lock_files(tmp_path)


@pytest.mark.parametrize("cmdline, program", [
    (["/x/.venv/bin/python", "/x/.venv/bin/snakemake", "--cores", "1"], "snakemake"),
    (["snakemake", "-n"], "snakemake"),
    (["python3", "-m", "snakemake", "--unlock"], "snakemake"),
    (["/x/.venv/bin/tiersep", "train", "--preset", "a"], "tiersep"),
    (["python", "-m", "tiersep.cli", "train"], "tiersep"),
    (["/usr/bin/bash", "-c", "tiersep train --preset a > log"], None),   # its child is the job
    (["vim", "Snakefile"], None),
    ([], None),
])
def test_which_processes_count(cmdline, program):
    from tiersep import lock

    assert lock._program(cmdline) == program
