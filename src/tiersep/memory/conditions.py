"""What an estimate models, decided once per estimate and passed on: the device, the precision, the
attention kernel, the CUDA allocator mode, the compiled or eager step, the ranks, and on CUDA the
card (a gpu_catalogue entry: its kernels and native bf16 decide the kernel and what `auto` means).

Each of these used to be asked again wherever it mattered (the attention kernel in estimate.py,
analytic.py, fit/search.py and inference.py; the allocator mode four times in one estimate); a
`Conditions` is made at the start of an estimate (`decide`) and every part reads it from there, so
all parts of one record describe the same run. A fit search decides once per variant it weighs.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from tiersep.device import planned_allocator
from tiersep.gpu_catalogue import GpuEntry
from tiersep.model.step import autocast_dtype, resolve_precision
from tiersep.model.compile import compiles

from .trace import auto_kernel, modelled_backend


@dataclass(frozen=True)
class Conditions:
    device: str                 # cuda | cpu: what the estimate models (no GPU is needed for cuda)
    precision: str              # fp32 | bf16 | fp16: train.precision as it runs (auto resolved for the card)
    attention: str              # the SDPA kernel assumed: flash | efficient | math (trace/attention.py;
                                # traced_kernel: cudnn where `auto` runs cuDNN attention)
    expandable_segments: bool   # the CUDA caching allocator's mode (device.planned_allocator); False on cpu
    compiled: bool              # the torch.compile'd step (model.compile.compiles) or the eager one
    ranks: int                  # data-parallel ranks (train.ranks): >1, the figures are a rank's
    gpu: GpuEntry | None = None  # cuda: the card modelled (tiersep.gpu_catalogue); None: any sm80+ card

    @property
    def data_parallel(self) -> bool:
        return self.ranks > 1

    def allocator_record(self) -> dict | None:
        """The record's `allocator` field: the mode modelled on cuda, None on cpu."""
        return {"expandable_segments": self.expandable_segments} if self.device == "cuda" else None

    def gpu_record(self) -> dict | None:
        """The record's `gpu` field: the card whose kernels and precision the estimate models."""
        if self.device != "cuda":
            return None
        if self.gpu is None:
            return {"name": None, "model": "any sm80+ GPU", "generation": None, "capability": None, "note":
                    "no GPU named, none visible, and the calibration names no known card: an sm80+ card assumed"}
        out = {k: v for k, v in self.gpu.as_record().items() if k in ("name", "model", "generation", "capability")}
        out["note"] = "; ".join(n for n in (self.gpu.note, self.gpu.attention_note) if n) or None
        return out

    def applied(self, preset: dict) -> dict:
        """`preset` as it runs under these conditions: train.precision resolved (auto), and on a card
        where torch's own choice differs from the trace's `auto` (no flash, or no bf16 in the fused
        kernels; or flash where `auto` traces cuDNN attention, which torch tries first only on
        Hopper and datacenter Blackwell), model.attention_backend set to the kernel that runs there.
        Unchanged otherwise, so a Hopper estimate traces exactly what it did before."""
        kernel_differs = False
        if self.device == "cuda" and self.gpu is not None and preset["model"]["attention_backend"] == "auto":
            dtype, head_dim = autocast_dtype(self.precision) or torch.float32, _head_dim(preset)
            kernel_differs = auto_kernel(dtype, head_dim, self.gpu) != auto_kernel(dtype, head_dim)
        if preset["train"]["precision"] == self.precision and not kernel_differs:
            return preset
        out = copy.deepcopy(preset)
        out["train"]["precision"] = self.precision
        if kernel_differs:
            out["model"]["attention_backend"] = self.attention
        return out

    def traced_kernel(self, preset: dict) -> str:
        """The SDPA kernel the trace of `preset` runs, as its record's attention_backend names it:
        `attention`, or cudnn where `auto` takes cuDNN attention on this card (attention.auto_kernel;
        `applied` restates flash on a card that does not try cuDNN first)."""
        if self.device == "cuda" and self.attention == "flash" and preset["model"]["attention_backend"] == "auto":
            return auto_kernel(autocast_dtype(self.precision), _head_dim(preset), self.gpu)
        return self.attention


def _head_dim(preset: dict) -> int:
    return preset["model"]["attention_dim"] // preset["model"]["n_heads"]


def _with_precision(preset: dict, precision: str) -> dict:
    """`preset` with train.precision `precision` (a shallow copy where it differs)."""
    t = preset["train"]
    return preset if t["precision"] == precision else {**preset, "train": {**t, "precision": precision}}


def decide(preset: dict, device: str, compiled: bool | None = None, gpu: GpuEntry | None = None) -> Conditions:
    """The conditions an estimate of `preset` on `device` models (on CUDA, on card `gpu`: its
    precision and kernels). `compiled` None: as the preset will run (model.compile.compiles). A
    precision or CUDA kernel the card cannot run is a ConfigError here, naming the card."""
    from tiersep.config import ConfigError

    t = preset["train"]
    bf16_native = gpu is None or gpu.bf16
    precision = resolve_precision(t["precision"], device, bf16_native)
    if device == "cuda" and precision == "bf16" and not bf16_native:
        raise ConfigError(f"train.precision: bf16 is not native on the {gpu.model} ({gpu.sm}, {gpu.generation}): "
                          "it would be emulated, and its fused attention kernels refuse it; set fp16 (with "
                          "the loss scaler) or auto")
    return Conditions(
        device=device,
        precision=precision,
        attention=modelled_backend(_with_precision(preset, precision), device, gpu if device == "cuda" else None),
        expandable_segments=bool(planned_allocator(preset)["expandable_segments"]) if device == "cuda" else False,
        compiled=compiles(preset, device) if compiled is None else bool(compiled),
        ranks=int(t.get("ranks", 1)),
        gpu=gpu if device == "cuda" else None,
    )
