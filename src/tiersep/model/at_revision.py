"""tiersep's model package as it was at a git revision, for comparing with measurements recorded
then (the shared H100 logs ran commit e74010960b93; the working tree's model has changed since).

Needs a clone with history. The package is copied into a temporary folder and imported under its
own name, so it lives beside the current tiersep.model.
"""
from __future__ import annotations

import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType


def model_at(rev: str, repo: Path) -> ModuleType:
    """The package src/tiersep/model of `repo` at `rev` (build_model, build_loss); raises
    LookupError naming the file when git cannot show it (no such revision, a shallow clone)."""
    name = f"tiersep_model_at_{rev}"
    if name in sys.modules:
        return sys.modules[name]
    folder = Path(tempfile.mkdtemp(prefix="tiersep-model-")) / name
    folder.mkdir()
    # every module the package had then: its __init__ imports what it had (compile, step, ...)
    listed = subprocess.run(["git", "ls-tree", "--name-only", f"{rev}:src/tiersep/model"], cwd=repo,
                            capture_output=True, text=True)
    if listed.returncode != 0:
        raise LookupError(f"git ls-tree {rev}:src/tiersep/model: {listed.stderr.strip()} "
                          "(this needs the repository's history: clone without --depth)")
    for module in (m for m in listed.stdout.split() if m.endswith(".py")):
        path = f"src/tiersep/model/{module}"
        shown = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=repo, capture_output=True, text=True)
        if shown.returncode != 0:
            raise LookupError(f"git show {rev}:{path}: {shown.stderr.strip()} "
                              "(this needs the repository's history: clone without --depth)")
        (folder / module).write_text(shown.stdout)
    spec = importlib.util.spec_from_file_location(name, folder / "__init__.py",
                                                  submodule_search_locations=[str(folder)])
    package = importlib.util.module_from_spec(spec)
    sys.modules[name] = package
    spec.loader.exec_module(package)
    return package


def model_and_loss_at(rev: str, repo: Path):
    """A model_and_loss(preset) for the trace, building the model and loss of `rev`."""
    package = model_at(rev, repo)
    return lambda preset: (package.build_model(preset), package.build_loss(preset))
