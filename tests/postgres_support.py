"""A throw-away PostgreSQL server for the many-host search tests (no tests here).

Debian's server binaries (`apt-get install -y postgresql`, in the Makefile's test-system-deps) live
under /usr/lib/postgresql/<version>/bin. The server gets its own data directory in /tmp, listens
on 127.0.0.1 at a free port (and its own unix socket dir), trusts local connections, and is
stopped by pg_ctl at the end. PostgreSQL refuses to run as root, so as root every server command
runs as the Debian package's `postgres` user (runuser).
"""
from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

import pytest

APT_LINE = "apt-get install -y postgresql"


def server_bin() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"), key=lambda p: int(Path(p).parts[-3]))
    if found:
        return Path(found[-1]).parent
    pg_ctl = shutil.which("pg_ctl")
    return Path(pg_ctl).parent if pg_ctl else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_postgres():
    """Start a server; returns (URL, stop function). Skips when the Debian package is missing."""
    bindir = server_bin()
    if bindir is None or not (bindir / "initdb").is_file():
        pytest.skip(f"PostgreSQL's server is not installed; CI installs it with: {APT_LINE}")
    as_user: list[str] = []
    root = Path(tempfile.mkdtemp(prefix="tiersep-pg-"))
    if os.geteuid() == 0:
        import pwd

        try:
            user = pwd.getpwnam("postgres")
        except KeyError:
            pytest.skip(f"no `postgres` user to run the server as (the Debian package makes it: {APT_LINE})")
        os.chown(root, user.pw_uid, user.pw_gid)
        as_user = ["runuser", "-u", "postgres", "--"]
    os.chmod(root, 0o700)
    data, port = root / "data", free_port()

    def run(*cmd: str) -> None:
        done = subprocess.run([*as_user, *cmd], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, f"{' '.join(cmd)}:\n{done.stdout}\n{done.stderr}"

    run(str(bindir / "initdb"), "-D", str(data), "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync")
    run(str(bindir / "pg_ctl"), "-D", str(data), "-l", str(root / "server.log"), "-w", "-t", "60", "-o",
        f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200", "start")

    def stop() -> None:
        subprocess.run([*as_user, str(bindir / "pg_ctl"), "-D", str(data), "-m", "fast", "-w", "stop"],
                       capture_output=True, timeout=120)
        shutil.rmtree(root, ignore_errors=True)

    return f"postgresql://postgres@127.0.0.1:{port}/postgres", stop
