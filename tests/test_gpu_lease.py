"""GPU leases (tiersep.gpu_lease), with real processes on a simulated multi-GPU machine: NVML is
replaced by the test-only TIERSEP_FAKE_GPUS device list, and each lessee is a real Python process
holding a real flock in a lease folder of the test's own."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO
from tiersep import cli, gpu_info, gpu_lease

# One lessee: wait at the barrier (so that all of them ask at the same moment), lease, record what
# it got and when, hold it for HOLD seconds (forever when < 0), exit.
LESSEE = r"""
import json, os, sys, time
from pathlib import Path
from tiersep import gpu_info, gpu_lease

out, hold = Path(sys.argv[1]), float(sys.argv[2])
(out.parent / (out.name + ".ready")).touch()
go = out.parent / "go"
while not go.exists():
    time.sleep(0.005)
lease = gpu_lease.lease_gpus("lessee " + out.stem, int(os.environ.get("LESSEE_GPUS", "1")))
got = time.time()
record = {"pid": os.getpid(), "index": lease.index, "got": got, "waited": lease.waited_seconds,
          "cuda_visible_devices": os.environ["CUDA_VISIBLE_DEVICES"], "lease": lease.record(),
          "free_bytes_seen": gpu_info.free_bytes(), "name_seen": gpu_info.name()}
out.with_suffix(".holding").write_text(json.dumps(record))
if hold < 0:
    time.sleep(600)
time.sleep(hold)
record["released"] = time.time()
out.write_text(json.dumps(record))
"""


@pytest.fixture
def machine(tmp_path, monkeypatch):
    """A simulated machine: its lease folder, and the environment its processes run with."""
    leases = tmp_path / "leases"
    env = {k: v for k, v in os.environ.items() if k not in (gpu_lease.VISIBLE_ENV, gpu_lease.HELD_ENV)}
    env.update({gpu_lease.LEASE_DIR_ENV: str(leases), gpu_info.FAKE_GPUS_ENV: "2",
                gpu_lease.TIMEOUT_ENV: "60", "PYTHONPATH": str(REPO / "src")})
    for key in (gpu_lease.VISIBLE_ENV, gpu_lease.HELD_ENV):
        monkeypatch.delenv(key, raising=False)
    return {"dir": tmp_path, "leases": leases, "env": env}


def start_lessees(machine, names: list[str], hold: float, **env) -> dict[str, subprocess.Popen]:
    """Start one lessee process per name and wait until all of them are at the barrier."""
    procs = {name: subprocess.Popen([sys.executable, "-c", LESSEE, str(machine["dir"] / f"{name}.json"), str(hold)],
                                    env={**machine["env"], **env}, stderr=subprocess.PIPE, text=True)
             for name in names}
    deadline = time.time() + 60
    while not all((machine["dir"] / f"{name}.json.ready").exists() for name in names):
        assert time.time() < deadline, "the lessees did not start"
        assert all(p.poll() is None for p in procs.values()), [p.stderr.read() for p in procs.values()]
        time.sleep(0.01)
    return procs


def finish(procs: dict[str, subprocess.Popen], timeout: float = 60) -> dict[str, str]:
    """Wait for every lessee; their stderr by name (each must have exited 0)."""
    errs = {}
    for name, proc in procs.items():
        _, errs[name] = proc.communicate(timeout=timeout)
        assert proc.returncode == 0, f"{name} exited {proc.returncode}: {errs[name]}"
    return errs


def wait_for(path: Path, timeout: float = 30) -> dict:
    deadline = time.time() + timeout
    while not path.exists():
        assert time.time() < deadline, f"{path} never appeared"
        time.sleep(0.01)
    time.sleep(0.05)   # written in one call; let it land
    return json.loads(path.read_text())


def test_four_lessees_on_two_gpus_two_wait_and_never_share_a_gpu(machine):
    names = ["a", "b", "c", "d"]
    procs = start_lessees(machine, names, hold=1.0)
    (machine["dir"] / "go").touch()
    errs = finish(procs)
    got = {n: json.loads((machine["dir"] / f"{n}.json").read_text()) for n in names}

    # Who waited is read from the locks, not the clock: a lessee that found every GPU's lock taken
    # says so once ("waiting for a free GPU"), and got its GPU only after a holder released it.
    waited = {n for n in names if "waiting for a free GPU" in errs[n]}
    assert len(waited) == 2, errs                              # two start at once, two wait
    for name in waited:
        released = [r["released"] for n, r in got.items() if n not in waited and r["index"] == got[name]["index"]]
        assert released and got[name]["got"] >= min(released), got
    for index in (0, 1):
        spans = sorted((r["got"], r["released"]) for r in got.values() if r["index"] == index)
        assert len(spans) == 2, got
        assert spans[0][1] <= spans[1][0], f"GPU {index} held twice at once: {spans}"
    for name, r in got.items():
        assert r["cuda_visible_devices"] == str(r["index"])  # the job sees its GPU alone, as cuda:0
        assert r["name_seen"] == f"Fake GPU {r['index']}"     # and NVML readings are of that GPU
        assert r["lease"]["lock"] == str(machine["leases"] / f"gpu{r['index']}.lock")

    first = {r["index"]: r["pid"] for n, r in got.items() if n not in waited}
    for name in waited:   # one line, naming each GPU and the process that holds it
        waiting = [line for line in errs[name].splitlines() if "waiting for a free GPU" in line]
        assert len(waiting) == 1, errs[name]
        assert all(f"GPU {i} held by pid {pid} on " in waiting[0] for i, pid in first.items()), waiting[0]


def test_a_sigkilled_lessee_frees_its_gpu(machine):
    env = {gpu_info.FAKE_GPUS_ENV: "1"}
    holder = start_lessees(machine, ["holder"], hold=-1, **env)["holder"]
    (machine["dir"] / "go").touch()
    assert wait_for(machine["dir"] / "holder.holding")["index"] == 0
    waiter = start_lessees(machine, ["waiter"], hold=0, **env)["waiter"]
    assert waiter.stderr.readline().startswith("tiersep lessee waiter: waiting for a free GPU: GPU 0 held by "
                                               f"pid {holder.pid} on ")
    killed_at = time.time()
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=10)
    finish({"waiter": waiter})
    after = json.loads((machine["dir"] / "waiter.json").read_text())
    assert after["index"] == 0
    assert 0 <= after["got"] - killed_at < 5, after["got"] - killed_at


def test_within_cuda_visible_devices_and_the_leased_one_alone(machine):
    """CUDA_VISIBLE_DEVICES=1,3 on a 4-GPU machine: the leases are 1 and 3, each job then sees only
    its own, and gpu_info's free memory is that GPU's (the gate's reading)."""
    gib = 2**30
    fake = [{"free": 10 * gib}, {"free": 11 * gib}, {"free": 12 * gib}, {"free": 13 * gib}]
    procs = start_lessees(machine, ["x", "y"], hold=1.0, **{gpu_info.FAKE_GPUS_ENV: json.dumps(fake),
                                                            gpu_lease.VISIBLE_ENV: "1,3"})
    (machine["dir"] / "go").touch()
    errs = finish(procs)
    got = [json.loads((machine["dir"] / f"{n}.json").read_text()) for n in ("x", "y")]
    assert sorted(r["index"] for r in got) == [1, 3]
    for r in got:
        assert r["cuda_visible_devices"] == str(r["index"])
        assert r["lease"]["visible_before"] == "1,3"
        assert r["free_bytes_seen"] == fake[r["index"]]["free"]
    assert not any("waiting for a free GPU" in err for err in errs.values()), errs   # two GPUs, two jobs
    assert sorted(p.name for p in machine["leases"].iterdir()) == ["gpu1.lock", "gpu3.lock"]


def test_most_free_gpu_first_and_uuids_when_choosing_among_all(machine, monkeypatch):
    """Without CUDA_VISIBLE_DEVICES, the lease takes the GPU with the most free memory and names it
    by UUID (CUDA's own order may differ from NVML's; a UUID is the same GPU in both)."""
    gib = 2**30
    fake = [{"uuid": "GPU-aaaa", "free": 2 * gib}, {"uuid": "GPU-bbbb", "free": 9 * gib}]
    procs = start_lessees(machine, ["u"], hold=0, **{gpu_info.FAKE_GPUS_ENV: json.dumps(fake)})
    (machine["dir"] / "go").touch()
    finish(procs)
    got = json.loads((machine["dir"] / "u.json").read_text())
    assert (got["index"], got["cuda_visible_devices"], got["free_bytes_seen"]) == (1, "GPU-bbbb", 9 * gib)
    assert got["lease"]["uuid"] == "GPU-bbbb"


def test_a_job_of_several_ranks_holds_none_while_it_waits_for_all(machine):
    """Two ranks on a 2-GPU machine of which one is taken: the 2-GPU job waits holding nothing (two
    such jobs could each hold one and wait forever), so a 1-GPU job started after it gets GPU 1."""
    holder = start_lessees(machine, ["holder"], hold=-1)["holder"]
    (machine["dir"] / "go").touch()
    assert wait_for(machine["dir"] / "holder.holding")["index"] == 0
    pair = start_lessees(machine, ["pair"], hold=0, LESSEE_GPUS="2")["pair"]
    assert "waiting for a free GPU" in pair.stderr.readline()
    single = start_lessees(machine, ["single"], hold=0)
    finish(single)
    assert json.loads((machine["dir"] / "single.json").read_text())["index"] == 1
    holder.kill()
    holder.wait()
    finish({"pair": pair})
    got = json.loads((machine["dir"] / "pair.json").read_text())
    assert got["cuda_visible_devices"] == "0,1" and [g["index"] for g in got["lease"]["gpus"]] == [0, 1]


def test_the_wait_times_out_with_one_line_and_exit_6(machine):
    """The real `tiersep train` on a machine whose only visible GPU is taken: one waiting line, then
    one error line naming the GPU and its holder, exit 6, no traceback, nothing written."""
    env = {gpu_info.FAKE_GPUS_ENV: "1"}
    holder = start_lessees(machine, ["holder"], hold=-1, **env)["holder"]
    (machine["dir"] / "go").touch()
    wait_for(machine["dir"] / "holder.holding")
    out = machine["dir"] / "run"
    data = machine["dir"] / "data"   # a prepared folder's manifest: train checks it before the lease
    data.mkdir(exist_ok=True)
    (data / "manifest.json").write_text("{}")
    try:
        began = time.time()
        proc = subprocess.run([sys.executable, "-m", "tiersep.cli", "train", "--preset", "cpu_tiny",
                               "--data", str(data), "--out", str(out), "--set", "train.device=cuda"],
                              cwd=REPO, env={**machine["env"], **env, gpu_lease.TIMEOUT_ENV: "0.5"},
                              capture_output=True, text=True, timeout=120)
    finally:
        holder.kill()
        holder.wait()
    assert proc.returncode == gpu_lease.EXIT_NO_GPU == 6, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert "Traceback" not in proc.stderr and len(lines) == 2, proc.stderr
    assert lines[0].startswith("tiersep train: waiting for a free GPU: GPU 0 held by ")
    assert lines[1].startswith(f"tiersep train: error: no free GPU within 0.5 s: GPU 0 held by pid {holder.pid} on ")
    assert f"leases in {machine['leases']}" in lines[1]
    assert time.time() - began < 60 and not out.exists()


def test_a_bad_timeout_is_one_line():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(gpu_lease.TIMEOUT_ENV, "soon")
        with pytest.raises(gpu_lease.ConfigError, match="TIERSEP_GPU_LEASE_TIMEOUT='soon'"):
            gpu_lease.timeout_seconds()


def test_cpu_jobs_and_machines_without_gpus_take_no_lease(machine, monkeypatch):
    """The train, evaluate and separate hook: device cpu never leases, even with GPUs present; auto
    leases only when a GPU is visible; nothing is created in the lease folder."""
    monkeypatch.setenv(gpu_lease.LEASE_DIR_ENV, str(machine["leases"]))
    monkeypatch.setenv(gpu_info.FAKE_GPUS_ENV, "2")
    assert cli.lease_gpu("cpu", "train") is None
    monkeypatch.setenv(gpu_info.FAKE_GPUS_ENV, "0")
    assert cli.lease_gpu("auto", "evaluate") is None
    monkeypatch.setenv(gpu_info.FAKE_GPUS_ENV, "2")
    monkeypatch.setenv(gpu_lease.VISIBLE_ENV, "")      # every GPU hidden: nothing to lease
    assert cli.lease_gpu("auto", "separate") is None
    assert gpu_lease.current() is None and not machine["leases"].exists()


def test_a_real_cpu_train_job_takes_no_lease(machine, tmp_path):
    """`tiersep train` with train.device=cpu on a machine with (fake) GPUs: it runs to its first
    real check (here: the data folder is missing, exit 2) without leasing anything."""
    proc = subprocess.run([sys.executable, "-m", "tiersep.cli", "train", "--preset", "cpu_tiny",
                           "--data", str(tmp_path / "missing"), "--out", str(tmp_path / "run"),
                           "--set", "train.device=cpu"],
                          cwd=REPO, env=machine["env"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "leased" not in proc.stderr and not machine["leases"].exists()


def test_a_child_of_a_lessee_is_covered_by_its_lease(machine):
    """A process started by a lessee (CUDA_VISIBLE_DEVICES and TIERSEP_GPU_LEASE_HELD inherited)
    does not wait for its own parent's GPU."""
    snippet = ("import os, subprocess, sys; from tiersep import gpu_lease; "
               "lease = gpu_lease.lease_gpus('parent'); "
               "child = 'from tiersep import gpu_lease; l = gpu_lease.lease_gpus(\"child\"); "
               "print(l.inherited, l.index, l.record()[\"cuda_visible_devices\"])'; "
               "print(subprocess.run([sys.executable, '-c', child], env={**os.environ, "
               f"'{gpu_lease.TIMEOUT_ENV}': '0'}}, capture_output=True, text=True, check=True).stdout.strip())")
    proc = subprocess.run([sys.executable, "-c", snippet], env={**machine["env"], gpu_info.FAKE_GPUS_ENV: "1"},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "True 0 0"


def test_nvml_readings_follow_cuda_visible_devices(monkeypatch):
    """gpu_info maps CUDA's numbering onto NVML's: by index, by UUID prefix, and none when hidden."""
    gib = 2**30
    fake = [{"uuid": "GPU-aaaa", "free": 1 * gib}, {"uuid": "GPU-bbbb", "free": 2 * gib},
            {"uuid": "GPU-cccc", "free": 3 * gib}, {"uuid": "GPU-dddd", "free": 4 * gib}]
    monkeypatch.setenv(gpu_info.FAKE_GPUS_ENV, json.dumps(fake))
    monkeypatch.setenv(gpu_lease.VISIBLE_ENV, "1,3")
    assert (gpu_info.nvml_index(0), gpu_info.nvml_index(1), gpu_info.nvml_index(2)) == (1, 3, None)
    assert gpu_info.free_bytes() == 2 * gib
    monkeypatch.setenv(gpu_lease.VISIBLE_ENV, "GPU-ccc,GPU-a,-1,0")   # CUDA ignores from the bad entry on
    assert gpu_info.visible_entries() == ["GPU-ccc", "GPU-a"]
    assert (gpu_info.nvml_index(0), gpu_info.nvml_index(1)) == (2, 0)
    assert gpu_info.name() == "Fake GPU 2" and gpu_info.processes() == []
    monkeypatch.setenv(gpu_lease.VISIBLE_ENV, "")
    assert gpu_info.free_bytes() is None and gpu_info.name() is None
    monkeypatch.delenv(gpu_lease.VISIBLE_ENV)
    assert gpu_info.free_bytes() == 1 * gib


def test_calibrate_leases_the_gpu_it_measures(machine, tmp_path):
    """`tiersep calibrate` runs a step on the GPU, so it leases one first (here the fake GPU; then
    torch finds no CUDA and calibrate stops with its own one-line error)."""
    proc = subprocess.run([sys.executable, "-m", "tiersep.cli", "calibrate", "--out", str(tmp_path / "c.json")],
                          cwd=REPO, env=machine["env"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "tiersep calibrate: leased GPU 0 (Fake GPU 0); CUDA_VISIBLE_DEVICES=0" in proc.stderr
    assert (machine["leases"] / "gpu0.lock").is_file()


def test_run_json_records_the_lease(machine, tmp_path):
    """A real `tiersep train` with train.device auto on a machine with one (fake) GPU leases it, and
    run.json says which; torch finds no CUDA here, so the 2 steps run on the CPU. The same run with
    device cpu records no lease."""
    from test_train_support import cli_train, make_workspace

    ws = make_workspace(tmp_path / "ws")
    env = {k: v for k, v in machine["env"].items() if k != "PYTHONPATH"}
    runs = {}
    for device in ("auto", "cpu"):
        out = tmp_path / f"run_{device}"
        proc = cli_train(ws, out, "--set", f"train.device={device}", "--set", "train.steps=2", env=env)
        assert proc.wait(timeout=300) == 0, Path(str(out) + ".log").read_text()
        runs[device] = json.loads((out / "run.json").read_text())
    lease = runs["auto"]["gpu_lease"]
    assert (lease["index"], lease["name"], lease["cuda_visible_devices"]) == (0, "Fake GPU 0", "0")
    assert lease["lock"] == str(machine["leases"] / "gpu0.lock") and lease["visible_before"] is None
    assert runs["auto"]["device_type"] == "cpu" and runs["cpu"]["gpu_lease"] is None


def test_a_torchrun_rank_without_its_launchers_lease_takes_none(machine, monkeypatch):
    """Ranks that torchrun starts directly (several nodes, under srun) share the node's GPUs: none of
    them leases (each asking for all of them would wait for the others until the timeout)."""
    monkeypatch.setenv(gpu_lease.LEASE_DIR_ENV, str(machine["leases"]))
    monkeypatch.setenv(gpu_info.FAKE_GPUS_ENV, "2")
    monkeypatch.setenv(gpu_lease.TORCHRUN_ENV, "job-1")
    assert cli.lease_gpu("cuda", "train", count=2) is None
    assert gpu_lease.current() is None and not machine["leases"].exists()
