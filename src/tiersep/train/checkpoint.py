"""Checkpoints that let a killed run continue bit-for-bit.

A checkpoint holds the model, the optimizer, the lr schedule, the number of completed steps (which
is also the data loader's position: batches are a pure function of (seed, step)), the best
validation score so far, and every random state a step consumes (torch CPU and CUDA, numpy, python)
- dropout draws from torch's global generator, so restoring it makes the resumed steps identical.
Files are written atomically (temp file + rename): a kill during a save leaves the previous one.
"""
from __future__ import annotations

import contextlib
import random
import shutil
from pathlib import Path

import numpy as np
import torch

from tiersep.io import atomic_path, torch_save

CHECKPOINT_DIR = "checkpoints"


def rng_state() -> dict:
    return {"torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            "numpy": np.random.get_state(),
            "python": random.getstate()}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


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
                    run: dict) -> None:
    """Write one resumable checkpoint atomically. `run` carries bookkeeping (attempt, elapsed...)."""
    torch_save({
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "schedule": schedule.state_dict(),
        "step": int(step),
        "best": dict(best),
        "rng": rng_state(),
        "preset": preset,
        "run": dict(run),
    }, path)


def load_checkpoint(path: Path) -> dict:
    # weights_only=False: the checkpoint holds numpy/python RNG states (plain tuples and arrays
    # written by this module), not only tensors.
    return torch.load(path, map_location="cpu", weights_only=False)


def restore(state: dict, *, model, optimizer, schedule) -> None:
    """Load model/optimizer/schedule from a checkpoint; RNG is restored last by the caller."""
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    schedule.load_state_dict(state["schedule"])


def copy_checkpoint(source: Path, dest: Path) -> None:
    """Atomic copy (best.pt from last.pt)."""
    with atomic_path(dest) as tmp:
        shutil.copyfile(source, tmp)


def last_path(out_dir: Path) -> Path:
    return Path(out_dir) / CHECKPOINT_DIR / "last.pt"


def best_path(out_dir: Path) -> Path:
    return Path(out_dir) / CHECKPOINT_DIR / "best.pt"
