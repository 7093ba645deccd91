"""The GPUs people train on: memory, compute capability, native bf16, and the SDPA kernels torch
2.11 can run there. One table (CATALOGUE), looked up by short name (`tiersep fit --gpus t4`) or
by the name NVML reports for a card (gpu_info.catalogue_entry).

Which attention kernel runs where is read from torch's source,
aten/src/ATen/native/transformers/cuda/sdp_utils.cpp (the 2.11 line):
- flash: check_flash_attention_hardware_support, sm80..sm121 (check_sm_version<sm80, sm121>);
- memory-efficient: check_mem_efficient_hardware_support, sm50..sm121;
- cuDNN: check_cudnn_hardware_support, sm80..sm121 (check_prefer_cudnn_attention puts it first
  only on sm90, sm100 and sm103, with a runtime cuDNN above 9.15.0 and TORCH_CUDNN_SDPA_DEPRIORITIZED
  not 1; elsewhere flash comes first: `cudnn_attention_first`);
- math: no hardware check (the fallback every card runs).
The fused kernels take bf16 only from sm80 (check_dtypes_low_precision: below sm80 fp16 only),
which is also where bf16 is native in the hardware.

Memory: the total the driver reports, where a card was measured (its calibration's
total_memory_bytes); elsewhere the marketed size read as decimal gigabytes, 10^9 bytes
("nominal"). That is meant as a lower bound: GPU memory is sold in binary gigabytes, of which the
driver keeps a little (ECC, reserved pages); the one card measured here, the H100 sold as 80 GB,
reports 85.0e9 bytes (79.2 GiB). Read as GiB a nominal size is an upper bound, and a fit could be
claimed on memory the card does not have. `tiersep calibrate` on the card records its real total.
Each entry says which it is.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

GIB = 2**30
# sm ranges (inclusive) of sdp_utils.cpp, as (major, minor); see the module docstring
FLASH_SM = ((8, 0), (12, 1))
EFFICIENT_SM = ((5, 0), (12, 1))
CUDNN_SM = ((8, 0), (12, 1))
BF16_SM = (8, 0)
KERNELS = ("flash", "efficient", "cudnn", "math")   # the order torch tries them (no cuDNN preference)
# check_prefer_cudnn_attention: the capabilities where auto tries cuDNN attention first (torch 2.11's
# cu130 wheels ship a cuDNN > 9.15, as the H100 and H200 measured here ran)
CUDNN_FIRST = ((9, 0), (10, 0), (10, 3))
# ... and the runtime cuDNN it needs: above 9.15.0 (versionRuntimeCuDNN() > 91500; 9.15.1 fixed
# sequence lengths not divisible by 128). torch 2.11's CUDA 12.x wheels ship an older cuDNN.
CUDNN_FIRST_ABOVE = 91500


@dataclass(frozen=True)
class GpuEntry:
    name: str                    # short name: `--gpus t4`, fit_matrix.gpus
    model: str                   # how a column is headed
    aliases: tuple[str, ...]     # the names NVML reports (nvidia-smi, torch.cuda.get_device_name)
    memory_bytes: int
    memory_source: str           # "nominal" (marketed GB as 10^9 bytes) or where the measured total comes from
    capability: tuple[int, int]  # compute capability (major, minor)
    bf16: bool                   # native bf16 (sm80+)
    kernels: tuple[str, ...]     # SDPA kernels torch 2.11 can run on it, in KERNELS order
    note: str | None = None      # set on the fallback for an unknown card

    @property
    def sm(self) -> str:
        return f"sm{self.capability[0]}{self.capability[1]}"

    @property
    def generation(self) -> str:
        return generation(self.capability)

    @property
    def prefers_cudnn(self) -> bool:
        """Whether torch's `auto` tries cuDNN attention before flash here (Hopper, datacenter Blackwell)."""
        return tuple(self.capability) in CUDNN_FIRST and "cudnn" in self.kernels and cudnn_attention_first()

    @property
    def attention_note(self) -> str | None:
        """Why a card that could try cuDNN attention first is modelled without it here, or None."""
        why = not_cudnn_first()
        if why is None or tuple(self.capability) not in CUDNN_FIRST or "cudnn" not in self.kernels:
            return None
        return f"this torch does not try cuDNN attention first ({why}): flash modelled where auto runs it"

    def runs(self, kernel: str, half: str | None) -> bool:
        """Whether torch 2.11 runs SDPA `kernel` here for `half` (bf16, fp16, or None for fp32):
        flash takes 16-bit inputs only, and below sm80 the fused kernels take fp16 but not bf16
        (sdp_utils.cpp: check_dtypes_low_precision); math runs everything."""
        if kernel not in self.kernels:
            return False
        if kernel == "flash" and half is None:
            return False
        return kernel == "math" or half != "bf16" or self.bf16

    def as_record(self) -> dict:
        return {"name": self.name, "model": self.model, "memory_bytes": self.memory_bytes,
                "memory_source": self.memory_source, "capability": list(self.capability),
                "generation": self.generation, "bf16": self.bf16, "kernels": list(self.kernels),
                "note": self.note}


def cudnn_attention_first() -> bool:
    """The software half of check_prefer_cudnn_attention: whether this process's torch would try cuDNN
    attention first on a card that allows it (`not_cudnn_first` says why not)."""
    return not_cudnn_first() is None


def not_cudnn_first() -> str | None:
    """Why this torch would not try cuDNN attention first, or None: TORCH_CUDNN_SDPA_DEPRIORITIZED=1
    (torch's check_env reads 0 or 1), or a runtime cuDNN of 9.15.0 or older. Without a cuDNN to ask (a
    CPU-only torch planning for a GPU), the answer of the pinned torch 2.11 cu130 wheels: it would."""
    if os.environ.get("TORCH_CUDNN_SDPA_DEPRIORITIZED") == "1":
        return "TORCH_CUDNN_SDPA_DEPRIORITIZED=1"
    version = _runtime_cudnn()
    if version is None or version > CUDNN_FIRST_ABOVE:
        return None
    return f"its cuDNN {version} is not above {CUDNN_FIRST_ABOVE}" if version else "its cuDNN cannot be read"


@functools.lru_cache(maxsize=1)
def _runtime_cudnn() -> int | None:
    """torch.backends.cudnn.version() (e.g. 91900 for 9.19.0), or None where torch has no cuDNN."""
    import torch

    try:
        return torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    except Exception:   # a broken cuDNN install: torch would not run cuDNN attention either
        return 0


# Architecture names by compute capability: a class of the accuracy evidence is per generation.
GENERATIONS = (((6, 0), "Pascal"), ((7, 0), "Volta"), ((7, 5), "Turing"), ((8, 0), "Ampere"), ((8, 9), "Ada"),
               ((9, 0), "Hopper"), ((10, 0), "Blackwell"))


def generation(capability: tuple[int, int]) -> str:
    """The architecture of a compute capability (sm86 is Ampere, sm89 Ada); below sm60, "pre-Pascal"."""
    found = [label for start, label in GENERATIONS if tuple(capability) >= start]
    return found[-1] if found else "pre-Pascal"


def _gpu(name: str, model: str, aliases: tuple[str, ...], gb: float, capability: tuple[int, int],
         bf16: bool, kernels: str, memory_bytes: int | None = None, source: str = "nominal") -> GpuEntry:
    return GpuEntry(name, model, aliases, memory_bytes or int(gb * 10**9), source, capability, bf16,
                    tuple(kernels.split()))


ALL = "flash efficient cudnn math"
PRE_AMPERE = "efficient math"
CATALOGUE: tuple[GpuEntry, ...] = (
    _gpu("p100", "P100 16GB", ("Tesla P100-PCIE-16GB", "Tesla P100-SXM2-16GB"), 16, (6, 0), False, PRE_AMPERE),
    _gpu("v100-16gb", "V100 16GB", ("Tesla V100-SXM2-16GB", "Tesla V100-PCIE-16GB"), 16, (7, 0), False,
         PRE_AMPERE),
    _gpu("v100-32gb", "V100 32GB", ("Tesla V100-SXM2-32GB", "Tesla V100-PCIE-32GB", "Tesla V100S-PCIE-32GB"),
         32, (7, 0), False, PRE_AMPERE),
    _gpu("t4", "T4", ("Tesla T4",), 16, (7, 5), False, PRE_AMPERE),
    _gpu("rtx2080ti", "RTX 2080 Ti", ("NVIDIA GeForce RTX 2080 Ti", "GeForce RTX 2080 Ti"), 11, (7, 5), False,
         PRE_AMPERE),
    # the 12 and 8 GB RTX 3060, like the 16 and 8 GB RTX 4060 Ti, report the same NVML name:
    # catalogue_entry tells them apart by memory
    _gpu("rtx3060", "RTX 3060 12GB", ("NVIDIA GeForce RTX 3060",), 12, (8, 6), True, ALL),
    _gpu("rtx3060-8gb", "RTX 3060 8GB", ("NVIDIA GeForce RTX 3060",), 8, (8, 6), True, ALL),
    _gpu("rtx3090", "RTX 3090", ("NVIDIA GeForce RTX 3090",), 24, (8, 6), True, ALL),
    _gpu("rtx4060ti-8gb", "RTX 4060 Ti 8GB", ("NVIDIA GeForce RTX 4060 Ti",), 8, (8, 9), True, ALL),
    _gpu("rtx4060ti-16gb", "RTX 4060 Ti 16GB", ("NVIDIA GeForce RTX 4060 Ti",), 16, (8, 9), True, ALL),
    _gpu("rtx4090", "RTX 4090", ("NVIDIA GeForce RTX 4090",), 24, (8, 9), True, ALL),
    _gpu("a10", "A10", ("NVIDIA A10",), 24, (8, 6), True, ALL),
    _gpu("a100-40gb", "A100 40GB", ("NVIDIA A100-SXM4-40GB", "NVIDIA A100-PCIE-40GB"), 40, (8, 0), True, ALL),
    _gpu("a100-80gb", "A100 80GB", ("NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB PCIe"), 80, (8, 0), True, ALL),
    _gpu("l4", "L4", ("NVIDIA L4",), 24, (8, 9), True, ALL),
    _gpu("l40s", "L40S", ("NVIDIA L40S",), 48, (8, 9), True, ALL),
    _gpu("h100", "H100 80GB HBM3", ("NVIDIA H100 80GB HBM3",), 80, (9, 0), True, ALL, 85017493504,
         "measured: memory/calibrations/nvidia-h100-80gb-hbm3.json"),
    _gpu("h100-pcie", "H100 PCIe", ("NVIDIA H100 PCIe",), 80, (9, 0), True, ALL),
    _gpu("h200", "H200", ("NVIDIA H200",), 141, (9, 0), True, ALL, 150109880320,
         "measured: tests/data/gpu/h200-2026-11-26/calibration.json"),
    _gpu("b200", "B200", ("NVIDIA B200",), 180, (10, 0), True, ALL),
)


def by_name() -> dict[str, GpuEntry]:
    return {entry.name: entry for entry in CATALOGUE}


def named(text: str) -> GpuEntry | None:
    """The entry `text` names: its short name, model or an NVML alias, any case; None if none does.
    An NVML name two entries share (RTX 3060, RTX 4060 Ti) names the smaller card."""
    wanted = text.strip().lower()
    found = [e for e in CATALOGUE if wanted in {e.name, e.model.lower(), *(a.lower() for a in e.aliases)}]
    return min(found, key=lambda e: e.memory_bytes) if found else None


def required(text: str, where: str, also: str = "") -> GpuEntry:
    """The entry `text` names (as `named`), or a ConfigError naming `where` and the known names
    (`also`: what else `where` takes, e.g. "; or a number of GiB")."""
    entry = named(text)
    if entry is None:
        from tiersep.config import ConfigError

        raise ConfigError(f"{where}: {text[:80]!r} is not a GPU of the catalogue (known: "
                          f"{', '.join(by_name())}{also})")
    return entry


def unknown(nvml_name: str | None, total_bytes: int | None = None) -> GpuEntry:
    """What an unknown card is assumed to be: no flash, no cuDNN attention, no native bf16 (the
    memory-efficient kernel runs from sm50, below which torch 2.11 builds no kernels)."""
    shown = nvml_name or "no GPU name"
    return GpuEntry(name="unknown", model=shown, aliases=(nvml_name,) if nvml_name else (),
                    memory_bytes=total_bytes or 0, memory_source="reported by the driver" if total_bytes else "unknown",
                    capability=(5, 0), bf16=False, kernels=tuple(PRE_AMPERE.split()),
                    note=f"{shown!r} is not in the GPU catalogue (tiersep.gpu_catalogue): assumed to have no "
                         "flash or cuDNN attention and no native bf16")


def catalogue_entry(nvml_name: str | None, total_bytes: int | None = None) -> GpuEntry:
    """The entry for a card as NVML names it; `total_bytes` (its memory) picks between cards that
    share a name. An unknown card gets the conservative fallback, whose note says so."""
    if nvml_name:
        found = [e for e in CATALOGUE if nvml_name.strip().lower() in {a.lower() for a in e.aliases}]
        if found:
            if total_bytes is None:
                return min(found, key=lambda e: e.memory_bytes)
            return min(found, key=lambda e: abs(e.memory_bytes - total_bytes))
    return unknown(nvml_name, total_bytes)


def from_capability(nvml_name: str, capability: tuple[int, int], total_bytes: int | None = None,
                    source: str = "a calibration file") -> GpuEntry:
    """A card not in the catalogue whose compute capability is known (a `tiersep calibrate` file
    records it): its kernels and bf16 follow from the capability, as torch decides them."""
    capability = tuple(capability)
    return GpuEntry(name="calibrated", model=nvml_name, aliases=(nvml_name,), memory_bytes=total_bytes or 0,
                    memory_source=f"measured: {source}" if total_bytes else "unknown", capability=capability,
                    bf16=capability >= BF16_SM, kernels=kernels_for(capability),
                    note=f"{nvml_name!r} is not in the GPU catalogue: its kernels follow from its compute "
                         f"capability sm{capability[0]}{capability[1]} ({source})")


def kernels_for(capability: tuple[int, int]) -> tuple[str, ...]:
    """The SDPA kernels sdp_utils.cpp lets a card of this capability run, in KERNELS order."""
    def within(bounds):
        return bounds[0] <= capability <= bounds[1]
    ranges = {"flash": FLASH_SM, "efficient": EFFICIENT_SM, "cudnn": CUDNN_SM}
    return tuple(k for k in KERNELS if k == "math" or within(ranges[k]))


def table_markdown() -> list[str]:
    """docs/memory.md's GPU table (tests/test_gpu_catalogue.py checks the docs against it)."""
    lines = ["| name | model | NVML names | memory | capability | bf16 | SDPA kernels |",
             "|---|---|---|---|---|---|---|"]
    for e in CATALOGUE:
        memory = (f"{e.memory_bytes / GIB:.1f} GiB (nominal {e.memory_bytes / 1e9:.0f} GB)" if e.memory_source == "nominal"
                  else f"{e.memory_bytes / GIB:.1f} GiB (measured)")
        lines.append(f"| {e.name} | {e.model} | {', '.join(e.aliases)} | {memory} | {e.sm} | "
                     f"{'yes' if e.bf16 else 'no'} | {', '.join(e.kernels)} |")
    return lines
