"""Shared fixtures: a throw-away copy of the workflow to run the real `snakemake` in, and one tiny
pipeline run to the end once per session that tests copy instead of running it again."""
from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent  # the venv's bin: snakemake and tiersep live next to python
TINY_CONFIG = REPO / "tests" / "configs" / "tiny.yaml"


def copy_workflow(dest: Path) -> Path:
    """Copy what a run needs (Snakefile, workflow/, config/, profiles/, envs/, tests/configs) into dest."""
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy(REPO / "Snakefile", dest / "Snakefile")
    for folder in ("workflow", "config", "profiles", "envs"):
        if (REPO / folder).is_dir():
            shutil.copytree(REPO / folder, dest / folder)
    shutil.copytree(REPO / "tests" / "configs", dest / "tests" / "configs")
    return dest


def run_snakemake(workdir: Path, *args: str, timeout: float = 600, env: dict | None = None,
                  check: bool = True) -> subprocess.CompletedProcess:
    """Run the real snakemake CLI in `workdir`; returns the completed process (stdout+stderr)."""
    full_env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", **(env or {})}
    proc = subprocess.run([str(BIN / "snakemake"), *args], cwd=workdir, env=full_env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"snakemake {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-6000:]}")
    return proc


@pytest.fixture
def workflow_copy(tmp_path: Path) -> Path:
    return copy_workflow(tmp_path / "wf")


# tiny.yaml plus a second trained tier that the CPU refuses as GPU-sized (the end-to-end test's run)
FINISHED_CONFIG = ["--configfile", "tests/configs/tiny.yaml", "tests/configs/with_refused_tier.yaml"]
FINISHED_RUN = ["--cores", "2", "--resources", "gpu=1", *FINISHED_CONFIG]


@pytest.fixture(scope="session")
def finished_tree(tmp_path_factory) -> Path:
    """A workflow copy run once through every rule with FINISHED_RUN (about 3-4 minutes on 2 busy
    cores), for the tests that need a prepared, trained tree: tests/test_pipeline_e2e.py probes it in
    place and leaves it finished; a test that would leave it otherwise works on copy_finished()."""
    wf = copy_workflow(tmp_path_factory.mktemp("finished") / "wf")
    run_snakemake(wf, *FINISHED_RUN, timeout=900)
    return wf


def copy_finished(tree: Path, dest: Path) -> Path:
    """A copy of a finished workflow tree, .snakemake/ included: copytree's copy2 keeps every file's
    and folder's modification time, which Snakemake compares. The report alone is out of date in
    the copy: its inputs name the captions by absolute path, and the path changed."""
    shutil.copytree(tree, dest, symlinks=True)
    return dest


@contextlib.contextmanager
def one_torch_thread():
    """torch on one intra-op thread: on a shared 2-core machine a 2-thread OpenMP pool spin-waits on
    busy cores (about 10x slower for these tiny tensors)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture
def single_thread():
    with one_torch_thread():
        yield
