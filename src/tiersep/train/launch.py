"""Starting a data-parallel tier: `tiersep train` runs itself again under torchrun (one node), or
under one torchrun per node started by `srun` inside a SLURM allocation (train.nodes > 1).

The launching process holds the run folder's lock for the whole job (the ranks know it by its pid,
tiersep.train.distributed.launcher_holds_lock), hands the ranks the resolved config and preset as
files (so --set overrides and a search trial's preset file reach them unchanged), waits, and turns what the ranks
noted (their pids and exit codes) into the job's exit code. A rank that left no exit code died: then
failure.json says `rank_died` and names it.

On several nodes the rank notes and the resolved files must be seen by every node: they go to a
tiersep temporary folder inside the run folder (`.ranks.<8 chars>.tmp`: not a user's file for
tiersep.outputs, never moved aside, removed at the end, or by the next writer if this one is killed).
The rendezvous (c10d) is on this host, the allocation's first node, where the batch step runs.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import yaml

from tiersep.resources import command_module
from tiersep.train import record
from tiersep.train.distributed import LAUNCHER_ENV, LAUNCHER_HOST_ENV, RANK_STATE_ENV
from tiersep.train.endings import EXIT_OOM, EXIT_RANK_DIED
from tiersep.train.job import TrainJob
from tiersep.train.oom import attempted_allocation

# torchrun passes these on to the ranks (its default list has no SIGUSR1, SLURM's warning signal;
# without it there, SIGUSR1 would kill torchrun itself)
TORCHRUN_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
# how long the ranks may take to leave after torchrun itself has gone
RANKS_EXIT_WAIT_S = 60.0


def torchrun_command(ranks: int, child_args: list[str]) -> list[str]:
    """What runs: torchrun on this node, one process per rank, each `tiersep train <child_args>`."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
            "-m", command_module(), "train", *child_args]


def srun_torchrun_command(nodes: int, ranks: int, host: str, port: int, job_id: str, cpus: int,
                          child_args: list[str]) -> list[str]:
    """What runs on several nodes: srun starts one torchrun per node (--kill-on-bad-exit: one node
    failing ends the others), each with ranks / nodes processes, meeting at host:port (c10d).
    --cpus-per-task: the CPUs this node has (a step gets one per task otherwise: the workflow's
    jobstep executor passes no SLURM_CPUS_PER_TASK on)."""
    return ["srun", "--nodes", str(nodes), "--ntasks", str(nodes), "--ntasks-per-node", "1",
            "--cpus-per-task", str(cpus), "--kill-on-bad-exit=1",
            sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes),
            "--nproc-per-node", str(ranks // nodes), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{host}:{port}",
            "--rdzv-id", str(job_id), "-m", command_module(), "train", *child_args]


def allocation_nodes(env) -> int | None:
    """The node count of this SLURM job: SLURM_JOB_NUM_NODES, else `scontrol show job` (the
    workflow's jobstep executor passes only SLURM_JOB_ID on to the job), else None."""
    for key in ("SLURM_JOB_NUM_NODES", "SLURM_NNODES"):
        if str(env.get(key, "")).isdigit():
            return int(env[key])
    try:
        shown = subprocess.run(["scontrol", "show", "job", "-o", str(env["SLURM_JOB_ID"])], text=True,
                               capture_output=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    found = re.search(r"\bNumNodes=(\d+)", shown)
    return int(found.group(1)) if found else None


def allocation_problem(preset: dict, env=None) -> str | None:
    """One line when a tier with train.nodes > 1 cannot start its nodes here (exit 2), else None."""
    env = os.environ if env is None else env
    nodes, name = preset["train"]["nodes"], preset["name"]
    if nodes <= 1:
        return None
    need = (f"preset {name}: train.nodes {nodes}: start one torchrun per node inside a SLURM job of {nodes} "
            f"nodes (sbatch --nodes {nodes}; the workflow's train rule asks for them through profiles/slurm; "
            "docs/training.md#data-parallel-tiers)")
    if not env.get("SLURM_JOB_ID"):
        return f"{need}: this process is in none (no SLURM_JOB_ID)"
    if shutil.which("srun", path=env.get("PATH")) is None:
        return f"{need}: srun is not on PATH"
    have = allocation_nodes(env)
    if have is None or have < nodes:
        count = have if have is not None else "an unknown number of"
        return f"{need}: SLURM job {env['SLURM_JOB_ID']} has {count} node(s)"
    return None


def free_port() -> int:
    """A TCP port free on this host now (the rendezvous binds it a moment later)."""
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def child_arguments(job: TrainJob, state: Path) -> list[str]:
    """The ranks' `tiersep train` arguments: this process's resolved config and preset as files."""
    cfg, preset = job.cfg, job.preset
    config_file, preset_file = state / "config.yaml", state / f"{preset['name']}.yaml"
    config_file.write_text(yaml.safe_dump({k: v for k, v in cfg.items() if not k.startswith("_")}, sort_keys=False))
    preset_file.write_text(yaml.safe_dump(preset, sort_keys=False))
    args = ["--config", str(config_file), "--preset", str(preset_file), "--data", str(job.data_dir),
            "--out", str(job.out_dir), "--attempt", str(job.attempt)]
    if job.resume:
        args.append("--resume")
    if job.estimate_path is not None:
        args += ["--estimate", str(job.estimate_path)]
    if job.outcome_path is not None:
        args += ["--outcome", str(job.outcome_path)]
    return args


def run_ranks(job: TrainJob) -> int:
    """Run the tier's ranks under torchrun and wait for them; returns the job's exit code.
    The caller holds the run folder's lock."""
    preset, out_dir = job.preset, job.out_dir
    ranks, nodes = preset["train"]["ranks"], preset["train"]["nodes"]
    if nodes > 1:   # seen by every node: a tiersep temporary inside the run folder
        state = Path(tempfile.mkdtemp(prefix=".ranks.", suffix=".tmp", dir=out_dir)).absolute()
    else:
        state = Path(tempfile.mkdtemp(prefix="tiersep-ranks-"))
    try:
        child_args = child_arguments(job, state)
        env = {**os.environ, RANK_STATE_ENV: str(state), LAUNCHER_ENV: str(os.getpid()),
               "TORCHELASTIC_SIGNALS_TO_HANDLE": TORCHRUN_SIGNALS}
        # the node's cores shared between its ranks (torchrun would give each one thread)
        cpus = len(os.sched_getaffinity(0))
        env.setdefault("OMP_NUM_THREADS", str(max(1, cpus // (ranks // nodes))))
        if nodes > 1:
            env[LAUNCHER_HOST_ENV] = host = socket.gethostname()
            command = srun_torchrun_command(nodes, ranks, host, free_port(),
                                            os.environ["SLURM_JOB_ID"], cpus, child_args)
            shown = " ".join(command[:command.index(command_module()) + 2])
        else:
            command = torchrun_command(ranks, child_args)
            shown = " ".join(command[:7])
        print(f"tiersep train: {preset['name']}: {ranks} ranks: {shown} ...", file=sys.stderr)
        with _passing_stop_signals(state) as passing:
            proc = subprocess.Popen(command, env=env, preexec_fn=_stop_with_parent)
            if nodes > 1:   # srun passes SIGTERM and SIGUSR1 on to every node's torchrun
                passing.targets = lambda: [proc.pid]
            returncode = proc.wait()
            _wait_for_ranks(state, ranks)
        return _job_exit(state, returncode, job)
    finally:
        shutil.rmtree(state, ignore_errors=True)


def _stop_with_parent() -> None:
    """In torchrun, before it starts: SIGTERM when this process dies (Linux), so a launcher killed
    with SIGKILL does not leave ranks training into a folder nobody holds: torchrun passes the
    SIGTERM on, and they stop at the next step with a checkpoint."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class _passing_stop_signals:
    """While the ranks run: SIGTERM and SIGUSR1 sent to this process alone are passed to the ranks
    (torchrun starts them in their own session, so a signal to the job's process group reaches them
    through torchrun, and a second copy only sets the same flag). SIGINT is left to torchrun, which
    passes Ctrl-C on once: a second SIGINT would stop a rank without its checkpoint."""

    def __init__(self, state: Path):
        self.state, self.previous = state, {}
        self.targets = lambda: _rank_pids(self.state).values()

    def _pass(self, signum, _frame):
        for pid in self.targets():
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass

    def __enter__(self):
        self.previous = {signal.SIGTERM: signal.signal(signal.SIGTERM, self._pass),
                         signal.SIGUSR1: signal.signal(signal.SIGUSR1, self._pass),
                         signal.SIGINT: signal.signal(signal.SIGINT, signal.SIG_IGN)}
        return self

    def __exit__(self, *exc):
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)


def _read(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _rank_pids(state: Path) -> dict[int, int]:
    """The pids of the ranks on this host (a rank on another node notes its host first)."""
    pids, here = {}, socket.gethostname()
    for path in state.glob("rank*.pid"):
        pid = _read(path)
        host = _read(path.with_suffix(".host"))
        if isinstance(pid, int) and host in (None, here):
            pids[int(path.stem[4:])] = pid
    return pids


def _wait_for_ranks(state: Path, ranks: int) -> None:
    """torchrun can leave before its ranks (a second signal stops it while they checkpoint): wait
    until every rank that started has ended, for at most RANKS_EXIT_WAIT_S."""
    deadline = time.monotonic() + RANKS_EXIT_WAIT_S
    for rank, pid in _rank_pids(state).items():
        while time.monotonic() < deadline and not (state / f"rank{rank}.exit").exists():
            try:
                if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                    break
            except psutil.NoSuchProcess:
                break
            time.sleep(0.1)


def _job_exit(state: Path, returncode: int, job: TrainJob) -> int:
    """Rank 0's exit code, unless a rank died: then failure.json kind rank_died naming it."""
    preset, out_dir, attempt = job.preset, job.out_dir, job.attempt
    ranks, nodes = preset["train"]["ranks"], preset["train"]["nodes"]
    exits = {r: _read(state / f"rank{r}.exit") for r in range(ranks)}
    main = exits.get(0)
    if returncode == 0 and all(exits.values()):
        return 0
    died = [r for r, noted in exits.items() if noted is None]
    if main is not None and not main.get("peer_failure"):
        return int(main["code"])
    failed = died or [r for r, noted in exits.items() if noted and noted["code"] != 0 and not noted.get("peer_failure")]
    out_of_memory = [r for r in failed if not died and exits[r].get("oom")]
    if out_of_memory:
        return _rank_out_of_memory(out_of_memory[0], exits[out_of_memory[0]]["oom"], job)
    who = ", ".join(map(str, failed)) if failed else "unknown"
    if died:
        how = ("died (no exit code: killed, e.g. SIGKILL or the OOM killer" +
               (", or its node was lost or ended by srun)" if nodes > 1 else ")"))
    else:   # an error (its traceback is in the log above) or an out-of-memory on a rank other than 0
        how = "failed (exit code " + ", ".join(str(exits[r]["code"]) for r in failed) + ")" if failed else "left"
    message = f"rank {who} of {ranks} {how}; the other ranks stopped"
    step = (main or {}).get("step")
    record.write_failure(out_dir, "rank_died", message, preset=preset["name"], rank=failed[0] if failed else None,
                         ranks_failed=failed, ranks=ranks, step=step, attempt=attempt, torchrun_exit_code=returncode,
                         attempted_allocation_bytes=None, estimate_peak_bytes=None)
    print(f"tiersep train: {message}; wrote {out_dir / 'failure.json'} (exit {EXIT_RANK_DIED}); "
          "rerun with --resume to continue from the last checkpoint", file=sys.stderr)
    return EXIT_RANK_DIED


def _rank_out_of_memory(rank: int, oom: dict, job: TrainJob) -> int:
    """A rank other than 0 ran out of memory: the tier's OOM (failure.json kind oom, exit 4), so
    that the workflow's retry downshifts every rank's micro-batch (tiersep.train.oom)."""
    preset, out_dir, ranks = job.preset, job.out_dir, job.preset["train"]["ranks"]
    first = (oom["message"].splitlines() or ["out of memory"])[0]
    record.write_failure(out_dir, "oom", first, full_message=oom["message"], preset=preset["name"], rank=rank,
                         ranks=ranks, step=oom["step"], attempt=job.attempt, batch_size=oom["batch_size"],
                         grad_accum=oom["grad_accum"], precision=preset["train"]["precision"],
                         attempted_allocation_bytes=attempted_allocation(oom["message"]), estimate_peak_bytes=None,
                         memory_at_failure=oom["memory_at_failure"],
                         next_attempt=("halves the micro-batch and doubles accumulation" if oom["batch_size"] > 1
                                       else "nothing left to halve (micro-batch 1)"))
    print(f"tiersep train: rank {rank} of {ranks} ran out of memory at step {oom['step']} (micro-batch "
          f"{oom['batch_size']} x {oom['grad_accum']}): {first}; wrote {out_dir / 'failure.json'} (exit {EXIT_OOM})",
          file=sys.stderr)
    return EXIT_OOM
