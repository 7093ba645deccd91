"""What a GPU holds right now, read through NVML (nvidia-ml-py) without opening a CUDA context.

Only a job that trains or evaluates on the GPU may start CUDA: a context costs 0.5-1 GiB of device
memory (777 MiB after a training step on the H100, tests/data/gpu/h100-2026-11-22), which a
prepare, estimate, fit or report job would take from a training job running beside it. NVML asks
the driver instead. Without a driver or a GPU (this CPU machine, CI) every function returns None.

Indices are NVML's (nvidia-smi's, PCI bus order). A function given no index reads the GPU this
process sees as cuda:0: the first entry of CUDA_VISIBLE_DEVICES (an index or a GPU UUID), so after
a GPU lease (tiersep.gpu_lease) every reading is of the leased GPU.

Test-only seam: TIERSEP_FAKE_GPUS replaces NVML with a made-up machine, "N" (N identical 24 GiB
GPUs) or a JSON list of {"name", "total", "free", "uuid", "processes"} (bytes; every key optional;
processes: [{"pid", "name", "used"}]), or "@FILE" naming a file that holds such a list and is read
again at every call (a machine whose memory changes while a test runs), so that GPU leases and
bookings can be tested on a machine without GPUs. No user setting should ever set it.
"""
from __future__ import annotations

import contextlib
import json
import os
from typing import Iterator

FAKE_GPUS_ENV = "TIERSEP_FAKE_GPUS"   # test-only: see the module docstring
FAKE_GIB = 24


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


def _fake_devices() -> list[dict] | None:
    """The devices TIERSEP_FAKE_GPUS describes (test-only), or None when it is not set."""
    text = os.environ.get(FAKE_GPUS_ENV)
    if text is None:
        return None
    if text.startswith("@"):
        with open(text[1:]) as f:
            text = f.read()
    given = json.loads(text)
    listed = [{} for _ in range(given)] if isinstance(given, int) else list(given)
    return [{"index": i, "name": d.get("name", f"Fake GPU {i}"), "uuid": d.get("uuid"),
             "total_bytes": int(d.get("total", FAKE_GIB * 2**30)),
             "free_bytes": int(d.get("free", d.get("total", FAKE_GIB * 2**30))),
             "processes": [{"pid": int(p["pid"]), "name": p.get("name"),
                            "used_bytes": int(p["used"]) if p.get("used") is not None else None}
                           for p in d.get("processes", [])]} for i, d in enumerate(listed)]


def devices() -> list[dict] | None:
    """Every GPU of this machine, whatever CUDA_VISIBLE_DEVICES says: [{"index", "name", "uuid",
    "total_bytes", "free_bytes"}] in NVML order; None without NVML."""
    fake = _fake_devices()
    if fake is not None:
        return fake
    try:
        with _nvml() as nvml:
            found = []
            for index in range(nvml.nvmlDeviceGetCount()):
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                memory = nvml.nvmlDeviceGetMemoryInfo(handle)
                found.append({"index": index, "name": _text(nvml.nvmlDeviceGetName(handle)),
                              "uuid": _text(nvml.nvmlDeviceGetUUID(handle)),
                              "total_bytes": int(memory.total), "free_bytes": int(memory.free)})
            return found
    except Exception:  # ImportError, NVMLError
        return None


def visible_entries(value: str | None = None) -> list[str] | None:
    """The entries of CUDA_VISIBLE_DEVICES (or `value`) as CUDA reads them: indices or GPU/MIG UUIDs,
    up to the first entry CUDA would reject (it ignores the rest); None when it is not set."""
    value = os.environ.get("CUDA_VISIBLE_DEVICES") if value is None else value
    if value is None:
        return None
    entries = []
    for entry in (e.strip() for e in value.split(",")):
        if not (entry.isdigit() or entry.startswith(("GPU-", "MIG-"))):
            break
        entries.append(entry)
    return entries


def index_of(entry: str, known: list[dict] | None) -> int | None:
    """The NVML index of a CUDA_VISIBLE_DEVICES entry: an index is taken as NVML's (what CUDA uses
    with CUDA_DEVICE_ORDER=PCI_BUS_ID, and on a machine of identical GPUs), a UUID (or the unique
    prefix CUDA accepts) is looked up in `known`; None when it names no known GPU."""
    if entry.isdigit():
        return int(entry)
    matches = [d["index"] for d in known or [] if d.get("uuid") and d["uuid"].startswith(entry)]
    return matches[0] if len(matches) == 1 else None


def nvml_index(cuda_index: int = 0) -> int | None:
    """The NVML index of the GPU this process sees as cuda:`cuda_index` (a data-parallel rank's is
    its local rank); None when no such GPU is visible."""
    entries = visible_entries()
    if entries is None:
        return cuda_index
    if cuda_index >= len(entries):
        return None   # CUDA_VISIBLE_DEVICES hides it
    entry = entries[cuda_index]
    return index_of(entry, devices() if not entry.isdigit() else None)


def _cuda0(index: int | None) -> int | None:
    """`index`, or when None the NVML index of the GPU this process sees as cuda:0."""
    return nvml_index(0) if index is None else index


def _fake(index: int | None) -> dict | None:
    """The fake device `index` (test-only seam), or None."""
    return next((d for d in _fake_devices() or [] if d["index"] == index), None)


def name(index: int | None = None) -> str | None:
    """GPU `index`'s name (as torch.cuda.get_device_name gives it; default this process's cuda:0),
    or None without NVML."""
    index = _cuda0(index)
    if os.environ.get(FAKE_GPUS_ENV) is not None or index is None:
        return (_fake(index) or {}).get("name")
    try:
        with _nvml() as nvml:
            return _text(nvml.nvmlDeviceGetName(nvml.nvmlDeviceGetHandleByIndex(index)))
    except Exception:  # ImportError, NVMLError
        return None


def _memory(index: int | None) -> tuple[int, int] | None:
    """(total, free) bytes of GPU `index` (default this process's cuda:0), or None without NVML
    (or no such fake GPU)."""
    index = _cuda0(index)
    if os.environ.get(FAKE_GPUS_ENV) is not None or index is None:
        fake = _fake(index)
        return None if fake is None else (fake["total_bytes"], fake["free_bytes"])
    try:
        with _nvml() as nvml:
            memory = nvml.nvmlDeviceGetMemoryInfo(nvml.nvmlDeviceGetHandleByIndex(index))
            return int(memory.total), int(memory.free)
    except Exception:  # ImportError, NVMLError (no driver, no such GPU): nothing to read
        return None


def total_bytes(index: int | None = None) -> int | None:
    """Total memory of GPU `index` in bytes (default this process's cuda:0), or None without NVML."""
    memory = _memory(index)
    return None if memory is None else memory[0]


def catalogue_entry(index: int | None = None):
    """GPU `index`'s entry in the GPU catalogue (default this process's cuda:0), its NVML name and
    memory telling cards apart; an unknown card, or none, gets the conservative fallback whose note
    says so (tiersep.gpu_catalogue)."""
    from tiersep import gpu_catalogue

    return gpu_catalogue.catalogue_entry(name(index), total_bytes(index))


def driver_version() -> str | None:
    """The NVIDIA driver's version, or None without NVML."""
    try:
        with _nvml() as nvml:
            return _text(nvml.nvmlSystemGetDriverVersion())
    except Exception:  # ImportError, NVMLError
        return None


def free_bytes(index: int | None = None) -> int | None:
    """Free memory of GPU `index` in bytes (what nvidia-smi shows as free; default this process's
    cuda:0), or None without NVML."""
    memory = _memory(index)
    return None if memory is None else memory[1]


def used_bytes(index: int | None = None) -> int | None:
    """Used memory of GPU `index` in bytes (total - free: what nvidia-smi shows as used, contexts
    included; default this process's cuda:0), or None without NVML."""
    memory = _memory(index)
    return None if memory is None else memory[0] - memory[1]


def processes(index: int | None = None, exclude_pid: int | None = None) -> list[dict] | None:
    """Processes holding memory on GPU `index` (default this process's cuda:0): [{"pid", "name",
    "used_bytes"}], largest first, without `exclude_pid` (e.g. the caller itself); None without
    NVML. used_bytes is None where the driver does not say (some containers hide other processes'
    usage)."""
    index = _cuda0(index)
    if os.environ.get(FAKE_GPUS_ENV) is not None or index is None:
        fake = _fake(index)
        return None if fake is None else [p for p in fake["processes"] if p["pid"] != exclude_pid]
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


def other_processes_bytes(index: int | None = None) -> int:
    """Device memory other processes hold on GPU `index` (default this process's cuda:0; where the
    driver says), 0 without NVML."""
    return sum(p["used_bytes"] or 0 for p in processes(index, exclude_pid=os.getpid()) or [])
