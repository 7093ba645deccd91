"""Which device a job runs on (the one rule: device_type), and the CUDA allocator settings it runs
with (train and evaluate).

Both are decided before CUDA is initialised: the caching allocator reads PYTORCH_CUDA_ALLOC_CONF
once, when CUDA starts in this process.
"""
from __future__ import annotations

import os

import torch

from tiersep.config import ConfigError

ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"
# Test-only knob: emulate a smaller GPU (torch.cuda.set_per_process_memory_fraction), to rehearse a
# real out-of-memory failure on a large card.
MEMORY_FRACTION_ENV = "TIERSEP_CUDA_MEMORY_FRACTION"


def device_type(wanted: str) -> str:
    """The one device rule: cuda when a GPU is visible and `wanted` (cuda, cpu or auto) is not cpu,
    else cpu. Every job that runs on a device chooses it here (resolve_device, choose_device, the
    data-parallel ranks, a measured step)."""
    return "cuda" if wanted != "cpu" and torch.cuda.is_available() else "cpu"


def resolve_device(wanted: str, refusal: str) -> torch.device:
    """`wanted` as the torch.device this process runs on (device_type's rule); cuda asked for with
    no GPU visible is a ConfigError saying `refusal`."""
    if wanted == "cuda" and not torch.cuda.is_available():
        raise ConfigError(refusal)
    if device_type(wanted) == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def choose_device(preset: dict, job: str = "train") -> torch.device:
    """train.device of the preset: cuda, cpu, or auto (cuda when a GPU is visible)."""
    return resolve_device(preset["train"]["device"], f"preset {preset['name']}: train.device: cuda, but no "
                                                     f"CUDA device is visible to this {job} job")


def planned_allocator(preset: dict) -> dict:
    """The CUDA allocator settings a run of `preset` will use: expandable segments as
    train.cuda_expandable_segments says, unless the user set PYTORCH_CUDA_ALLOC_CONF themselves
    (then theirs is respected). The estimate models this mode; run.json records it."""
    user = os.environ.get(ALLOC_CONF)
    if user is not None:
        return {"conf": user, "source": f"{ALLOC_CONF} set by the user",
                "expandable_segments": expandable_in(user)}
    wanted = bool(preset["train"]["cuda_expandable_segments"])
    return {"conf": "expandable_segments:True" if wanted else "", "source": "train.cuda_expandable_segments",
            "expandable_segments": wanted}


def configure_cuda_allocator(preset: dict) -> dict:
    """Apply planned_allocator(preset) to this process, before CUDA starts; returns it."""
    settings = planned_allocator(preset)
    if settings["conf"] and ALLOC_CONF not in os.environ:
        os.environ[ALLOC_CONF] = settings["conf"]
    return settings


def expandable_in(conf: str) -> bool:
    """Whether an allocator config string turns expandable segments on (last setting wins)."""
    on = False
    for part in conf.split(","):
        key, _, value = part.strip().partition(":")
        if key.strip() == "expandable_segments":
            on = value.strip().lower() == "true"
    return on


def apply_memory_fraction(device: torch.device) -> float | None:
    """Honour TIERSEP_CUDA_MEMORY_FRACTION on a GPU (test-only; see module docstring)."""
    text = os.environ.get(MEMORY_FRACTION_ENV)
    if not text or device.type != "cuda":
        return None
    fraction = float(text)
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    return fraction
