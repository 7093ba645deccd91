"""What a GPU holds right now, read through NVML (nvidia-ml-py) without opening a CUDA context.

Only a job that trains or evaluates on the GPU may start CUDA: a context costs 0.5-1 GiB of device
memory (777 MiB after a training step on the H100, tests/data/gpu/h100-2026-11-22), which a
prepare, estimate, fit or report job would take from a training job running beside it. NVML asks
the driver instead. Without a driver or a GPU (this CPU machine, CI) every function returns None.
"""
from __future__ import annotations

import contextlib
import os
from typing import Iterator


@contextlib.contextmanager
def _nvml() -> Iterator:
    """pynvml, initialised; raises ImportError or pynvml.NVMLError when there is no NVML."""
    import pynvml

    pynvml.nvmlInit()
    try:
        yield pynvml
    finally:
        pynvml.nvmlShutdown()


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else value   # older pynvml returns bytes


def name(index: int = 0) -> str | None:
    """GPU `index`'s name (as torch.cuda.get_device_name gives it), or None without NVML."""
    try:
        with _nvml() as nvml:
            return _text(nvml.nvmlDeviceGetName(nvml.nvmlDeviceGetHandleByIndex(index)))
    except Exception:  # ImportError, NVMLError
        return None


def driver_version() -> str | None:
    """The NVIDIA driver's version, or None without NVML."""
    try:
        with _nvml() as nvml:
            return _text(nvml.nvmlSystemGetDriverVersion())
    except Exception:  # ImportError, NVMLError
        return None


def free_bytes(index: int = 0) -> int | None:
    """Free memory of GPU `index` in bytes (what nvidia-smi shows as free), or None without NVML."""
    try:
        with _nvml() as nvml:
            return int(nvml.nvmlDeviceGetMemoryInfo(nvml.nvmlDeviceGetHandleByIndex(index)).free)
    except Exception:  # ImportError, NVMLError (no driver, no such GPU): nothing to read
        return None


def processes(index: int = 0, exclude_pid: int | None = None) -> list[dict] | None:
    """Processes holding memory on GPU `index`: [{"pid", "name", "used_bytes"}], largest first,
    without `exclude_pid` (e.g. the caller itself); None without NVML. used_bytes is None where the
    driver does not say (some containers hide other processes' usage)."""
    try:
        with _nvml() as nvml:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            running = (list(nvml.nvmlDeviceGetComputeRunningProcesses(handle))
                       + list(nvml.nvmlDeviceGetGraphicsRunningProcesses(handle)))
    except Exception:  # ImportError, NVMLError
        return None
    found: dict[int, dict] = {}
    for proc in running:
        if proc.pid == exclude_pid:
            continue
        used = getattr(proc, "usedGpuMemory", None)
        entry = found.setdefault(proc.pid, {"pid": int(proc.pid), "name": _process_name(proc.pid),
                                            "used_bytes": None})
        if used is not None:
            entry["used_bytes"] = (entry["used_bytes"] or 0) + int(used)
    return sorted(found.values(), key=lambda p: p["used_bytes"] or 0, reverse=True)


def _process_name(pid: int) -> str | None:
    import psutil

    try:
        return psutil.Process(pid).name()
    except psutil.Error:  # gone, or in another PID namespace
        return None


def other_processes_bytes(index: int = 0) -> int:
    """Device memory other processes hold on GPU `index` (where the driver says), 0 without NVML."""
    return sum(p["used_bytes"] or 0 for p in processes(index, exclude_pid=os.getpid()) or [])
