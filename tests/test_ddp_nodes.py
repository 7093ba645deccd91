"""A data-parallel tier on several nodes (train.nodes > 1): `tiersep train` inside a SLURM job
starts `srun ... torchrun` (one torchrun per node, c10d rendezvous on this host).

srun is FAKED here: the test SLURM cluster has one node, so a real 2-node run cannot happen. The
fake srun (first on PATH) records its argv, strips its own options and starts the torchrun command
once per "node", all on localhost, forwarding SIGTERM/SIGUSR1/SIGINT and, like --kill-on-bad-exit,
killing the other node processes when one fails. So the real launcher, the real c10d rendezvous of
two torchrun agents (--nnodes 2, one rank each, gloo on the CPU), the rank-state folder inside the
run folder and rank 0's writes all run; what does not run is SLURM placing them on two machines."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_train_support import REPO, cpu_tiny_command, make_workspace, metrics_rows
from tiersep.train import launch

FAKE_SRUN = '''#!{python}
"""Fake srun for tests/test_ddp_nodes.py: every "node" of --nodes N runs on this machine."""
import json, os, signal, subprocess, sys, time
argv = sys.argv[1:]
with open(os.environ["FAKE_SRUN_LOG"], "a") as log:
    log.write(json.dumps(argv) + "\\n")
with_value = {{"--nodes", "--ntasks", "--ntasks-per-node", "--cpus-per-task"}}
options, i = {{}}, 0
while i < len(argv) and argv[i].startswith("-"):
    name, _, value = argv[i].partition("=")
    if name in with_value and not value:
        i += 1
        value = argv[i]
    options[name] = value
    i += 1
command = argv[i:]
nodes = int(options["--nodes"])
procs = [subprocess.Popen(command, env={{**os.environ, "SLURM_NODEID": str(n), "SLURM_PROCID": str(n)}})
         for n in range(nodes)]
def forward(signum, _frame):
    for p in procs:
        if p.poll() is None:
            p.send_signal(signum)
for signum in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
    signal.signal(signum, forward)
code = 0
while any(p.poll() is None for p in procs):
    bad = [p.returncode for p in procs if p.returncode not in (None, 0)]
    if bad and options.get("--kill-on-bad-exit") == "1":
        code = code or bad[0]
        for p in procs:
            if p.poll() is None:
                p.kill()
    time.sleep(0.05)
codes = [p.returncode for p in procs]
sys.exit(code or next((c if c > 0 else 128 - c for c in codes if c != 0), 0))
'''


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    return make_workspace(tmp_path_factory.mktemp("ddp_nodes_ws"))


def fake_slurm(tmp_path: Path, nodes: int = 2) -> dict:
    """The environment of a SLURM job of `nodes` nodes, with the fake srun first on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    srun = bin_dir / "srun"
    srun.write_text(FAKE_SRUN.format(python=sys.executable))
    srun.chmod(0o755)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242", "SLURM_JOB_NUM_NODES": str(nodes),
            "FAKE_SRUN_LOG": str(tmp_path / "srun.log")}


def train_command(ws, out: Path, *sets: str) -> list[str]:
    """`tiersep train --preset cpu_tiny`, short, no loader workers, with `sets`."""
    return cpu_tiny_command(ws, out, "--set", "train.num_workers=0", *sets)


def outside_slurm(env: dict | None = None) -> dict:
    """This process's environment without the SLURM job it may run in (CI runs inside one), plus `env`."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}, "OMP_NUM_THREADS": "1",
            **(env or {})}


def train(ws, out: Path, *sets: str, env: dict | None = None):
    return subprocess.run(train_command(ws, out, *sets), cwd=REPO, env=outside_slurm(env), text=True,
                          capture_output=True, timeout=300)


def test_the_srun_command_starts_one_torchrun_per_node_meeting_on_this_host():
    child = ["--config", "C", "--preset", "P", "--out", "O"]
    assert launch.srun_torchrun_command(2, 4, "gpu-node-01", 29512, "12345", 16, child) == [
        "srun", "--nodes", "2", "--ntasks", "2", "--ntasks-per-node", "1", "--cpus-per-task", "16",
        "--kill-on-bad-exit=1",
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", "gpu-node-01:29512", "--rdzv-id", "12345",
        "-m", "tiersep.cli", "train", "--config", "C", "--preset", "P", "--out", "O"]


@pytest.mark.parametrize("env, says", [
    ({}, "this process is in none (no SLURM_JOB_ID)"),
    ({"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "1", "PATH": "/usr/bin:/bin"}, "SLURM job 7 has 1 node(s)"),
    ({"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "2", "PATH": "/nonexistent"}, "srun is not on PATH"),
])
def test_an_allocation_without_the_nodes_is_one_line(env, says, tmp_path):
    if "srun is not" not in says and "SLURM_JOB_ID" in env:
        env = {**env, **{k: v for k, v in fake_slurm(tmp_path).items() if k == "PATH"}}
    preset = {"name": "cpu_tiny", "train": {"nodes": 2, "ranks": 4}}
    problem = launch.allocation_problem(preset, env)
    assert problem.startswith("preset cpu_tiny: train.nodes 2: start one torchrun per node inside a SLURM job of 2 "
                              "nodes (sbatch --nodes 2") and problem.endswith(says), problem
    assert "\n" not in problem
    assert launch.allocation_problem({**preset, "train": {"nodes": 1, "ranks": 4}}, env) is None


def test_outside_slurm_several_nodes_stop_with_one_line_and_exit_2(ws, tmp_path):
    done = train(ws, tmp_path / "out", "--set", "train.ranks=2", "--set", "train.nodes=2")
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "no SLURM_JOB_ID" in lines[0] and "sbatch --nodes 2" in lines[0], done.stderr
    assert not (tmp_path / "out").exists()


def test_two_nodes_under_a_faked_srun_train_with_one_rendezvous_and_a_shared_state_folder(ws, tmp_path):
    """train.nodes 2, train.ranks 2: the fake srun runs both node processes (torchrun --nnodes 2,
    one rank each) on localhost; they meet through the c10d rendezvous the launcher named."""
    from tiersep import outputs

    out = tmp_path / "out"
    outputs.claim(out, "train")
    (out / ".ranks.killed00.tmp").mkdir()   # left by a launcher killed earlier: removed, not "not ours"
    started = time.monotonic()
    done = train(ws, out, "--set", "train.ranks=2", "--set", "train.nodes=2", "--set", "train.steps=3",
                 env=fake_slurm(tmp_path))
    seconds = time.monotonic() - started
    print(f"2 node processes under the fake srun, 3 steps: {seconds:.1f} s")
    assert done.returncode == 0, done.stderr[-4000:]
    [argv] = [json.loads(line) for line in (tmp_path / "srun.log").read_text().splitlines()]
    host, _, port = argv[argv.index("--rdzv-endpoint") + 1].rpartition(":")
    import socket

    assert argv[:argv.index("--rdzv-endpoint")] == [
        "--nodes", "2", "--ntasks", "2", "--ntasks-per-node", "1", "--cpus-per-task", str(len(os.sched_getaffinity(0))),
        "--kill-on-bad-exit=1", sys.executable, "-m",
        "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d"]
    assert host == socket.gethostname() and port.isdigit()
    assert argv[argv.index("--rdzv-id") + 1] == "4242"
    # the resolved config and preset went through a tiersep temporary inside the run folder, now gone
    config_arg = Path(argv[argv.index("--config") + 1])
    assert config_arg.parent.parent == out.absolute() and config_arg.parent.name.startswith(".ranks.")
    assert not config_arg.parent.exists()
    assert not [p.name for p in out.iterdir() if p.name.startswith(".ranks")]
    run = json.loads((out / "run.json").read_text())
    assert (run["ranks"], run["nodes"], run["steps"]) == (2, 2, 3)
    assert [r["rank"] for r in run["per_rank"]] == [0, 1]
    assert [r["step"] for r in metrics_rows(out)] == ["1", "2", "3"]
    assert (out / "model.pt").is_file()


def start_two_nodes(ws, out: Path, tmp_path: Path, steps_logged: int) -> subprocess.Popen:
    """A long 2-node cpu_tiny tier (1 rank a node) under the fake SLURM job and srun, once it has
    logged `steps_logged` steps."""
    proc = subprocess.Popen(
        train_command(ws, out, "--set", "train.ranks=2", "--set", "train.nodes=2", "--set", "train.steps=400"),
        cwd=REPO, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=outside_slurm(fake_slurm(tmp_path)))
    deadline = time.time() + 120
    while len(metrics_rows(out)) < steps_logged:
        assert proc.poll() is None and time.time() < deadline, proc.stdout.read()[-3000:]
        time.sleep(0.1)
    return proc


def test_a_node_that_fails_ends_the_job_with_rank_died(ws, tmp_path):
    """One node's torchrun killed (srun's --kill-on-bad-exit ends the other): exit 1, failure.json
    kind rank_died naming the ranks that left no exit code."""
    out = tmp_path / "out"
    proc = start_two_nodes(ws, out, tmp_path, steps_logged=2)
    import psutil

    # a rank's whole "node": the torchrun agent and its rank, killed at once
    agents = [p for p in psutil.Process(proc.pid).children(recursive=True)
              if p.cmdline()[1:3] == ["-m", "torch.distributed.run"]]
    rank1 = [p for p in psutil.Process(proc.pid).children(recursive=True) if p.environ().get("RANK") == "1"]
    [agent] = [a for a in agents if rank1[0] in a.children(recursive=True)]
    for p in (agent, *rank1):
        p.kill()
    code = proc.wait(timeout=90)
    log = proc.stdout.read()
    assert code == 1, log[-3000:]
    failure = json.loads((out / "failure.json").read_text())
    assert failure["kind"] == "rank_died" and 1 in failure["ranks_failed"], failure


def test_sigterm_to_the_launcher_goes_through_srun_and_stops_both_nodes_with_one_checkpoint(ws, tmp_path):
    """SIGTERM to the launching process: it passes it to srun (whose tasks may be on other
    machines, so no rank pid is signalled directly), srun to each node's torchrun, torchrun to its
    rank; the ranks stop at one step, rank 0 writes the checkpoint once, exit 75."""
    import signal

    from tiersep.train.checkpoint import load_checkpoint

    out = tmp_path / "out"
    proc = start_two_nodes(ws, out, tmp_path, steps_logged=3)
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=90)
    log = proc.stdout.read()
    assert code == 75, log[-3000:]
    assert log.count("wrote") == 1 and "SIGTERM at step" in log, log[-3000:]
    assert load_checkpoint(out / "checkpoints" / "last.pt")["step"] == int(metrics_rows(out)[-1]["step"]) >= 3
    assert not [p.name for p in out.iterdir() if p.name.startswith(".ranks")]


class _Resources(dict):
    __getattr__ = dict.__getitem__


@pytest.mark.parametrize("resources, wanted, unwanted", [
    # a GPU tier of 4 ranks on 2 nodes: what workflow/rules/common.smk gives it
    ({"gpu": 0, "nodes": 2, "tasks": 2, "tasks_per_gpu": 0, "gres": "gpu:2", "mpi": 1},
     ["--nodes=2", "--ntasks=2", "--gres=gpu:2"], ["--gpus", "--ntasks-per-gpu"]),
    # a 2-rank GPU tier on one node: as before (--gpus=2, no task options)
    ({"gpu": 2, "nodes": 1, "tasks": 1, "tasks_per_gpu": 0, "gres": "", "mpi": 0},
     ["--nodes=1", "--gpus=2"], ["--gres", "--ntasks", "--ntasks-per-gpu"]),
    # a CPU tier on 2 nodes
    ({"gpu": 0, "nodes": 2, "tasks": 2, "tasks_per_gpu": 0, "gres": "", "mpi": 1},
     ["--nodes=2", "--ntasks=2"], ["--gres", "--gpus"]),
])
def test_the_slurm_plugin_makes_the_train_rules_resources_sbatch_options(resources, wanted, unwanted):
    """The train rule's resources through the installed snakemake-executor-plugin-slurm's own sbatch
    builder: nodes, one task per node, GPUs per node as gres (gpu= is --gpus, the job's total)."""
    submit = pytest.importorskip("snakemake_executor_plugin_slurm.submit_string")
    from snakemake_executor_plugin_slurm.utils import set_gres_string

    rule = (REPO / "workflow" / "rules" / "train.smk").read_text()
    for line in ("nodes=train_nodes,", "tasks=train_nodes,", "tasks_per_gpu=0,", "gres=train_gres,",
                 "mpi=train_multi_node,", "gpu=train_ranks_per_node,"):
        assert line in rule
    job = type("Job", (), {"resources": _Resources(resources, threads=2, runtime=60, mem_mb=8000), "threads": 2,
                           "is_group": lambda self: False, "name": "train", "wildcards": {}})()
    params = {"run_uuid": "u", "slurm_logfile": "l", "comment_str": "c", "account": "", "partition": "",
              "workdir": None}
    call = submit.get_submit_command(job, params) + set_gres_string(job)
    options = call.split()
    for option in wanted:
        assert option in options, call
    for option in unwanted:
        assert not [o for o in options if o.split("=")[0] == option], call
