"""A search shared by several orchestrators: a REAL PostgreSQL server (Debian's package, started by
the fixture, tests/postgres_support.py), real `tiersep search` processes, real Optuna RDB storage,
real `tiersep train` trials on a tiny prepared dataset. (The study whose every trial is its own
SLURM job is in tests/test_cluster_slurm.py, with every test of the SLURM test cluster.)"""
from __future__ import annotations

import os
import subprocess
import sys
import time

import optuna
import pytest
from optuna.trial import TrialState

from postgres_support import start_postgres
from test_search_support import env, search_workspace, trials_csv, write_search_config
from test_train_support import REPO
from tiersep import config as C
from tiersep.search import owners


@pytest.fixture(scope="module")
def postgres():
    url, stop = start_postgres()
    try:
        yield url
    finally:
        stop()


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    return search_workspace(tmp_path_factory.mktemp("hosts"))


def study_of(url: str, name: str) -> optuna.Study:
    return optuna.load_study(study_name=name, storage=url)


def start_search(config, *flags, log) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tiersep.cli", "search", "--config", str(config), *flags],
                            stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env())


# ---- who may take a RUNNING trial over (owners.abandoned), without a server ----------------------

def test_a_running_trial_is_taken_over_only_when_its_owner_is_gone():
    mine = owners.me()
    alive_here = dict(mine, owner_pid=os.getppid(), owner_started=owners.process_started(os.getppid()))
    dead_here = dict(mine, owner_pid=alive_here["owner_pid"], owner_started=1.0)   # pid reused by another process
    elsewhere = dict(mine, owner_host="another-host", owner_pid=os.getpid())
    now = time.time()
    assert owners.abandoned({}, mine, 60).startswith("no owner")
    assert owners.abandoned(dict(mine, heartbeat=0), mine, 60) is None                    # my own
    assert owners.abandoned(dict(alive_here, heartbeat=0), mine, 60) is None              # alive on this host
    assert "is gone" in owners.abandoned(dict(dead_here, heartbeat=now), mine, 60)
    assert owners.abandoned(dict(elsewhere, heartbeat=now - 30), mine, 60, now) is None   # heartbeat fresh
    assert "no heartbeat for 90 s" in owners.abandoned(dict(elsewhere, heartbeat=now - 90), mine, 60, now)
    # a requeued SLURM job (same job id, maybe another node) takes its own trial back at once
    job = dict(mine, owner_slurm_job="41")
    assert "requeued" in owners.abandoned(dict(elsewhere, owner_slurm_job="41", heartbeat=now), job, 60, now)
    assert owners.abandoned(dict(elsewhere, owner_slurm_job="40", heartbeat=now), job, 60, now) is None


# ---- PostgreSQL -------------------------------------------------------------------------------

def test_the_study_lock_excludes_another_process_on_postgresql(postgres, tmp_path):
    """The advisory lock held here keeps a second process (its own connection) waiting."""
    probe = ("import sys, time; from pathlib import Path; from tiersep.search.owners import StudyLock\n"
             "lock = StudyLock(sys.argv[1], Path(sys.argv[2]), 'locked')\n"
             "with lock: print(time.time(), flush=True)\n"
             "lock.close()\n")
    lock = owners.StudyLock(postgres, tmp_path, "locked")
    with lock:
        child = subprocess.Popen([sys.executable, "-c", probe, postgres, str(tmp_path)], stdout=subprocess.PIPE,
                                 text=True, env=env())
        time.sleep(3)
        assert child.poll() is None, "the second process got the lock while it was held"
        released = time.time()
    out, _ = child.communicate(timeout=60)
    lock.close()
    assert child.returncode == 0 and float(out.split()[0]) >= released


def test_a_bad_postgresql_url_ends_in_one_line(ws, tmp_path):
    config = write_search_config(ws, "badurl", trials=1, storage=f"postgresql://nobody@127.0.0.1:{_closed_port()}/x",
                                 space={"train.lr": {"low": 1.0e-3, "high": 1.0e-2, "log": True}})
    done = subprocess.run([sys.executable, "-m", "tiersep.cli", "search", "--config", str(config)],
                          capture_output=True, text=True, cwd=REPO, env=env(), timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "search.storage: cannot connect to postgresql://" in lines[0], lines


def _closed_port() -> int:
    from postgres_support import free_port

    return free_port()


@pytest.mark.slow
def test_two_orchestrators_share_one_postgresql_study_with_no_duplicate(postgres, ws):
    """Two `tiersep search` processes started together on one study in PostgreSQL: exactly 4 trials,
    numbers 0-3, each run once by one of them, both take part, both end 0."""
    config = write_search_config(ws, "two", trials=4, parallel=1, pruner="none", study="two", storage=postgres,
                                 space={"train.lr": {"low": 1.0e-3, "high": 1.0e-2, "log": True}})
    logs = [open(ws["root"] / f"two-{i}.log", "w") for i in range(2)]
    procs = [start_search(config, log=log) for log in logs]
    codes = [p.wait(timeout=900) for p in procs]
    text = [(ws["root"] / f"two-{i}.log").read_text() for i in range(2)]
    assert codes == [0, 0], text
    trials = study_of(postgres, "two").get_trials()
    assert [t.number for t in trials] == [0, 1, 2, 3]
    assert all(t.state == TrialState.COMPLETE and t.user_attrs["launches"] == 1 for t in trials), trials
    owners_pid = [t.user_attrs["owner_pid"] for t in trials]
    assert set(owners_pid) == {p.pid for p in procs}, owners_pid   # both took part, nobody else
    for i, proc in enumerate(procs):   # each started exactly the trials it owns, once
        started = sorted(int(n) for n in _started(text[i]))
        assert started == sorted(t.number for t in trials if t.user_attrs["owner_pid"] == proc.pid), text[i]
    assert "taking it over" not in text[0] + text[1]
    folder = ws["root"] / "results-two" / "search" / "two"
    assert [r["state"] for r in trials_csv(folder)] == ["COMPLETE"] * 4
    assert all(len(t.params) == 1 and "train.lr" in t.params for t in trials)
    assert len({t.params["train.lr"] for t in trials}) == 4


def _started(log: str) -> list[str]:
    import re

    return re.findall(r"trial (\d+): fits, .*; started pid", log)


@pytest.mark.slow
def test_a_live_owners_trial_is_left_alone_and_an_abandoned_one_is_taken_over(postgres, ws):
    """Trial 0 is RUNNING under a live orchestrator of this host (this test process), trial 1 under
    one on another host whose heartbeat stopped: a new orchestrator takes over and runs trial 1 only,
    waits for trial 0, and ends when its owner tells it."""
    from tiersep.search.orchestrator import Search
    from tiersep.search.study import open_study

    config = write_search_config(ws, "takeover", trials=2, parallel=1, pruner="none", study="takeover",
                                 storage=postgres, space={"train.lr": {"low": 1.0e-3, "high": 1.0e-2, "log": True}})
    s = Search(C.load_config(config))
    study = open_study(s.search, s.base, s.dims, s.folder, s.source)
    distributions = {k: d.distribution() for k, d in s.dims.items()}
    live, gone = study.ask(distributions), study.ask(distributions)
    owners.claim(live, owners.me())
    owners.claim(gone, dict(owners.me(), owner_host="another-host", owner_pid=12345))
    gone.set_user_attr("heartbeat", time.time() - 600)
    log = open(ws["root"] / "takeover.log", "w")
    proc = start_search(config, log=log)
    deadline = time.monotonic() + 600
    while study_of(postgres, "takeover").trials[1].state == TrialState.RUNNING and time.monotonic() < deadline:
        assert proc.poll() is None, (ws["root"] / "takeover.log").read_text()
        time.sleep(1)
    text = (ws["root"] / "takeover.log").read_text()
    trials = study_of(postgres, "takeover").trials
    assert trials[1].state == TrialState.COMPLETE and trials[1].user_attrs["owner_pid"] == proc.pid, text
    assert "trial 1: taking it over: its orchestrator on another-host sent no heartbeat for" in text
    # trial 0 is still ours: RUNNING, owner unchanged, never started by the other orchestrator
    time.sleep(3)
    assert proc.poll() is None, "the orchestrator ended while a live owner's trial was RUNNING"
    trials = study_of(postgres, "takeover").trials
    assert trials[0].state == TrialState.RUNNING and trials[0].user_attrs["owner_pid"] == os.getpid()
    assert "trial 0" not in (ws["root"] / "takeover.log").read_text()
    study.tell(live, 0.0)
    assert proc.wait(timeout=120) == 0, (ws["root"] / "takeover.log").read_text()
    assert [t.state for t in study_of(postgres, "takeover").trials] == [TrialState.COMPLETE] * 2
