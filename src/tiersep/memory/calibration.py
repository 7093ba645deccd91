"""Device calibration: what a GPU costs beyond the tensors the trace counts.

The trace predicts torch's own counters (allocated, reserved). What nvidia-smi shows, and what an
out-of-memory error is about, adds the CUDA context: driver state and the kernel images of cuBLAS,
cuDNN, cuFFT and torch itself, loaded lazily as a training step first uses them. It depends on the
GPU, the driver and the torch/CUDA build, so it is measured, not guessed:

- built-in entries (calibrations/*.json, measured on real GPUs), matched by the GPU's name;
- `tiersep calibrate --out FILE.json` on the user's own GPU (a few seconds), then
  `--calibration FILE` or `estimate.calibration: FILE`.

`auto` reads the GPU's name through NVML, which opens no CUDA context (estimate jobs must not take
memory from training jobs), and falls back to the most conservative built-in entry, saying so.
"""
from __future__ import annotations

import copy
import functools
import json
import time
from pathlib import Path

from tiersep import gpu_info
from tiersep.config import ConfigError

BUILTIN_DIR = Path(__file__).with_name("calibrations")
REQUIRED = {"name": str, "torch": str, "context_bytes": int, "cublas_workspace_bytes": int}


def _torch_minor(version: str) -> str:
    return ".".join(version.split("+")[0].split(".")[:2])


def builtin() -> dict[str, Path]:
    """Built-in calibrations by GPU name."""
    return {json.loads(p.read_text())["name"]: p for p in sorted(BUILTIN_DIR.glob("*.json"))}


def most_conservative() -> str:
    """The built-in calibration with the largest context and workspace: what a GPU without one of
    its own is estimated with."""
    def cost(path: Path) -> int:
        record = read(path)
        return record["context_bytes"] + record["cublas_workspace_bytes"]

    known = builtin()
    return max(known, key=lambda n: cost(known[n]))


def read(path: str | Path) -> dict:
    """A calibration file, checked: one-line errors name the file and the field."""
    import torch

    path = Path(path)
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: calibration file not found") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: calibration file unreadable ({err})") from None
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(record, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(record).__name__}")
    for field, kind in REQUIRED.items():
        if field not in record:
            raise ConfigError(f"{path}: {field}: missing")
        if not isinstance(record[field], kind) or isinstance(record[field], bool) or (
                kind is int and record[field] < 0):
            raise ConfigError(f"{path}: {field}: expected a {'non-negative integer' if kind is int else 'string'}, "
                              f"got {record[field]!r}")
    capability = record.get("capability")   # [major, minor]; files from before issue 31 have none
    if capability is not None and not (isinstance(capability, list) and len(capability) == 2 and all(
            isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in capability)):
        raise ConfigError(f"{path}: capability: expected [major, minor] (two non-negative integers), "
                          f"got {capability!r}")
    if _torch_minor(record["torch"]) != _torch_minor(torch.__version__):
        raise ConfigError(f"{path}: torch: calibrated with torch {record['torch']}, this is {torch.__version__} "
                          "(the context and workspaces change between versions: run `tiersep calibrate`)")
    return record


def resolve(spec: str = "auto", device_name: str | None = None) -> dict:
    """The calibration record for `spec` (auto, a built-in name, or a file), with `used` saying
    which one and why. `device_name` overrides the NVML look-up (tests, or a known target GPU)."""
    return copy.deepcopy(_resolve(spec, device_name))


@functools.lru_cache(maxsize=16)
def _resolve(spec: str, device_name: str | None) -> dict:
    known = builtin()
    if spec == "auto":
        name = device_name if device_name is not None else gpu_info.name()
        if name in known:
            return {**read(known[name]), "used": {"name": name, "source": "built-in", "why": "matched this GPU"}}
        worst = most_conservative()
        why = (f"no built-in calibration for {name!r}" if name else "no GPU visible") + \
            f": using the most conservative built-in entry, {worst} (run `tiersep calibrate` on your GPU)"
        return {**read(known[worst]), "used": {"name": worst, "source": "built-in", "why": why}}
    path = Path(spec)
    if spec.endswith(".json") or path.is_file():
        record = read(path)
        return {**record, "used": {"name": record["name"], "source": str(path), "why": "given"}}
    lowered = {n.lower(): n for n in known}
    if spec.lower() in lowered:
        name = lowered[spec.lower()]
        return {**read(known[name]), "used": {"name": name, "source": "built-in", "why": "given"}}
    raise ConfigError(f"estimate.calibration: unknown calibration {spec!r} (known: {', '.join(known)}; "
                      "or a calibration JSON file from `tiersep calibrate`)")


def measure(progress=print) -> dict:
    """Measure this machine's first GPU: the context after init, after cuBLAS, and after a real
    tiny training step (cuDNN, cuFFT, attention kernels warm), the cuBLAS workspace, and the versions.
    Needs CUDA; takes a few seconds."""
    import torch

    if not torch.cuda.is_available():
        raise ConfigError("no CUDA device is visible: calibrate measures a GPU; run it on the machine "
                          "that trains, then pass the file with --calibration")
    others = gpu_info.other_processes_bytes()

    def outside() -> int:   # device use not in torch's reserved memory: the context
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        return int(total - free - torch.cuda.memory_reserved() - others)

    torch.cuda.init()
    torch.empty(1, device="cuda")
    after_init = outside()
    progress(f"context after init: {after_init / 2**20:.0f} MiB")
    before = torch.cuda.memory_allocated()
    a = torch.randn(256, 256, device="cuda")
    (a @ a).sum().item()
    del a
    workspace = torch.cuda.memory_allocated() - before   # what the GEMM left allocated: its workspace
    after_cublas = outside()
    progress(f"context after cuBLAS: {after_cublas / 2**20:.0f} MiB, workspace {workspace / 2**20:.0f} MiB")
    _warm_training_step(torch)
    context = outside()
    progress(f"context after a training step (cuDNN, cuFFT, attention): {context / 2**20:.0f} MiB")
    props = torch.cuda.get_device_properties(0)
    return {
        "name": torch.cuda.get_device_name(0),
        "total_memory_bytes": int(props.total_memory),
        "capability": list(torch.cuda.get_device_capability(0)),   # which generation it holds
        "driver": gpu_info.driver_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "context_after_init_bytes": after_init,
        "context_after_cublas_bytes": after_cublas,
        "context_bytes": context,
        "cublas_workspace_bytes": int(workspace),
        "measured": time.strftime("%Y-%m-%d"),
        "source": "tiersep calibrate",
    }


def _warm_training_step(torch) -> None:
    """One fp32 and one bf16 training step of a tiny tiersep model: loads the kernels training uses."""
    from tiersep import config as C
    from .trace import build_workload
    from tiersep.model.step import train_step

    preset = C.validate({"name": "calibrate", "audio": {"sample_rate": 8000, "segment_samples": 8000,
                                                        "n_fft": 256, "hop": 64},
                         "model": {"n_layers": 1, "emb_dim": 16, "attention_dim": 16, "n_heads": 2,
                                   "ffn_hidden": 32}, "train": {"device": "cuda"}},
                        "preset.schema.yaml", "calibration preset")
    for precision in ("fp32", "bf16"):
        preset["train"]["precision"] = precision
        work = build_workload(preset, "cuda", lambda *s: torch.randn(s, device="cuda"))
        train_step(work.model, work.loss_fn, work.optimizer, work.inputs, preset, "cuda")
        del work
    torch.cuda.synchronize()
