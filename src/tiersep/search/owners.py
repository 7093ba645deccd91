"""Several orchestrators on one study (many hosts, or SLURM jobs): who owns each RUNNING trial,
and one lock around the decisions that must not interleave.

Every trial an orchestrator runs carries its owner in user attributes: `owner_host` (hostname),
`owner_pid` and `owner_started` (the process's start time, so a later process given the same pid
is not mistaken for it), `owner_slurm_job` (SLURM_JOB_ID, when it runs in a SLURM job) and
`heartbeat` (wall-clock seconds, refreshed while the owner lives). Another orchestrator takes a
RUNNING trial over only when it is abandoned:
- on this host: its owner process is gone;
- on another host: its heartbeat is older than `search.heartbeat_seconds` (hosts' clocks in sync);
- in the same SLURM job (a requeued job): at once, it is this job's own earlier life;
- with no owner: it was being asked when its orchestrator died (ask and claim happen under the lock).

The lock makes "count the trials, ask one, claim it" and "see an abandoned trial, claim it" atomic
across orchestrators: a PostgreSQL advisory lock on the study's database for a postgresql:// URL,
an flock on results/search/<study>/orchestrators.lock otherwise (one host: the journal file, or
another RDB such as SQLite).
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import socket
import threading
import time
from pathlib import Path

import optuna

from tiersep import config as C

from .trial_process import process_started


def me() -> dict:
    """This orchestrator, as it is written into the trials it owns."""
    return {"owner_host": socket.gethostname(), "owner_pid": os.getpid(),
            "owner_started": process_started(os.getpid()), "owner_slurm_job": os.environ.get("SLURM_JOB_ID")}


def claim(trial: optuna.trial.Trial, owner: dict) -> None:
    for key, value in owner.items():
        trial.set_user_attr(key, value)
    beat(trial)


def beat(trial: optuna.trial.Trial) -> None:
    trial.set_user_attr("heartbeat", time.time())


def owned_by(attrs: dict, owner: dict) -> bool:
    return all(attrs.get(k) == owner[k] for k in ("owner_host", "owner_pid", "owner_started"))


def abandoned(attrs: dict, owner: dict, timeout: float, now: float | None = None) -> str | None:
    """Why a RUNNING trial with user attributes `attrs` may be taken over by `owner`, or None while
    its owner may still be alive."""
    if "owner_host" not in attrs:
        return "no owner (its orchestrator died while asking it)"
    if owned_by(attrs, owner):
        return None
    if owner["owner_slurm_job"] and attrs.get("owner_slurm_job") == owner["owner_slurm_job"]:
        return f"owned by an earlier run of SLURM job {owner['owner_slurm_job']} (requeued)"
    if attrs["owner_host"] == owner["owner_host"]:
        if process_started(attrs.get("owner_pid", -1)) != attrs.get("owner_started"):
            return f"its orchestrator (pid {attrs.get('owner_pid')} on this host) is gone"
        return None
    age = (time.time() if now is None else now) - float(attrs.get("heartbeat", 0))
    if age > timeout:
        return f"its orchestrator on {attrs['owner_host']} sent no heartbeat for {age:.0f} s"
    return None


def same_host(attrs: dict) -> bool:
    """Whether a trial's processes ran on this host (a trial from before owners were recorded did)."""
    return attrs.get("owner_host", socket.gethostname()) == socket.gethostname()


class Heartbeat(threading.Thread):
    """Refreshes the heartbeat of every trial this orchestrator owns, every `every` seconds, from a
    thread (as Optuna's own heartbeat does): a long data preparation or a wait for an old process
    must not make a live owner look gone. A trial that has ended drops out."""

    def __init__(self, every: float):
        super().__init__(daemon=True, name="tiersep-search-heartbeat")
        self.every, self.stopped, self.guard = every, threading.Event(), threading.Lock()
        self.trials: dict[int, object] = {}   # trial id -> its storage

    def add(self, trial: optuna.trial.Trial) -> None:
        with self.guard:
            self.trials[trial._trial_id] = trial.storage

    def run(self) -> None:
        while not self.stopped.wait(self.every):
            with self.guard:
                owned = list(self.trials.items())
            for trial_id, storage in owned:
                try:
                    storage.set_trial_user_attr(trial_id, "heartbeat", time.time())
                except optuna.exceptions.UpdateFinishedTrialError:
                    with self.guard:
                        self.trials.pop(trial_id, None)
                except Exception:   # a storage hiccup: the next beat tries again
                    pass

    def stop(self) -> None:
        self.stopped.set()
        self.join(timeout=30)


class StudyLock:
    """A lock shared by every orchestrator of study `name` (see the module docstring); reentrant
    use is not needed, and it is held only around short decisions."""

    def __init__(self, storage_url: str | None, folder: Path, name: str, source: str = "config"):
        self.key = int.from_bytes(hashlib.sha256(f"tiersep-search:{name}".encode()).digest()[:8], "big") >> 1
        self.connection = self.file = None
        if storage_url and storage_url.startswith(("postgresql", "postgres://")):
            import sqlalchemy

            try:
                self.engine = sqlalchemy.create_engine(storage_url, poolclass=sqlalchemy.pool.NullPool)
                self.connection = self.engine.connect()
            except (ImportError, sqlalchemy.exc.SQLAlchemyError) as err:
                raise C.ConfigError(f"{source}: search.storage: cannot connect to {storage_url}: "
                                    f"{C.escape_line_breaks(str(err))}") from None
            self.sql = sqlalchemy.text
        else:
            folder.mkdir(parents=True, exist_ok=True)
            self.path = folder / "orchestrators.lock"

    def __enter__(self):
        if self.connection is not None:
            self.connection.execute(self.sql("SELECT pg_advisory_lock(:k)"), {"k": self.key})
            self.connection.commit()
        else:
            self.file = open(self.path, "a")
            fcntl.flock(self.file, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        if self.connection is not None:
            self.connection.execute(self.sql("SELECT pg_advisory_unlock(:k)"), {"k": self.key})
            self.connection.commit()
        else:
            fcntl.flock(self.file, fcntl.LOCK_UN)
            self.file.close()
            self.file = None
        return False

    def close(self) -> None:
        if self.connection is not None:
            self.connection.close()
            self.engine.dispose()
            self.connection = None
