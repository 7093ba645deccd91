"""The one loader of model files and checkpoints: torch.load(weights_only=True), always.

Tensors and plain Python values only, so no code runs from a file, whoever wrote it; a file that
carries any other object is refused as untrusted (UntrustedFile), never quietly skipped. Every way
a damaged file fails becomes one line naming it (CheckpointError). evaluate, separate and train
(its checkpoints, train/checkpoint.py) read through here.
"""
from __future__ import annotations

import pickle
import re
import zipfile
from pathlib import Path

import numpy as np
import torch

from tiersep.config import ConfigError


class CheckpointError(ConfigError):
    """A checkpoint or model file that cannot be read; the message is one line naming the file."""


class UntrustedFile(CheckpointError):
    """A .pt file that carries Python objects other than tensors and plain values: loading it
    fully could run code, so tiersep refuses it (exit 2) instead of falling back or starting over."""


# Fields of a preset the weights depend on: a checkpoint only loads into the same architecture.
ARCHITECTURE_FIELDS = {
    "audio": ("sample_rate", "channels", "n_fft", "hop", "window"),
    "model": ("sources", "n_layers", "emb_dim", "attention_dim", "n_heads", "ffn_hidden",
              "conv_kernel", "conv_stride", "norm_groups", "rope_base", "eps"),
}


# numpy arrays in checkpoints written before the RNG states were tensors: torch's documented way to
# read them weights-only (an ndarray is rebuilt from its dtype and bytes; no other class is allowed).
NUMPY_GLOBALS = [np._core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def load_weights_only(path: Path, what: str):
    """torch.load(weights_only=True) on the CPU, with every way a damaged file fails turned into
    one line, and a file that carries code-bearing objects refused as untrusted."""
    if not path.is_file():
        raise CheckpointError(f"{path}: {what} not found")
    try:
        with torch.serialization.safe_globals(NUMPY_GLOBALS):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        # The weights-only unpickler names a refused class or function as a GLOBAL ("unsupported
        # GLOBAL posix.system"): the file asks for code. Anything else (an unknown opcode) is damage.
        found = re.search(r"GLOBAL ([\w.]+)", str(err))
        if found:
            raise UntrustedFile(f"{path}: refused: this {what} asks for the Python object {found.group(1)[:80]}, "
                                "beyond tensors and plain values; loading it could run code, so tiersep does "
                                "not. Use a file written by tiersep, or remove this one") from None
        raise _damaged(path, what, err) from None
    except (RuntimeError, EOFError, ValueError, KeyError, OSError, AttributeError, ImportError,
            IndexError, TypeError, zipfile.BadZipFile) as err:
        raise _damaged(path, what, err) from None


# torch's weights-only preamble and closing advice: the line between them says what went wrong
_TORCH_NOISE = ("Weights only load failed", "Please file an issue", "Check the documentation")


def _damaged(path: Path, what: str, err: BaseException) -> CheckpointError:
    lines = [line.strip() for line in str(err).splitlines() if line.strip() and not line.startswith(_TORCH_NOISE)]
    reason = (lines or [type(err).__name__])[0]
    size = path.stat().st_size
    return CheckpointError(f"{path}: unreadable {what} ({size} bytes: {type(err).__name__}: "
                           f"{reason[:200]}); it is truncated or corrupt")


def load_model_file(path: Path) -> dict:
    """model.pt as tiersep train exports it ({"model": state_dict, "preset", "step"}), read with
    weights_only=True (no code runs from the file); CheckpointError naming the file otherwise."""
    path = Path(path)
    state = load_weights_only(path, what="model file")
    if not isinstance(state, dict) or not isinstance(state.get("model"), dict):
        raise CheckpointError(f"{path}: not a tiersep model.pt (expected a dict with key 'model')")
    return state


def check_same_architecture(preset: dict, trained: dict, model_path: Path) -> None:
    for section, fields in ARCHITECTURE_FIELDS.items():
        for field in fields:
            ours, theirs = preset[section].get(field), trained.get(section, {}).get(field)
            if ours != theirs:
                raise ConfigError(f"{model_path}: trained with {section}.{field} = {theirs!r}, but preset "
                                  f"{preset['name']!r} has {ours!r}; evaluate it with the preset it was trained with")


def load_model(model_path: Path, preset: dict) -> tuple[torch.nn.Module, int | None]:
    """Build the preset's model and load model.pt ({"model": state_dict, "preset", "step"})."""
    from tiersep.model import build_model

    model_path = Path(model_path)
    checkpoint = load_model_file(model_path)  # one-line CheckpointError when missing or damaged
    if isinstance(checkpoint.get("preset"), dict):
        check_same_architecture(preset, checkpoint["preset"], model_path)
    model = build_model(preset)
    try:
        model.load_state_dict(checkpoint["model"])
    except RuntimeError as err:  # missing/unexpected keys or shapes: not this preset's weights
        raise ConfigError(f"{model_path}: its weights do not fit preset {preset['name']!r} "
                          f"({str(err).strip().splitlines()[0]})") from None
    return model, checkpoint.get("step")
