"""Data-parallel tiers inside one rank: the process group, and what the ranks agree on.

A tier with `train.ranks` > 1 runs as that many processes started by torchrun (tiersep.train.launch
starts it on one node; on several, one torchrun per node). Every rank runs the same loop on its share
of each step's segments (tiersep.data.dataset.rank_segments) with the model in DistributedDataParallel;
the ranks agree at every step boundary on whether to stop (a SIGTERM that reached only some of them
stops all at the same step), rank 0 alone writes the run folder, and rank 0 validates and sends the
scores to the others (the plateau schedule and the best-score bookkeeping need them on every rank).
"""
from __future__ import annotations

import datetime
import json
import os
import socket
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from tiersep.config import ConfigError
from tiersep.device import configure_cuda_allocator, device_type

# How long a collective waits for a rank that is alive but silent (a hang, not a death: a rank that
# dies closes its sockets, and gloo fails the others at once). Validation and checkpoints run on
# rank 0 while the others wait, so this must exceed them.
TIMEOUT_ENV = "TIERSEP_DDP_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 600
# Set by tiersep.train.launch for the ranks it starts: where each rank notes its pid and exit code,
# and the pid of the launching process, which holds the run folder's lock for them.
RANK_STATE_ENV = "TIERSEP_RANK_STATE"
LAUNCHER_ENV = "TIERSEP_LAUNCHER_PID"
# Set only when the launcher started the ranks on several nodes through srun: its host. There the
# ranks are not its descendants (srun starts them through slurmd), so they cannot find it among
# their ancestors; on its host they check that its pid lives, elsewhere they trust srun (which the
# launcher started, and which ends with it).
LAUNCHER_HOST_ENV = "TIERSEP_LAUNCHER_HOST"


@dataclass(frozen=True)
class Ranks:
    """This process's place in the data-parallel job (torchrun's RANK, WORLD_SIZE, LOCAL_RANK...)."""

    rank: int
    world: int
    local_rank: int
    local_world: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def under_torchrun() -> bool:
    """Whether this process is a rank started by torchrun (or srun with torchrun's variables)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def is_data_parallel(preset: dict) -> bool:
    """Whether this train process runs data-parallel: the preset asks for ranks, or torchrun started
    it (a rank). What an estimate models is the preset's alone (memory/conditions.py: ranks > 1)."""
    return preset["train"]["ranks"] > 1 or under_torchrun()


def topology_problem(preset: dict) -> str | None:
    """One line refusing a ranks/nodes layout this process cannot run, or None."""
    t, name = preset["train"], preset["name"]
    ranks, nodes = t["ranks"], t["nodes"]
    if ranks % nodes:
        return f"preset {name}: train.ranks {ranks} is not a multiple of train.nodes {nodes} (ranks per node)"
    if under_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if world != ranks:
            return (f"preset {name}: train.ranks is {ranks}, but torchrun started {world} processes "
                    "(--nnodes x --nproc-per-node must equal train.ranks)")
        return None
    return None   # several nodes: the launcher checks the SLURM allocation (launch.allocation_problem)


def timeout_s() -> int:
    return int(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S))


def start(preset: dict) -> Ranks:
    """Join the process group: NCCL on CUDA (one GPU per local rank), gloo on the CPU. Before CUDA
    starts here the allocator settings are applied (the caching allocator reads them once)."""
    env = os.environ
    ranks = Ranks(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)),
                  int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])))
    configure_cuda_allocator(preset)
    cuda = device_type(preset["train"]["device"]) == "cuda"
    if cuda:
        torch.cuda.set_device(ranks.local_rank)
    elif "OMP_NUM_THREADS" not in env:
        # the ranks of a node share its cores; torchrun sets OMP_NUM_THREADS=1 unless told otherwise
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // ranks.local_world))
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=timeout_s()))
    note(ranks, "host", socket.gethostname())   # before the pid: the launcher signals only its own host's
    note(ranks, "pid", os.getpid())
    return ranks


def finish() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _flag_device(device: torch.device) -> torch.device:
    return device if device.type == "cuda" else torch.device("cpu")   # NCCL reduces CUDA tensors only


def any_rank(flag: bool, device: torch.device) -> bool:
    """True on every rank when it is True on any: all ranks leave the loop at the same step."""
    value = torch.tensor([int(bool(flag))], device=_flag_device(device))
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def mean_over_ranks(value: float, device: torch.device) -> float:
    """The mean of a per-rank number (each rank's loss is over its share of the step's segments)."""
    tensor = torch.tensor([float(value)], dtype=torch.float64, device=_flag_device(device))
    dist.all_reduce(tensor)
    return float(tensor.item()) / dist.get_world_size()


def from_main(obj):
    """Rank 0's `obj` on every rank (pickled; small objects only: scores, decisions)."""
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather(obj) -> list:
    """Every rank's `obj`, in rank order, on every rank."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def is_peer_failure(err: BaseException) -> bool:
    """Whether `err` is a collective failing because another rank is gone (or silent past the
    timeout), as opposed to this rank's own error."""
    if isinstance(err, dist.DistError):
        return True
    text = str(err)
    return isinstance(err, RuntimeError) and any(mark in text for mark in (
        "Connection closed by peer", "Connection reset by peer", "Broken pipe", "Timed out waiting",
        "gloo", "NCCL communicator was aborted"))


def one_line(err: BaseException) -> str:
    """The first line of an error, short (gloo's and NCCL's messages run over many lines)."""
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {(text[0] if text else '')[:300]}"


def launcher_holds_lock() -> bool:
    """Whether the run folder's lock is held for this rank by the tiersep process that started
    torchrun (an ancestor of this process), so rank 0 must not take it again."""
    pid = os.environ.get(LAUNCHER_ENV)
    if not pid or not pid.isdigit():
        return False
    import psutil

    host = os.environ.get(LAUNCHER_HOST_ENV)
    if host is None:   # one node: torchrun, and so this rank, descends from the launcher
        return int(pid) in {p.pid for p in psutil.Process().parents()}
    if host == socket.gethostname():   # several nodes, the launcher's: started through srun, not a descendant
        return psutil.pid_exists(int(pid))
    return True   # another node: the launcher's srun started this rank, and srun ends with the launcher


def note(ranks: Ranks, what: str, value) -> None:
    """Tell the launcher (when there is one) this rank's pid or exit: <state>/rank<N>.<what>."""
    folder = os.environ.get(RANK_STATE_ENV)
    if folder:
        path = Path(folder) / f"rank{ranks.rank}.{what}"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(value))
        os.replace(tmp, path)


class TopologyError(ConfigError):
    """A ranks/nodes layout that cannot run here (exit 2, one line)."""
