"""Shared fixtures: a throw-away copy of the workflow to run the real `snakemake` in, and one tiny
pipeline run to the end once per session that tests copy instead of running it again."""
from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent  # the venv's bin: snakemake and tiersep live next to python
TINY_CONFIG = REPO / "tests" / "configs" / "tiny.yaml"


def load_script(path: Path, name: str | None = None):
    """A script that is not a package module (bench/*.py, workflow/scripts/*.py), loaded as a module."""
    spec = importlib.util.spec_from_file_location(name or Path(path).stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def on_a_terminal(argv: list[str], **popen) -> tuple[subprocess.Popen, bytes]:
    """Run `argv` with stderr a 120-column terminal (a pty), as in an interactive shell: the process
    and all it wrote there, read until it closed the terminal (wait for it after)."""
    import fcntl
    import pty
    import struct
    import termios

    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    proc = subprocess.Popen(argv, stderr=follower, **popen)
    os.close(follower)
    seen = b""
    while True:
        try:
            part = os.read(leader, 65536)
        except OSError:                                  # EIO: the process closed the terminal
            break
        if not part:
            break
        seen += part
    os.close(leader)
    return proc, seen


def copy_workflow(dest: Path) -> Path:
    """Copy what a run needs (Snakefile, workflow/, config/, profiles/, envs/, tests/configs) into dest."""
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy(REPO / "Snakefile", dest / "Snakefile")
    for folder in ("workflow", "config", "profiles", "envs"):
        if (REPO / folder).is_dir():
            shutil.copytree(REPO / folder, dest / folder)
    shutil.copytree(REPO / "tests" / "configs", dest / "tests" / "configs")
    return dest


def tiny_config(dest: Path, **changes) -> Path:
    """tests/configs/tiny.yaml with `changes` (top-level keys) written to `dest`, without its
    estimate-only seed tier unless `estimate_tiers` is among them: every rule still runs, and the
    estimate and fit_matrix jobs trace no `large` (tests/test_pipeline_e2e.py covers its record)."""
    import yaml

    config = yaml.safe_load(TINY_CONFIG.read_text())
    config.update({"estimate_tiers": [], **changes})
    dest.write_text(yaml.safe_dump(config))
    return dest


def run_snakemake(workdir: Path, *args: str, timeout: float = 600, env: dict | None = None,
                  check: bool = True, program: list[str] | None = None) -> subprocess.CompletedProcess:
    """Run the real snakemake CLI in `workdir` (or `program`, a command that runs it); returns the
    completed process (stdout+stderr)."""
    full_env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", **(env or {})}
    proc = subprocess.run([*(program or [str(BIN / "snakemake")]), *args], cwd=workdir, env=full_env, text=True,
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


# ---- the suite on two workers (`make test`: pytest-xdist, one file per work unit) -------------------
# Files that share one work unit, so one worker builds their session fixture once: finished_tree is a
# whole tiny pipeline run (73 s of setup in CI at stop 40), built per worker.
SAME_WORKER = {"tests/test_separate_workflow.py": "tests/test_pipeline_e2e.py"}
# Work units handed out longest first (longest-processing-time scheduling), so that the last file a
# worker starts is a short one and the other worker is not left idle behind it. Ordered by the
# "slowest 25 files" of CI at stop 41 (DDP ~500 s, SLURM ~400 s, the e2e pair ~300 s, ...); every
# other file after them, in collection order (`--no-loadscope-reorder`).
LONGEST_FIRST = [
    "tests/test_ddp.py", "tests/test_cluster_slurm.py", "tests/test_pipeline_e2e.py",
    "tests/test_memory_cuda_accuracy.py", "tests/test_bad_inputs.py", "tests/test_search.py",
    "tests/test_fuzz_inputs.py", "tests/test_separate.py", "tests/test_search_report.py",
    "tests/test_memory_estimate.py", "tests/test_separate_faults.py", "tests/test_search_packing.py",
    "tests/test_train_safety.py", "tests/test_signals.py", "tests/test_crash_recovery.py",
    "tests/test_gpu_generations.py", "tests/test_memory_cpu_process.py", "tests/test_cluster_containers.py",
    "tests/test_train_fp16.py", "tests/test_fit_matrix.py", "tests/test_memory_ranks.py", "tests/test_train.py",
    "tests/test_prepare_safety.py", "tests/test_memory_gpu_evidence.py", "tests/test_memory_compiled.py",
]


def work_unit(nodeid: str) -> str:
    path = nodeid.split("::", 1)[0]
    return SAME_WORKER.get(path, path)


def pytest_collection_modifyitems(items):
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(work_unit(item.nodeid), len(rank)))   # stable: file order kept


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class Scheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return Scheduling(config, log)


_seconds_by_file: dict[str, float] = {}


def pytest_runtest_logreport(report):
    path = report.nodeid.split("::", 1)[0]
    _seconds_by_file[path] = _seconds_by_file.get(path, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    """The slowest files (setup, call and teardown summed): what LONGEST_FIRST is ordered by."""
    slowest = sorted(_seconds_by_file.items(), key=lambda kv: -kv[1])[:25]
    if slowest:
        terminalreporter.write_sep("=", "slowest 25 files (s)")
        for path, seconds in slowest:
            terminalreporter.write_line(f"{seconds:8.1f}  {path}")
