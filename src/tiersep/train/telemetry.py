"""What a training run records as it goes: metrics.csv, memory.csv, memory probes, versions.

CSV rows are appended and flushed every step, so a killed job keeps everything up to its last step;
on --resume the rows after the checkpoint's step are dropped first, so the continued files have no
duplicate steps.
"""
from __future__ import annotations

import csv
import io
import json
import os
import platform
import resource
import socket
import sys
from pathlib import Path

import psutil
import torch

from tiersep.gpu_info import other_processes_bytes
from tiersep.io import write_text

METRICS_FIELDS = ["step", "time_s", "loss", "lr", "grad_norm", "steps_per_s",
                  "val_loss", "val_sdr", "val_si_sdr"]
MEMORY_FIELDS = ["step", "allocated", "reserved", "peak", "device"]


class CsvLog:
    """An append-only CSV with a fixed header, one row per step, flushed after each row."""

    def __init__(self, path: Path, fields: list[str], keep_until_step: int | None):
        """keep_until_step: None = start a new file; N = keep existing rows with step <= N."""
        self.path, self.fields = Path(path), fields
        kept = self._rows_up_to(keep_until_step) if keep_until_step is not None else []
        # Rewrite atomically (header + kept rows) so a torn last line from a kill disappears.
        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, fieldnames=fields, lineterminator="\n")
        writer.writeheader()
        writer.writerows(kept)
        write_text(self.path, buffer.getvalue())
        self._file = open(self.path, "a", newline="")
        self._writer = csv.DictWriter(self._file, fieldnames=fields, lineterminator="\n")

    def _rows_up_to(self, step: int) -> list[dict]:
        if not self.path.is_file():
            return []
        rows = []
        # errors="replace" and csv.Error: a damaged log (binary garbage, NUL bytes) keeps the rows
        # read before the damage; the rest are rewritten by the resumed run.
        with open(self.path, newline="", errors="replace") as f:
            try:
                for row in csv.DictReader(f):
                    # A row cut short by a kill has missing fields (None) or a non-numeric step.
                    if None in row.values() or None in row or not (row.get("step") or "").isdigit():
                        continue
                    if int(row["step"]) <= step:
                        rows.append({k: row.get(k, "") for k in self.fields})
            except csv.Error:
                pass
        return rows

    def append(self, row: dict) -> None:
        self._writer.writerow({k: _fmt(row.get(k)) for k in self.fields})
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def _fmt(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def column_max(path: Path, column: str) -> int:
    """Largest integer value of one CSV column (0 when the file is missing or empty)."""
    best = 0
    if Path(path).is_file():
        with open(path, newline="") as f:
            for row in csv.DictReader(f):
                value = row.get(column) or ""
                if value.isdigit():
                    best = max(best, int(value))
    return best


# Debugging the data order: with TIERSEP_TRACE_SEGMENTS=FILE every rank appends one JSON line per
# step to FILE: {"step", "rank", "segments": the step's segment indices it trains on, "sums": the sum
# of each segment's mixture}. Two runs that should see the same data (another world size, a resume)
# can then be compared line by line.
TRACE_SEGMENTS_ENV = "TIERSEP_TRACE_SEGMENTS"


class SegmentTrace:
    """The TIERSEP_TRACE_SEGMENTS log of one rank (does nothing when the variable is unset)."""

    def __init__(self, path: str | None, rank: int):
        self.path, self.rank = path, rank

    @classmethod
    def from_env(cls, rank: int) -> "SegmentTrace":
        return cls(os.environ.get(TRACE_SEGMENTS_ENV) or None, rank)

    def write(self, step: int, segments: list[int] | None, mixture: torch.Tensor) -> None:
        """mixture: [B, C, S], this rank's segments of the step in order."""
        if self.path is None:
            return
        indices = list(segments) if segments is not None else list(range(mixture.shape[0]))
        sums = [float(x) for x in mixture.double().sum(dim=(1, 2))]
        line = json.dumps({"step": step, "rank": self.rank, "segments": indices, "sums": sums}) + "\n"
        # one write per line with O_APPEND: the ranks' lines do not interleave
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)


class MemoryProbe:
    """Allocated / reserved / peak bytes: the CUDA caching allocator's counters, or RSS on CPU.

    On CUDA it also samples the process's device use (total - free, what nvidia-smi shows, less what
    other processes held when this one started, from NVML), and so the CUDA context beyond torch's
    reserved memory. Create it before CUDA starts in this process."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device
        self._process = psutil.Process()
        self._peak_rss = 0
        self._peak_device = 0
        self.others_bytes = other_processes_bytes() if self.cuda else 0
        self.start_rss = int(self._process.memory_info().rss)

    def start_free_bytes(self) -> int:
        """Free memory before this job allocates anything: the GPU's, or the machine's RAM."""
        if self.cuda:
            return int(torch.cuda.mem_get_info(self.device)[0])
        return int(psutil.virtual_memory().available)

    def process_bytes(self) -> int:
        """This process's own footprint now: reserved by torch on CUDA, resident set on CPU."""
        if self.cuda:
            return int(torch.cuda.memory_reserved(self.device))
        return int(self._process.memory_info().rss)

    def device_used(self) -> int:
        """This process's device use now: total - free, less other processes' memory at start."""
        free, total = torch.cuda.mem_get_info(self.device)
        used = int(total - free - self.others_bytes)
        self._peak_device = max(self._peak_device, used)
        return used

    def context_bytes(self) -> int:
        """Device use beyond torch's reserved memory: the CUDA context and library handles."""
        return self.device_used() - int(torch.cuda.memory_reserved(self.device))

    def sample(self) -> dict:
        if self.cuda:
            return {"allocated": int(torch.cuda.memory_allocated(self.device)),
                    "reserved": int(torch.cuda.memory_reserved(self.device)),
                    "peak": int(torch.cuda.max_memory_allocated(self.device)),
                    "device": self.device_used()}
        rss = int(self._process.memory_info().rss)
        # ru_maxrss is refreshed by the kernel lazily and can trail the RSS psutil just read.
        self._peak_rss = max(self._peak_rss, rss, peak_rss_bytes())
        return {"allocated": rss, "reserved": rss, "peak": self._peak_rss, "device": None}

    def peaks(self) -> tuple[int, int]:
        """(peak allocated, peak reserved) of this process."""
        if self.cuda:
            return (int(torch.cuda.max_memory_allocated(self.device)),
                    int(torch.cuda.max_memory_reserved(self.device)))
        self._peak_rss = max(self._peak_rss, int(self._process.memory_info().rss), peak_rss_bytes())
        return self._peak_rss, self._peak_rss

    def record(self) -> dict:
        """The run.json memory fields measured by this probe."""
        if self.cuda:
            context = self.context_bytes()
            return {"peak_device_bytes": self._peak_device, "context_bytes": context,
                    "other_processes_bytes": self.others_bytes}
        self.peaks()
        return {"peak_rss_bytes": self._peak_rss, "start_rss_bytes": self.start_rss}

    def postfix(self) -> str:
        """Short text for the progress bar."""
        s = self.sample()
        gib = 2**30
        if self.cuda:
            return f"{s['allocated'] / gib:.2f}/{s['reserved'] / gib:.2f}/{s['device'] / gib:.2f}GiB"
        return f"rss {s['allocated'] / gib:.2f}GiB"


def peak_rss_bytes() -> int:
    """Peak resident set size of this process since exec: VmHWM on Linux (getrusage's ru_maxrss
    starts at the parent's high-water mark, so a small child of a big parent reads big), else
    ru_maxrss (macOS reports bytes)."""
    status = Path("/proc/self/status")
    if status.is_file():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def describe_device(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda:{device.index or 0} ({torch.cuda.get_device_name(device)})"
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def versions() -> dict:
    import torchaudio

    import tiersep

    return {"python": platform.python_version(), "torch": torch.__version__,
            "torchaudio": torchaudio.__version__, "tiersep": tiersep.__version__,
            "cuda": torch.version.cuda if torch.cuda.is_available() else None}


def host_info() -> dict:
    return {"pid": os.getpid(), "host": socket.gethostname(),
            "slurm_job_id": os.environ.get("SLURM_JOB_ID")}
