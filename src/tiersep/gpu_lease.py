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

**Bookings** let several jobs share one GPU (the search packs its trials this way, docs/search.md):
a booking is a number of bytes, the job's predicted device use with its class's uncertainty and
its share of the safety margin. Under the GPU's ledger lock (`gpu<index>.book.lock`, held only
while a booking is decided, so two jobs racing for the last GiB are decided one after the other):
- a booking holds `gpu<index>.lock` shared (LOCK_SH), so a job that leases the GPU whole waits for
  every booking to end, and bookings wait for a whole lease;
- each live booking is a file in `gpu<index>.bookings/` that its holder keeps locked: who (pid,
  host, job) and how many bytes. A file whose lock is free belongs to a process that ended, and
  is removed; the bookings never outlive their processes;
- the GPU's capacity is its free memory at its baseline (`gpu<index>.baseline.json`: what the GPU
  used with no booking, recorded at the first booking or by `reset_baseline`, e.g. when a search
  starts); a booking is granted only when it fits the capacity less the live bookings, so the
  bookings never exceed it;
- before granting, the GPU's used memory (NVML) must be within BASELINE_TOLERANCE_BYTES of its
  baseline plus the live bookings. Memory above that is held by a process that holds no booking:
  a trial's leftover (a worker that outlived it, a leaking agent) or a stranger. The booking waits
  and says which processes hold memory (pid and name, from NVML's process list), so a leak is
  seen and never inherited by the next trial;
- a process can take a booking for a child it starts (`try_book`, then `Popen(pass_fds=
  booking.fds)` and `hand_to(pid)`): the child holds the same locks, so the booking ends exactly
  when the child and anything that inherited them end.

The lease folder is shared by every job of the machine: TIERSEP_GPU_LEASE_DIR, by default
/tmp/tiersep-gpus-<uid> (not $TMPDIR or $XDG_RUNTIME_DIR, which SLURM and login sessions set per
job or per session: two jobs must find the same folder). Users who share a machine point
TIERSEP_GPU_LEASE_DIR at one folder that all of them can write.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
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
BASELINE_TOLERANCE_BYTES = 256 * 2**20   # below a CUDA context (0.5-0.8 GiB): a leftover process is seen
GIB = 2**30

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
    booked_bytes: int | None = None   # a booking (a share of the GPU), not the GPU whole
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
                "booked_bytes": self.booked_bytes,
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
        booked = bookings(gpu, folder)
        if booked:
            parts.append(f"{gpu.label()} booked by " + ", ".join(_booker(b) for b in booked))
            continue
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


# ------------------------------------------------------------------------------------------------
# bookings: several jobs on one GPU, each with the bytes it booked (module docstring)
# ------------------------------------------------------------------------------------------------
@dataclass
class Booking:
    gpu: Gpu
    bytes: int
    path: Path                        # its file in gpu<index>.bookings/
    waited_seconds: float = 0.0
    _fds: list[int] = field(default_factory=list, repr=False)   # [booking file (EX), gpu lock (SH)]

    @property
    def fds(self) -> tuple[int, ...]:
        """The descriptors whose locks are the booking: pass them to a child to hand it over."""
        return tuple(self._fds)

    def hand_to(self, pid: int, job: str | None = None) -> None:
        """Name `pid` (a child given `fds`) as the holder, for whoever waits or checks the baseline."""
        info = json.loads(os.pread(self._fds[0], 4096, 0) or b"{}")
        info.update(pid=pid, **({"job": job} if job else {}))
        os.ftruncate(self._fds[0], 0)
        os.pwrite(self._fds[0], json.dumps(info).encode(), 0)

    def release(self) -> None:
        """Close this process's descriptors: the booking ends unless a child holds them too."""
        _close_all(self._fds)
        self._fds.clear()

    def record(self) -> dict:
        return {"index": self.gpu.index, "uuid": self.gpu.uuid, "name": self.gpu.name, "entry": self.gpu.entry,
                "booked_bytes": self.bytes, "waited_seconds": round(self.waited_seconds, 3)}


def _stem(gpu: Gpu) -> str:
    return gpu.lock_name[: -len(".lock")]


def _device(gpu: Gpu) -> dict | None:
    """A fresh NVML reading of `gpu` ({"total_bytes", "free_bytes", ...}), or None."""
    return next((d for d in gpu_info.devices() or [] if d["index"] == gpu.index), None) if gpu.index is not None else None


@contextlib.contextmanager
def _ledger(folder: Path, gpu: Gpu):
    """The GPU's ledger lock: one booking decided at a time (waits; held for milliseconds)."""
    fd = _open_lock(folder / f"{_stem(gpu)}.book.lock")
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as err:
            if err.errno in UNSUPPORTED:
                raise ConfigError(f"{folder}: this file system has no file locks, so GPUs cannot be booked "
                                  f"there; set {LEASE_DIR_ENV} to a local folder") from None
            raise
        yield
    finally:
        os.close(fd)


def bookings(gpu: Gpu, folder: Path | None = None, prune: bool = False) -> list[dict]:
    """The live bookings of `gpu`: [{"pid", "host", "job", "bytes", "since"}], oldest first. A file
    whose lock is free belongs to a process that ended: removed when `prune` (under the ledger lock)."""
    folder = lease_dir() if folder is None else folder
    where = folder / f"{_stem(gpu)}.bookings"
    live = []
    for path in sorted(where.glob("*.json")) if where.is_dir() else []:
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            try:
                fcntl.flock(fd, (fcntl.LOCK_EX if prune else fcntl.LOCK_SH) | fcntl.LOCK_NB)
            except OSError as err:
                if err.errno not in (errno.EWOULDBLOCK, errno.EACCES):
                    raise
                try:
                    info = json.loads(os.pread(fd, 4096, 0) or b"{}")
                except ValueError:   # being written by its holder, outside the ledger: skip this reading
                    continue
                if isinstance(info, dict) and "bytes" in info:
                    live.append(info)
            else:
                if prune:
                    path.unlink(missing_ok=True)
        finally:
            os.close(fd)
    return sorted(live, key=lambda b: b.get("since", 0))


def _booker(b: dict) -> str:
    return f"pid {b.get('pid')} ({b.get('job') or '?'}, {b['bytes'] / GIB:.2f} GiB)"


def baseline(gpu: Gpu, folder: Path | None = None) -> dict | None:
    """The GPU's recorded baseline ({"used_bytes", "total_bytes", "since"}), or None."""
    path = (lease_dir() if folder is None else folder) / f"{_stem(gpu)}.baseline.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _write_baseline(folder: Path, gpu: Gpu, device: dict) -> dict:
    from tiersep.io import write_json

    record = {"used_bytes": device["total_bytes"] - device["free_bytes"], "total_bytes": device["total_bytes"],
              "since": time.time(), "processes": gpu_info.processes(gpu.index) or []}
    write_json(folder / f"{_stem(gpu)}.baseline.json", record)
    return record


def reset_baseline(gpu: Gpu, folder: Path | None = None) -> dict | None:
    """Record `gpu`'s memory in use now as its baseline, when it holds no booking (else keep the
    one recorded). Returns the baseline in force (None: NVML cannot read it)."""
    folder = lease_dir() if folder is None else folder
    device = _device(gpu)
    if device is None:
        return None
    with _ledger(folder, gpu):
        if bookings(gpu, folder, prune=True):
            return baseline(gpu, folder)
        return _write_baseline(folder, gpu, device)


def _not_at_baseline(gpu: Gpu, used: int, base: dict, live: list[dict]) -> str | None:
    """Why `gpu` may take no booking now: memory above its baseline + the live bookings; None when clean."""
    booked = sum(b["bytes"] for b in live)
    excess = used - base["used_bytes"] - booked
    if excess <= BASELINE_TOLERANCE_BYTES:
        return None
    bookers = {b.get("pid") for b in live}
    holders = [p for p in gpu_info.processes(gpu.index) or [] if p["pid"] not in bookers]
    named = ", ".join(f"pid {p['pid']} ({p.get('name') or 'unknown name'}"
                      + (f", {p['used_bytes'] / GIB:.2f} GiB" if p.get("used_bytes") is not None else "") + ")"
                      for p in holders) or "a process NVML does not list"
    return (f"{gpu.label()} is not back to its baseline: {used / GIB:.2f} GiB used against "
            f"{base['used_bytes'] / GIB:.2f} GiB at baseline + {booked / GIB:.2f} GiB booked "
            f"({excess / GIB:.2f} GiB unaccounted for); still held by {named}")


def _try_book_on(folder: Path, gpu: Gpu, nbytes: int, job: str) -> Booking | str:
    """Book `nbytes` on `gpu` now, or say in one line why not (module docstring)."""
    device = _device(gpu)
    if device is None:
        return f"{gpu.label()}: NVML cannot read its memory, so nothing can be booked on it"
    with _ledger(folder, gpu):
        live = bookings(gpu, folder, prune=True)
        shared = _open_lock(folder / gpu.lock_name)
        granted = None
        try:
            try:
                fcntl.flock(shared, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except OSError as err:
                if err.errno not in (errno.EWOULDBLOCK, errno.EACCES):
                    raise
                return _holders(folder, [gpu]).replace(" held by ", " leased whole by ")
            device = _device(gpu) or device   # read again inside the ledger: the reading it decides on
            used = device["total_bytes"] - device["free_bytes"]
            base = baseline(gpu, folder)
            if base is None or base.get("total_bytes") != device["total_bytes"]:
                if live:   # cannot happen through this module; count the bookings as in use
                    base = {"used_bytes": used - sum(b["bytes"] for b in live), "total_bytes": device["total_bytes"]}
                else:
                    base = _write_baseline(folder, gpu, device)
            why = _not_at_baseline(gpu, used, base, live)
            if why:
                return why
            capacity = base["total_bytes"] - base["used_bytes"]
            booked = sum(b["bytes"] for b in live)
            if booked + nbytes > capacity:
                return (f"{gpu.label()}: {nbytes / GIB:.2f} GiB does not fit: {booked / GIB:.2f} of its "
                        f"{capacity / GIB:.2f} GiB free at baseline booked"
                        + (f" by {', '.join(_booker(b) for b in live)}" if live else ""))
            where = folder / f"{_stem(gpu)}.bookings"
            where.mkdir(exist_ok=True, mode=0o777)
            path = where / f"{os.getpid()}-{time.time_ns()}.json"
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
            fcntl.flock(fd, fcntl.LOCK_EX)
            os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "job": f"tiersep {job}",
                                      "bytes": int(nbytes), "since": time.time()}).encode(), 0)
            granted = Booking(gpu, int(nbytes), path, _fds=[fd, shared])
            return granted
        finally:
            if granted is None:
                os.close(shared)


def try_book(job: str, nbytes: int, gpus: list[Gpu] | None = None) -> Booking | str:
    """One try to book `nbytes` on one of `gpus` (default the visible ones), the one with the most
    room first; the booking, or one line saying why no GPU takes it now."""
    gpus = visible_gpus() if gpus is None else gpus
    if not gpus:
        return "no GPU is visible"
    folder = lease_dir()

    def room(gpu: Gpu) -> int:
        base, device = baseline(gpu, folder), _device(gpu)
        total = (base or {}).get("total_bytes") or (device or {}).get("total_bytes") or 0
        used = (base or {}).get("used_bytes", total - (device or {}).get("free_bytes", total))
        return total - used - sum(b["bytes"] for b in bookings(gpu, folder))

    reasons = []
    for gpu in sorted(gpus, key=lambda g: -room(g)):
        got = _try_book_on(folder, gpu, nbytes, job)
        if isinstance(got, Booking):
            return got
        reasons.append(got)
    return "; ".join(reasons)


def book_gpu(job: str, nbytes: int, timeout: float | None = None) -> GpuLease | None:
    """This process books `nbytes` on a visible GPU, waiting up to `timeout` seconds (default:
    TIERSEP_GPU_LEASE_TIMEOUT) while none takes it (NoFreeGpu then, naming why); sets
    CUDA_VISIBLE_DEVICES to it. Returns the lease (None: no GPU is visible)."""
    global _current
    if _current is not None:
        return _current
    _refuse_after_cuda_started()
    gpus = visible_gpus()
    if not gpus:
        return None
    limit = timeout_seconds() if timeout is None else timeout
    began, announced = time.monotonic(), False
    while True:
        got = try_book(job, nbytes, gpus)
        if isinstance(got, Booking):
            break
        waited = time.monotonic() - began
        if waited >= limit:
            raise NoFreeGpu(f"no GPU took a booking of {nbytes / GIB:.2f} GiB within {limit:g} s: {got} "
                            f"(leases in {lease_dir()}; {TIMEOUT_ENV} sets the wait)")
        if not announced:
            print(f"tiersep {job}: waiting to book {nbytes / GIB:.2f} GiB: {got}; up to {limit:g} s ({TIMEOUT_ENV})",
                  file=sys.stderr, flush=True)
            announced = True
        time.sleep(min(POLL_SECONDS, max(0.0, limit - waited)))
    got.waited_seconds = time.monotonic() - began
    lease = GpuLease([got.gpu], [got.path], os.environ.get(VISIBLE_ENV), got.waited_seconds,
                     booked_bytes=got.bytes, _fds=got._fds)
    os.environ[VISIBLE_ENV] = os.environ[HELD_ENV] = lease.cuda_visible_devices
    _current = lease
    print(f"tiersep {job}: booked {got.bytes / GIB:.2f} GiB of {got.gpu.label()}"
          + (f" after waiting {got.waited_seconds:.1f} s" if announced else "")
          + f"; {VISIBLE_ENV}={lease.cuda_visible_devices}", file=sys.stderr, flush=True)
    return lease
