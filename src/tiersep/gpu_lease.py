"""A GPU of its own for every CUDA job on a multi-GPU machine.

`snakemake --cores 8 --resources gpu=4` starts four GPU jobs at once; without leases each would see
every GPU, use cuda:0, and judge its fit against the same empty card. So a job that will use CUDA
leases a GPU first, before CUDA starts in the process (CUDA reads CUDA_VISIBLE_DEVICES once, when
it initialises):

- one lock file per GPU in the lease folder, `gpu<index>.lock` (the NVML index, as nvidia-smi
  numbers them), held with `fcntl.flock` (LOCK_EX | LOCK_NB) for the life of the process. The
  kernel drops the lock when the process ends, however it ends, so a killed job frees its GPU
  and there is nothing stale to clean. The holder writes its pid, host and command into the file
  (tiersep.outputs.write_holder), so a job that waits can say for whom;
- the GPUs tried are the visible ones: CUDA_VISIBLE_DEVICES when set (by the user or SLURM;
  indices or UUIDs), else every GPU NVML lists (tiersep.gpu_info), most free memory first;
- when all are taken the job prints one line naming the GPUs and their holders, and tries again
  every POLL_SECONDS until TIERSEP_GPU_LEASE_TIMEOUT seconds (default 3600) have passed; then it
  stops with one line and exit code EXIT_NO_GPU (6);
- the job then sets CUDA_VISIBLE_DEVICES to its lease (the entry it was given, or the UUID when it
  chose among all GPUs: CUDA's default order is fastest first, NVML's is PCI bus order, and a
  UUID names the same GPU in both), so it runs on cuda:0, and its gate reads that GPU's free
  memory. TIERSEP_GPU_LEASE_HELD tells child processes that the parent's lease covers them (the
  ranks of a data-parallel job that its launcher started under torchrun with one GPU per rank);
  a rank that torchrun started without such a lease (several nodes, under srun) takes none.

The lease folder is shared by every job of the machine: TIERSEP_GPU_LEASE_DIR, by default
/tmp/tiersep-gpus-<uid> (not $TMPDIR or $XDG_RUNTIME_DIR, which SLURM and login sessions set per
job or per session: two jobs must find the same folder). Users who share a machine point
TIERSEP_GPU_LEASE_DIR at one folder that all of them can write.
"""
from __future__ import annotations

import errno
import fcntl
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from tiersep import gpu_info
from tiersep.config import ConfigError
from tiersep.outputs import UNSUPPORTED, read_holder, write_holder

LEASE_DIR_ENV = "TIERSEP_GPU_LEASE_DIR"
TIMEOUT_ENV = "TIERSEP_GPU_LEASE_TIMEOUT"
HELD_ENV = "TIERSEP_GPU_LEASE_HELD"   # set by a lessee for its children: CUDA_VISIBLE_DEVICES it leased
VISIBLE_ENV = "CUDA_VISIBLE_DEVICES"
TORCHRUN_ENV = "TORCHELASTIC_RUN_ID"   # set by torchrun in every rank it starts
DEFAULT_TIMEOUT_SECONDS = 3600.0
POLL_SECONDS = 0.2
HOLDER_GRACE_SECONDS = 1.0      # how long a waiter gives a new holder to write its pid before naming it unknown
UNKNOWN_HOLDER = "another process"
EXIT_NO_GPU = 6

_current: "GpuLease | None" = None   # this process's lease: CUDA_VISIBLE_DEVICES is per process too


class NoFreeGpu(ConfigError):
    """No visible GPU came free within the lease timeout (exit 6); names the GPUs and their holders."""

    exit_code = EXIT_NO_GPU


@dataclass(frozen=True)
class Gpu:
    entry: str            # how CUDA_VISIBLE_DEVICES names it (an index or a UUID)
    index: int | None     # NVML's index; None when NVML does not know the entry
    uuid: str | None
    name: str | None
    free_bytes: int | None

    @property
    def lock_name(self) -> str:
        if self.index is not None:
            return f"gpu{self.index}.lock"
        return "gpu-" + "".join(c if c.isalnum() or c == "-" else "_" for c in self.entry) + ".lock"

    def label(self) -> str:
        return f"GPU {self.index if self.index is not None else self.entry}"


@dataclass
class GpuLease:
    gpus: list[Gpu]
    lock_paths: list[Path]
    visible_before: str | None        # CUDA_VISIBLE_DEVICES before the lease (None: not set)
    waited_seconds: float
    inherited: bool = False           # the parent process's lease covers this one
    _fds: list[int] = field(default_factory=list, repr=False)

    @property
    def index(self) -> int | None:
        return self.gpus[0].index

    @property
    def cuda_visible_devices(self) -> str:
        return ",".join(g.entry for g in self.gpus)

    def record(self) -> dict:
        """What run.json (and evaluate's and separate's records) keep of the lease."""
        first = self.gpus[0]
        return {"index": first.index, "uuid": first.uuid, "name": first.name,
                "lock": str(self.lock_paths[0]) if self.lock_paths else None,
                "cuda_visible_devices": self.cuda_visible_devices, "visible_before": self.visible_before,
                "waited_seconds": round(self.waited_seconds, 3), "inherited": self.inherited,
                "gpus": [{"index": g.index, "uuid": g.uuid, "name": g.name, "entry": g.entry} for g in self.gpus]}

    def release(self) -> None:
        """Give the GPUs back before the process ends (the kernel does it at exit otherwise)."""
        global _current
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()
        if _current is self:
            _current = None


def current() -> GpuLease | None:
    """The lease this process holds, or None (a CPU job, or no GPU to lease)."""
    return _current


def current_record() -> dict | None:
    return _current.record() if _current is not None else None


def lease_dir() -> Path:
    """The machine's lease folder (module docstring); created when missing."""
    given = os.environ.get(LEASE_DIR_ENV)
    folder = Path(given) if given else Path("/tmp") / f"tiersep-gpus-{os.getuid()}"
    folder.mkdir(parents=True, exist_ok=True, mode=0o777 if given else 0o700)
    if not given and folder.stat().st_uid != os.getuid():   # someone else's folder could deny us GPUs
        raise ConfigError(f"{folder}: the GPU lease folder belongs to another user; set {LEASE_DIR_ENV} "
                          "to a folder of your own")
    return folder


def timeout_seconds() -> float:
    text = os.environ.get(TIMEOUT_ENV)
    if text is None or text == "":
        return DEFAULT_TIMEOUT_SECONDS
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise ConfigError(f"{TIMEOUT_ENV}={text!r}: give the seconds to wait for a GPU, a number >= 0")
    return value


def visible_gpus() -> list[Gpu]:
    """The GPUs this process may lease: CUDA_VISIBLE_DEVICES's entries when it is set, else every
    GPU NVML lists (none without NVML); most free memory first, then in order."""
    known = gpu_info.devices()
    by_index = {d["index"]: d for d in known or []}
    entries = gpu_info.visible_entries()
    if entries is None:
        gpus = [Gpu(d["uuid"] or str(d["index"]), d["index"], d["uuid"], d["name"], d["free_bytes"])
                for d in known or []]
    else:
        gpus = []
        for entry in entries:
            index = gpu_info.index_of(entry, known)
            device = by_index.get(index, {})
            gpus.append(Gpu(entry, index, device.get("uuid"), device.get("name"), device.get("free_bytes")))
    return sorted(gpus, key=lambda g: -(g.free_bytes or 0))


def lease_for_device(wanted: str, job: str, count: int = 1) -> GpuLease | None:
    """The lease of a job whose device setting is `wanted` (cuda, cpu or auto): `count` GPUs (one
    per local rank) for cuda, and for auto when a GPU is visible; None for cpu, or when no GPU is
    visible (the job's own device check then says so, in one line). Without NVML (no driver) and
    without CUDA_VISIBLE_DEVICES nothing is visible to lease: set it to give such a job its GPU."""
    if wanted == "cpu" or not visible_gpus():
        return None
    return lease_gpus(job, count)


def lease_gpus(job: str, count: int = 1, timeout: float | None = None) -> GpuLease | None:
    """Lease `count` visible GPUs for this process (module docstring), waiting for them up to
    `timeout` seconds (default: TIERSEP_GPU_LEASE_TIMEOUT); NoFreeGpu when they do not come free.
    Sets CUDA_VISIBLE_DEVICES to them. Returns the lease (None: no GPU is visible)."""
    global _current
    if _current is not None:
        return _current
    _refuse_after_cuda_started()
    inherited = _inherited()
    if inherited is not None:
        _current = inherited
        return inherited
    if TORCHRUN_ENV in os.environ:
        # a rank that torchrun started without a lease of its launcher (several nodes, srun): the
        # ranks of a node share its GPUs, so each leasing all of them would wait for the others
        return None
    gpus = visible_gpus()
    if not gpus:
        return None
    if count > len(gpus):
        raise ConfigError(f"{job} needs {count} GPUs, one per rank, but only {len(gpus)} visible "
                          f"({VISIBLE_ENV}={os.environ.get(VISIBLE_ENV, '(not set)')})")
    folder = lease_dir()
    limit = timeout_seconds() if timeout is None else timeout
    began = time.monotonic()
    announced = False
    while True:
        taken = _try_lease(folder, gpus, count, job)
        if taken is not None:
            break
        waited = time.monotonic() - began
        if waited >= limit:
            raise NoFreeGpu(f"no free GPU within {limit:g} s: {_holders(folder, gpus)} (leases in {folder}; "
                            f"{TIMEOUT_ENV} sets the wait)")
        holders = "" if announced else _holders(folder, gpus)
        # a holder writes its pid just after it takes the lock: a moment's grace lets the line name it
        if holders and (UNKNOWN_HOLDER not in holders or waited >= HOLDER_GRACE_SECONDS):
            print(f"tiersep {job}: waiting for a free GPU: {holders}; up to {limit:g} s "
                  f"({TIMEOUT_ENV})", file=sys.stderr, flush=True)
            announced = True
        time.sleep(min(POLL_SECONDS, max(0.0, limit - waited)))
    leased, fds = taken
    lease = GpuLease(leased, [folder / g.lock_name for g in leased], os.environ.get(VISIBLE_ENV),
                     time.monotonic() - began, _fds=fds)
    os.environ[VISIBLE_ENV] = os.environ[HELD_ENV] = lease.cuda_visible_devices
    _current = lease
    print(f"tiersep {job}: leased {', '.join(g.label() for g in leased)}"
          + (f" ({leased[0].name})" if leased[0].name else "")
          + (f" after waiting {lease.waited_seconds:.1f} s" if announced else "")
          + f"; {VISIBLE_ENV}={lease.cuda_visible_devices}", file=sys.stderr, flush=True)
    return lease


def _try_lease(folder: Path, gpus: list[Gpu], count: int, job: str) -> tuple[list[Gpu], list[int]] | None:
    """Lock `count` of `gpus` without waiting, or none: a job never holds some while it waits for
    more (two such jobs could each hold half and wait forever)."""
    leased, fds = [], []
    for gpu in gpus:
        fd = _open_lock(folder / gpu.lock_name)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            os.close(fd)
            if err.errno in (errno.EWOULDBLOCK, errno.EACCES):
                continue
            if err.errno in UNSUPPORTED:
                _close_all(fds)
                raise ConfigError(f"{folder}: this file system has no file locks, so GPUs cannot be leased "
                                  f"there; set {LEASE_DIR_ENV} to a local folder") from None
            raise
        write_holder(fd, job=f"tiersep {job}", gpu=gpu.label())
        leased.append(gpu)
        fds.append(fd)
        if len(leased) == count:
            return leased, fds
    _close_all(fds)
    return None


def _open_lock(path: Path) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        os.fchmod(fd, 0o666)   # a shared lease folder: every user's jobs must open it (umask aside)
    except PermissionError:    # another user's file, already shared
        pass
    return fd


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


def _holders(folder: Path, gpus: list[Gpu]) -> str:
    """'GPU 0 held by pid 12 on host (tiersep train), GPU 1 ...' from the lock files."""
    parts = []
    for gpu in gpus:
        info = None
        try:
            fd = os.open(folder / gpu.lock_name, os.O_RDONLY)
        except OSError:
            pass
        else:
            info = read_holder(fd)
            os.close(fd)
        holder = UNKNOWN_HOLDER
        if info is not None:
            holder = f"pid {info['pid']} on {info['host']}" + (f" ({info['job']})" if info.get("job") else "")
        parts.append(f"{gpu.label()} held by {holder}")
    return ", ".join(parts)


def _inherited() -> GpuLease | None:
    """The parent's lease, when this process was started by a lessee with the same GPUs visible."""
    held, visible = os.environ.get(HELD_ENV), os.environ.get(VISIBLE_ENV)
    if not held or held != visible:
        return None
    known = gpu_info.devices()
    gpus = []
    for entry in gpu_info.visible_entries(held) or []:
        index = gpu_info.index_of(entry, known)
        device = next((d for d in known or [] if d["index"] == index), {})
        gpus.append(Gpu(entry, index, device.get("uuid"), device.get("name"), device.get("free_bytes")))
    return GpuLease(gpus, [], visible, 0.0, inherited=True) if gpus else None


def _refuse_after_cuda_started() -> None:
    """A lease after CUDA started would not move the job: CUDA has read CUDA_VISIBLE_DEVICES."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        raise RuntimeError("tiersep.gpu_lease: CUDA is already initialised in this process; lease the GPU "
                           "before the first torch.cuda call")
