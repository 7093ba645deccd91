"""Output folders tiersep owns: what it may replace, and one writer at a time.

The rules (docs/safety.md):
- Every folder a stage writes (prepare, train, evaluate, report) carries a small stamp, `.tiersep`
  (a prepared dataset's manifest.json is its stamp too). tiersep writes into, replaces or moves
  things inside a folder only when it carries tiersep's stamp of the same stage, is empty or new,
  or holds nothing but the files that stage writes (a results tree from before stamps existed).
  Anything else is refused with one line: nothing of the user's is touched.
- `/`, the home folder, the working directory and their ancestors are never an output folder.
- One writer per output folder: `exclusive()` holds an `fcntl.flock` on a lock file beside the
  folder (`.<name>.lock`; beside, not inside, because a prepared folder is replaced whole), or
  inside it (`.tiersep.lock`, `inside=True`) for a folder that is only ever added to (separate's:
  its parent, e.g. /scratch/$USER, need not be writable). The kernel drops the lock when the
  process dies, so a lock is never stale. A second writer stops at once naming the holder's pid,
  host and whole command.
- Temporary names are tiersep's own (`.<name>.<8 random chars>.tmp`, see tiersep.io); one left by
  a killed writer is removed by the next writer of that folder, under the lock, and nothing else.
- Nothing that holds results is deleted: a run that must start over moves the old one aside
  (`move_aside`) into `<folder>/previous/<time>/`.
"""
from __future__ import annotations

import contextlib
import datetime as dt
import errno
import fcntl
import json
import os
import re
import shutil
import socket
import sys
from pathlib import Path
from typing import Callable, Iterator

from tiersep.config import ConfigError

STAMP = ".tiersep"
LOCK_INSIDE = ".tiersep.lock"     # the lock file of a folder locked from inside (exclusive(inside=True))
PREVIOUS = "previous"
STAGES = ("prepare", "train", "evaluate", "report", "separate")
EXIT_BUSY = 5
HOLDER_COMMAND_CHARS = 4000       # the holder's command as the lock file keeps it (whole, in practice)
# flock errors that mean "this file system has no locks", not "someone holds it"
UNSUPPORTED = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP)
# tempfile's names: prefix + 8 characters of "abcdefghijklmnopqrstuvwxyz0123456789_" + suffix
_TEMP_TAIL = re.compile(r"\.[a-z0-9_]{8}\.tmp$")


class OutputRefused(ConfigError):
    """An output path tiersep will not write into or replace (exit 2); one line naming it."""


class OutputBusy(ConfigError):
    """Another live process writes the same output folder (exit 5); names its pid and host."""

    exit_code = EXIT_BUSY


def is_temp_name(name: str, owner: str | None = None) -> bool:
    """Whether `name` is one of tiersep's temporary names (of the file or folder `owner`, if given)."""
    if not name.startswith(".") or not _TEMP_TAIL.search(name):
        return False
    return owner is None or name[:-len(".xxxxxxxx.tmp")] == f".{owner}"


def forbidden(path: str | Path) -> str | None:
    """Why `path` can never be an output folder (/, home, the working directory or an ancestor of
    either), or None."""
    target = Path(os.path.realpath(Path(path).expanduser()))
    home = Path(os.path.realpath(Path.home()))
    cwd = Path(os.path.realpath(Path.cwd()))
    if target == Path(target.anchor):
        return "it is the root folder"
    if target == home or target in home.parents:
        return "it is your home folder" if target == home else "it holds your home folder"
    if target == cwd or target in cwd.parents:
        return "it is the working directory" if target == cwd else "it holds the working directory"
    return None


def read_stamp(folder: str | Path) -> dict | None:
    """The stamp of a tiersep output folder ({"stage", ...}), or None."""
    try:
        stamp = json.loads((Path(folder) / STAMP).read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    return stamp if isinstance(stamp, dict) and stamp.get("stage") in STAGES else None


def write_stamp(folder: str | Path, stage: str) -> None:
    from tiersep import __version__

    stamp = {"stage": stage, "made_by": f"tiersep {__version__}",
             "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}
    from tiersep.io import write_text

    write_text(Path(folder) / STAMP, json.dumps(stamp) + "\n")


def user_entries(folder: Path) -> list[str]:
    """Names in `folder` other than tiersep's stamp, lock and temporary names."""
    return sorted(e.name for e in os.scandir(folder) if e.name not in (STAMP, LOCK_INSIDE) and not is_temp_name(e.name))


def check(folder: str | Path, stage: str, option: str = "--out", known: Callable[[Path], bool] | None = None) -> None:
    """Refuse (OutputRefused, one line) unless `folder` may become or is this stage's output folder:
    new, empty, stamped by this stage, or recognised by `known(folder)` as this stage's output from
    before stamps. Creates nothing (claim() does)."""
    folder = Path(folder)
    why = forbidden(folder)
    if why:
        raise OutputRefused(f"{option} {folder}: refused, {why}; give a folder of its own, e.g. a new one")
    if folder.exists() and not folder.is_dir():
        raise OutputRefused(f"{option} {folder}: is a file, not a folder")
    if not folder.is_dir():
        return
    stamp = read_stamp(folder)
    if stamp is not None:
        if stamp["stage"] != stage:
            raise OutputRefused(f"{option} {folder}: is a tiersep {stamp['stage']} folder, not a {stage} "
                                "folder; give another folder")
        return
    names = user_entries(folder)
    if names and not (known and known(folder)):
        shown = ", ".join(repr(n) for n in names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        raise OutputRefused(f"{option} {folder}: holds files tiersep did not make ({shown}), and "
                            "those are never written over: give a new or empty folder")


def claim(folder: str | Path, stage: str, option: str = "--out", known: Callable[[Path], bool] | None = None) -> Path:
    """check() `folder`, then make it this stage's output folder: created if new, and stamped."""
    folder = Path(folder)
    check(folder, stage, option, known)
    if read_stamp(folder) is None:
        folder.mkdir(parents=True, exist_ok=True)
        write_stamp(folder, stage)
    return folder


def only_names(allowed: set[str] | Callable[[str], bool]) -> Callable[[Path], bool]:
    """A `known` test for claim(): the folder holds nothing but names this stage writes."""
    test = allowed if callable(allowed) else allowed.__contains__
    return lambda folder: all(test(name) for name in user_entries(folder))


def lock_path(folder: str | Path, inside: bool = False) -> Path:
    folder = Path(folder)
    return folder / LOCK_INSIDE if inside else folder.parent / f".{folder.name}.lock"


def check_writable(folder: str | Path, option: str = "--out") -> None:
    """Refuse (OutputRefused, one line) when `folder`, or the nearest existing folder above a new
    one, cannot be written by this process: before any slow work, not as a traceback half-way."""
    folder = Path(os.path.abspath(Path(folder).expanduser()))
    where = folder
    while not where.exists() and where != where.parent:
        where = where.parent
    if not os.access(where, os.W_OK | os.X_OK):
        what = "cannot be written" if where == folder else f"cannot be made: {where} cannot be written"
        raise OutputRefused(f"{option} {folder}: {what} (permission denied); give a folder you can write")


@contextlib.contextmanager
def exclusive(folder: str | Path, option: str = "--out", wait: bool = False, inside: bool = False) -> Iterator[Path]:
    """Hold the one-writer lock of `folder` for the block: OutputBusy when another process has it,
    or with `wait`, wait for it (a second prepare needs the set the first is generating; the kernel
    drops a dead holder's lock, so the wait ends). Inside the block, temporaries left by a killed
    writer of this folder are removed first. inside: the lock file is in the folder (which must exist),
    not beside it."""
    folder = Path(folder)
    path = lock_path(folder, inside)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        locked = True
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            locked = False
            if err.errno in UNSUPPORTED:
                # e.g. Lustre mounted without -o flock: working without the lock beats not working
                print(f"tiersep: warning: {path.parent} does not support file locks ({os.strerror(err.errno)}); "
                      f"nothing stops a second writer of {folder} (docs/safety.md)", file=sys.stderr)
            elif err.errno in (errno.EWOULDBLOCK, errno.EACCES):
                busy = _busy(folder, option, fd, path)
                if not wait:
                    raise OutputBusy(busy) from None
                print(f"tiersep: waiting: {busy}", file=sys.stderr)
                fcntl.flock(fd, fcntl.LOCK_EX)
                locked = True
            else:
                raise
        if locked:   # unlocked, another writer's temporaries may be live: leave them
            write_holder(fd)
            remove_stale_temps(folder)
        yield folder
    finally:
        os.close(fd)   # releases the lock; the file stays (removing it would race a waiting writer)


def write_holder(fd: int, **extra) -> None:
    """Write who holds the lock on `fd` into its file (pid, host, command, since; plus `extra`), for
    the message of whoever finds it taken. Call only while holding the lock."""
    me = {"pid": os.getpid(), "host": socket.gethostname(), "command": " ".join(sys.argv)[:HOLDER_COMMAND_CHARS],
          "since": dt.datetime.now().isoformat(timespec="seconds"), **extra}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(me).encode(), 0)


def read_holder(fd: int) -> dict | None:
    """What write_holder wrote into the lock file on `fd` ({"pid", "host", ...}), or None."""
    try:
        info = json.loads(os.pread(fd, 4 * HOLDER_COMMAND_CHARS + 4096, 0) or b"{}")
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) and "pid" in info and "host" in info else None


def _holder(fd: int) -> str:
    info = read_holder(fd)
    if info is None:
        return "another process"
    return f"pid {info['pid']} on {info['host']} (since {info.get('since', '?')}: {info.get('command', '')})"


def _busy(folder: Path, option: str, fd: int, path: Path) -> str:
    return (f"{option} {folder}: in use by {_holder(fd)}; wait for it to finish "
            f"(the lock is {path}, released when that process ends)")


def remove_stale_temps(folder: Path) -> list[Path]:
    """Remove tiersep temporaries of `folder` (beside it) and inside it, left by a killed writer.
    Call only under `exclusive(folder)`: then no live writer can own them."""
    removed = []
    candidates = []
    if folder.parent.is_dir():
        candidates += [Path(e.path) for e in os.scandir(folder.parent) if is_temp_name(e.name, folder.name)]
    if folder.is_dir() and read_stamp(folder) is not None:
        for root, dirs, files in os.walk(folder):
            candidates += [Path(root) / n for n in dirs + files if is_temp_name(n)]
            dirs[:] = [d for d in dirs if not is_temp_name(d)]
    for path in candidates:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        removed.append(path)
    if removed:
        print(f"tiersep: removed {len(removed)} temporary file(s) a killed job left in {folder}", file=sys.stderr)
    return removed


def move_aside(folder: str | Path, reason: str, names: tuple[str, ...] | None = None,
               link: bool = False) -> Path | None:
    """Move a run's files out of the way into folder/previous/<time>/, with a note of why; returns
    that folder (None: nothing to move). names: only these (default: everything but the stamp,
    temporaries and earlier moved runs). link: hard-link instead of moving (a copy that costs no
    space until the original is replaced)."""
    folder = Path(folder)
    present = [n for n in user_entries(folder) if n != PREVIOUS and (names is None or n in names)]
    if not present:
        return None
    when = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    dest = folder / PREVIOUS / when
    suffix = 1
    while dest.exists():
        suffix += 1
        dest = folder / PREVIOUS / f"{when}-{suffix}"
    dest.mkdir(parents=True)
    for name in present:
        if not link:
            os.rename(folder / name, dest / name)
        elif (folder / name).is_dir():
            shutil.copytree(folder / name, dest / name, copy_function=_link_or_copy)
        else:
            _link_or_copy(folder / name, dest / name)
    (dest / "moved-aside.json").write_text(json.dumps(
        {"reason": reason, "when": dt.datetime.now().isoformat(timespec="seconds"),
         "files": present, "how": "hard-linked" if link else "moved"}, indent=2) + "\n")
    return dest


def _link_or_copy(source, dest) -> None:
    try:
        os.link(source, dest)
    except OSError:   # a file system without hard links
        shutil.copy2(source, dest)
