"""Checkpoints that let a killed run continue bit-for-bit.

A checkpoint holds the model, the optimizer, the lr schedule, the EMA weights (train.ema, else None),
fp16's loss scaler with its skip counts (else None), the number of completed steps (which
is also the data loader's position: batches are a pure function of (seed, step)), the best
validation score so far, and every random state a step consumes (torch CPU and CUDA, numpy, python)
- dropout draws from torch's global generator, so restoring it makes the resumed steps identical.
Files are written atomically (temp file + rename): a kill during a save leaves the previous one.
Each new last.pt keeps the one before it as last.prev.pt, so a last.pt damaged after it was written
(a full disk, a copy cut short) costs one checkpoint interval, not the run: see
load_resume_checkpoint.

Every file is read with `torch.load(weights_only=True)` (model/weights.py): tensors and plain
Python values only, so no code runs from a checkpoint, whoever wrote it. The RNG states are stored
as tensors and plain numbers for that reason; a file that carries any other object is refused as
untrusted (UntrustedFile), never quietly skipped.
"""
from __future__ import annotations

import contextlib
import os
import random
import shutil
import zipfile
from pathlib import Path

import numpy as np
import torch

from tiersep.io import atomic_path, torch_save
from tiersep.model.ema import with_averaged
from tiersep.model.weights import CheckpointError, UntrustedFile, load_weights_only

CHECKPOINT_DIR = "checkpoints"
# What every checkpoint written by save_checkpoint holds.
REQUIRED_KEYS = ("model", "optimizer", "schedule", "step", "best", "rng", "preset", "run")


def rng_state() -> dict:
    """Every random state a step consumes, as tensors and plain values (weights-only loadable)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {"torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            "numpy": {"kind": str(kind), "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                      "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
            "python": random.getstate()}   # (version, tuple of ints, float | None)


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    saved = state["numpy"]
    if isinstance(saved, dict):
        np.random.set_state((saved["kind"], saved["keys"].numpy().astype(np.uint32), saved["pos"],
                             saved["has_gauss"], saved["cached_gaussian"]))
    else:   # a checkpoint from before 0.1.1 stored numpy's own tuple (read through NUMPY_GLOBALS)
        np.random.set_state(saved)
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))


@contextlib.contextmanager
def preserved_rng():
    """Run a block without changing the torch (CPU), numpy and python global random states."""
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    try:
        yield
    finally:
        torch.set_rng_state(state["torch"])
        np.random.set_state(state["numpy"])
        random.setstate(state["python"])


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def save_checkpoint(path: Path, *, model, optimizer, schedule, step: int, best: dict, preset: dict,
                    run: dict, ema=None, scaler=None) -> None:
    """Write one resumable checkpoint atomically. `run` carries bookkeeping (attempt, elapsed...);
    `ema` the EMA weights (model/ema.py) when train.ema is on; `scaler` the fp16 loss scaler
    (model/step.py LossScaler) when train.precision is fp16.
    The checkpoint it replaces is kept as <name>.prev.pt (see keep_previous)."""
    keep_previous(Path(path))
    torch_save({
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "schedule": schedule.state_dict(),
        "ema": ema.state_dict() if ema is not None else None,
        "scaler": scaler.state_dict() if scaler is not None else None,
        "step": int(step),
        "best": dict(best),
        "rng": rng_state(),
        "preset": preset,
        "run": dict(run),
    }, path)


def previous_path(path: Path) -> Path:
    """checkpoints/last.pt -> checkpoints/last.prev.pt"""
    path = Path(path)
    return path.with_name(f"{path.stem}.prev{path.suffix}")


def keep_previous(path: Path) -> None:
    """Before `path` is replaced: make <name>.prev.pt the checkpoint now at `path`, atomically (a
    hard link, renamed into place), so that at every moment both names hold a whole checkpoint.
    A file at `path` that is not a whole zip archive (torch.save's format) is not kept; with none
    at `path`, an older .prev.pt is removed: it would not be the checkpoint before the next one."""
    path, previous = Path(path), previous_path(path)
    if not path.is_file():
        previous.unlink(missing_ok=True)
        return
    if not zipfile.is_zipfile(path):
        return
    with atomic_path(previous) as tmp:
        tmp.unlink()
        try:
            os.link(path, tmp)
        except OSError:  # a file system without hard links
            shutil.copyfile(path, tmp)


def load_checkpoint(path: Path) -> dict:
    """A checkpoint written by save_checkpoint; CheckpointError (one line naming the file) when it
    is missing, truncated, corrupt or not a tiersep checkpoint."""
    path = Path(path)
    state = load_weights_only(path, what="checkpoint")
    missing = [k for k in REQUIRED_KEYS if not isinstance(state, dict) or k not in state]
    if missing:
        raise CheckpointError(f"{path}: not a tiersep checkpoint (missing {', '.join(missing)})")
    return state


def load_resume_checkpoint(out_dir: Path) -> tuple[dict | None, str | None]:
    """The checkpoint a resumed run continues from: (state, warning).

    - last.pt readable: (its state, None); no last.pt: (None, None), nothing to resume;
    - last.pt unreadable, last.prev.pt readable: the previous checkpoint replaces last.pt, and
      (its state, a warning saying which steps are redone);
    - both unreadable: (None, a warning): the run starts over.
    A damaged last.pt is kept aside as last.corrupt.pt for inspection.
    """
    last, previous = last_path(out_dir), previous_path(last_path(out_dir))
    if not last.is_file():
        return None, None
    try:
        return load_checkpoint(last), None
    except UntrustedFile:
        raise   # not damage: never fall back or start over past a file that could run code
    except CheckpointError as err:
        damage = str(err)
    corrupt = last.with_name(f"{last.stem}.corrupt{last.suffix}")
    os.replace(last, corrupt)
    try:
        state = load_checkpoint(previous)
    except UntrustedFile:
        raise
    except CheckpointError as err:
        return None, (f"{damage} (kept as {corrupt.name}); the previous checkpoint is not usable either "
                      f"({str(err).split(': ', 1)[-1]})")
    copy_checkpoint(previous, last)  # last.pt is what the trainer reads and extends from now on
    return state, (f"{damage} (kept as {corrupt.name}); resumed from the previous checkpoint "
                   f"{previous.name} at step {state['step']}, so the steps after it run again")


def restore(state: dict, *, model, optimizer, schedule, ema=None, scaler=None) -> None:
    """Load model/optimizer/schedule (and the EMA weights) from a checkpoint; RNG is restored last
    by the caller. A checkpoint resumes only under the same train.ema (train/resume.py), so an EMA
    run's checkpoint carries its EMA."""
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    schedule.load_state_dict(state["schedule"])
    if ema is not None:
        if not state.get("ema"):
            raise CheckpointError("checkpoint: train.ema is on but the checkpoint carries no EMA weights")
        ema.load_state_dict(state["ema"])
    if scaler is not None:   # a run resumes only under the same preset, so an fp16 checkpoint has one
        if not state.get("scaler"):
            raise CheckpointError("checkpoint: train.precision is fp16 but the checkpoint carries no loss scaler")
        scaler.load_state_dict(state["scaler"])


def held_weights(state: dict) -> tuple[dict, str]:
    """(state_dict, "raw" | "ema"): the weights a best checkpoint stands for: the EMA ones when its
    `best` score was the EMA's (best["weights"]), else the raw model's."""
    if state["best"].get("weights") == "ema" and state.get("ema"):
        return with_averaged(state["model"], state["ema"]["params"]), "ema"
    return state["model"], "raw"


def copy_checkpoint(source: Path, dest: Path) -> None:
    """Atomic copy (best.pt from last.pt)."""
    with atomic_path(dest) as tmp:
        shutil.copyfile(source, tmp)


def last_path(out_dir: Path) -> Path:
    return Path(out_dir) / CHECKPOINT_DIR / "last.pt"


def best_path(out_dir: Path) -> Path:
    return Path(out_dir) / CHECKPOINT_DIR / "best.pt"
