"""Crash-safe file writing: every output goes to a temporary name in the same folder, then is
renamed, so a killed job never leaves a half-written file that looks finished."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path next to `path`; rename it over `path` only if the block succeeds."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp)
    try:
        yield tmp
        if tmp.exists():  # mkstemp makes 0600 files; give outputs the usual umask permissions
            os.chmod(tmp, 0o666 & ~current_umask())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def write_text(path: str | Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def to_json(obj: Any) -> str:
    """`obj` as write_json writes it (numpy and torch values, paths... made plain)."""
    return json.dumps(obj, indent=2, sort_keys=False, default=_jsonable)


def write_json(path: str | Path, obj: Any) -> None:
    write_text(path, to_json(obj) + "\n")


def read_json(path: str | Path) -> Any:
    return json.loads(Path(path).read_text())


def torch_save(obj: Any, path: str | Path) -> None:
    import torch

    with atomic_path(path) as tmp:
        torch.save(obj, tmp)


@contextlib.contextmanager
def atomic_dir(path: str | Path, replace: bool = False) -> Iterator[Path]:
    """Build a whole folder under a temporary name and rename it into place at the end.

    An existing folder at `path` is replaced only when it is empty, or when `replace` says the
    caller knows it is tiersep's own (callers check with tiersep.outputs first; this is the last
    guard, so FileExistsError), before any work is done."""
    path = Path(path)
    if path.exists() and not replace and not (path.is_dir() and not any(path.iterdir())):
        raise FileExistsError(f"{path}: exists and is not known to be tiersep's; not replaced")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        yield tmp
        os.chmod(tmp, 0o777 & ~current_umask())  # mkdtemp makes 0700 folders
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)   # tiersep's own (checked above)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _jsonable(value: Any) -> Any:
    """json.dumps fallback for numpy scalars/arrays and paths."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")
