"""Stale Snakemake locks: a run killed with SIGKILL (or by a crash) leaves .snakemake/locks/ behind,
and the same command then stops with "Directory cannot be locked". The lock holds no process id,
so whether it is stale is decided here: no snakemake process and no tiersep job of this working
directory is alive on this machine (psutil: command line and current directory). Only then is it
removed (what `snakemake --unlock` does); a live run's lock is never touched.

    python -m tiersep.lock [--workdir DIR] [--snakemake PATH]   # before `snakemake` (make run, make report)

The workflow also calls remove_stale_lock() while Snakemake reads the Snakefile, before it takes
its lock, so a plain `snakemake ...` recovers by itself. Processes on other machines (cluster jobs)
are not visible: there, unlock by hand once the old run is known to be gone.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

import psutil

LOCK_DIR = Path(".snakemake") / "locks"


def lock_files(workdir: str | Path) -> list[Path]:
    """The lock files Snakemake keeps in `workdir` (empty: not locked)."""
    folder = Path(workdir) / LOCK_DIR
    return sorted(folder.glob("*.lock")) if folder.is_dir() else []


def _program(cmdline: list[str]) -> str | None:
    """'snakemake' or 'tiersep' when the command line runs one of them (directly, through a python
    interpreter, or with -m), else None."""
    if not cmdline:
        return None
    args = list(cmdline)
    if os.path.basename(args[0]).startswith("python"):
        args = args[1:]
        if len(args) >= 2 and args[0] == "-m":
            args = [args[1].split(".")[0]]
    if not args:
        return None
    name = os.path.basename(args[0])
    return name if name in ("snakemake", "tiersep") else None


def live_processes(workdir: str | Path, exclude: set[int] | None = None) -> list[dict]:
    """snakemake and tiersep processes whose current directory is `workdir`: [{pid, program,
    cmdline}], without the pids in `exclude` (the caller and its ancestors by default)."""
    if exclude is None:
        me = psutil.Process()
        exclude = {me.pid, *(p.pid for p in me.parents())}
    target = os.path.realpath(workdir)
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        if proc.pid in exclude:
            continue
        program = _program(proc.info["cmdline"] or [])
        if program is None:
            continue
        try:
            if os.path.realpath(proc.cwd()) != target:
                continue
        except (psutil.Error, OSError):  # gone, a zombie, or another user's
            continue
        found.append({"pid": proc.pid, "program": program, "cmdline": " ".join(proc.info["cmdline"])})
    return found


def stale_lock(workdir: str | Path) -> tuple[bool, str]:
    """(whether `workdir` holds a lock that no live process owns, what was found, in words)."""
    locks = lock_files(workdir)
    if not locks:
        return False, f"{Path(workdir) / LOCK_DIR}: no lock"
    alive = live_processes(workdir)
    if alive:
        names = "; ".join(f"pid {p['pid']}: {p['cmdline'][:120]}" for p in alive[:3])
        return False, f"{Path(workdir) / LOCK_DIR}: held by a running process in this directory ({names})"
    return True, (f"{Path(workdir) / LOCK_DIR}: stale ({len(locks)} lock files, no snakemake or tiersep "
                  "process is running in this directory)")


def remove_stale_lock(workdir: str | Path = ".", snakemake: str | None = None) -> str | None:
    """Unlock `workdir` when its lock is stale; returns what was done (None: nothing to do).

    snakemake: run `<snakemake> --unlock` in `workdir`; without it the lock folder is removed
    directly (inside a running Snakemake, which cannot start another on itself)."""
    stale, why = stale_lock(workdir)
    if not stale:
        return None if not lock_files(workdir) else f"left alone: {why}"
    if snakemake:
        subprocess.run([snakemake, "--unlock", "--cores", "1"], cwd=workdir, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    else:
        shutil.rmtree(Path(workdir) / LOCK_DIR)
    return f"unlocked {why}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tiersep.lock", description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", default=".", help="Snakemake working directory (default .)")
    parser.add_argument("--snakemake", help="snakemake executable to run --unlock with (default: "
                        "remove .snakemake/locks directly)")
    args = parser.parse_args(argv)
    try:
        done = remove_stale_lock(args.workdir, args.snakemake)
    except subprocess.CalledProcessError as err:
        last = (err.stderr or "").strip().splitlines()[-1:] or [f"exit {err.returncode}"]
        print(f"tiersep: snakemake --unlock failed in {args.workdir}: {last[0]}", file=sys.stderr)
        return 1
    if done:
        print(f"tiersep: {done}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
