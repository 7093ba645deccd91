"""Process and device probes: what this process (or a command it runs) holds, and where it runs.

MemoryProbe   allocated / reserved / peak bytes as a job goes (CUDA allocator counters, or RSS)
peak_rss_bytes  this process's own peak RSS since exec (VmHWM)
measure_peak_rss  a command's whole-life peak RSS, from outside (a small launcher process)
describe_device, versions, host_info   the facts a run record names

A child's ru_maxrss starts at its parent's high-water mark (Linux carries it across fork and exec),
so a train process started directly from pytest, or from a bench that has traced, reads as the
parent's peak whenever that is higher: measure_peak_rss starts it from a fresh, small launcher.
"""
from __future__ import annotations

import json
import os
import platform
import resource
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil
import torch

from tiersep.gpu_info import other_processes_bytes

KIB = 2**10


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


# Run in a fresh, small interpreter: start the command, wait for it, write its rusage.
_LAUNCHER = """
import json, os, subprocess, sys
proc = subprocess.Popen(sys.argv[2:])
_, status, usage = os.wait4(proc.pid, 0)
with open(sys.argv[1], "w") as f:
    json.dump({"returncode": os.waitstatus_to_exitcode(status), "maxrss_kib": usage.ru_maxrss,
               "user_s": usage.ru_utime, "system_s": usage.ru_stime}, f)
"""


def measure_peak_rss(cmd: list[str], env: dict | None = None, cwd=None, log=None,
                     timeout: float | None = None) -> dict:
    """Run `cmd` and return {returncode, peak_rss_bytes, user_s, system_s}: its whole-life peak RSS
    (exit included) from os.wait4. `log`: a file object for its stdout and stderr."""
    with tempfile.TemporaryDirectory(prefix="tiersep-rss-") as tmp:
        result = Path(tmp) / "rusage.json"
        launcher = subprocess.Popen([sys.executable, "-I", "-S", "-c", _LAUNCHER, str(result), *cmd],
                                    env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT if log else None,
                                    start_new_session=True)
        try:
            launcher.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(launcher.pid, signal.SIGKILL)   # the launcher's own session: it and the command
            launcher.wait()
            raise
        if launcher.returncode != 0 or not result.is_file():
            raise RuntimeError(f"measure_peak_rss: the launcher failed ({launcher.returncode}) for {cmd[:3]}")
        usage = json.loads(result.read_text())
    return {"returncode": usage["returncode"], "peak_rss_bytes": int(usage["maxrss_kib"]) * KIB,
            "user_s": usage["user_s"], "system_s": usage["system_s"]}
