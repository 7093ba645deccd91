"""Containers and software deployment: the Apptainer definition, the conda env, the apptainer
profile, and a real pipeline run through a recording stand-in for `apptainer`.

Apptainer itself cannot run on the test machines (no user namespaces / setuid), so the image is
never built here: the definition is checked by parsing it with spython, and `--sdm apptainer` is
run against tests/apptainer_stub/apptainer, which logs each call and runs the command on the host.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from conftest import BIN, REPO, copy_workflow, run_snakemake, tiny_config

DEF_FILE = REPO / "containers" / "tiersep.def"
ENV_FILE = REPO / "envs" / "tiersep.yaml"
STUB_DIR = REPO / "tests" / "apptainer_stub"
APPTAINER_PROFILE = REPO / "profiles" / "apptainer" / "config.yaml"


def _pyproject_dependencies() -> dict[str, str]:
    """{name: specifier} of pyproject's [project] dependencies, e.g. {"torch": "==2.11.*"}."""
    import tomllib

    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    return {m.group(1).lower(): m.group(2).replace(" ", "")
            for m in (re.match(r"^([A-Za-z0-9_.-]+)\s*(.*)$", d) for d in deps)}


# --- containers/tiersep.def -------------------------------------------------------------------

@pytest.fixture(scope="module")
def recipe():
    from spython.main.parse.parsers import SingularityParser

    parsed = SingularityParser(str(DEF_FILE)).recipe
    # spython >= 0.3 returns {stage name: Recipe}; the file has one stage.
    return next(iter(parsed.values())) if isinstance(parsed, dict) else parsed


def test_definition_bootstraps_from_cuda_pytorch_pinned_like_pyproject(recipe):
    header = DEF_FILE.read_text().split("%", 1)[0]
    assert re.search(r"^Bootstrap:\s*docker\s*$", header, re.M), "the image must start from a docker base"
    torch_pin = _pyproject_dependencies()["torch"]  # "==2.11.*"
    version = torch_pin.strip("=*").rstrip(".")     # "2.11"
    base = recipe.fromHeader
    assert base.startswith(f"pytorch/pytorch:{version}."), f"base {base} is not torch {version}"
    assert re.search(r"-cuda\d+\.\d+-cudnn\d+-", base), f"base {base} is not a CUDA build"
    # The constraint that keeps pip from swapping the image's torch must repeat pyproject's pin.
    post = "\n".join(recipe.install)
    assert f"torch{torch_pin}" in post and f"torchaudio{_pyproject_dependencies()['torchaudio']}" in post


def test_definition_installs_ffmpeg_and_the_package(recipe):
    post = "\n".join(recipe.install)
    apt = [line for line in recipe.install if "apt-get install" in line]
    assert apt and "ffmpeg" in apt[0], "ffmpeg/ffprobe are needed by musdb and stempeg"
    pip_lines = [line for line in post.replace("\\\n", " ").splitlines() if "pip install" in line]
    assert any(re.search(r"(-e\s+)?/opt/tiersep(\s|$)", line) for line in pip_lines), pip_lines
    # Everything %files copies exists in the repository and lands under /opt/tiersep.
    copied = dict(line.split() for line in recipe.files)
    for source, dest in copied.items():
        assert (REPO / source).exists(), f"%files copies {source}, which is not in the repository"
        assert dest.startswith("/opt/tiersep/"), dest
    for needed in ("pyproject.toml", "setup.py", "src", "workflow", "README.md"):
        assert needed in copied, f"%files does not copy {needed}"


def test_definition_environment_runscript_and_labels(recipe):
    environ = dict(item.split("=", 1) for item in recipe.environ)
    assert environ.get("PYTHONNOUSERSITE") == "1", "the bound home's ~/.local must not shadow the image"
    assert environ.get("MPLBACKEND") == "Agg"
    assert recipe.cmd.strip() == 'exec tiersep "$@"'
    labels = dict(line.split(None, 1) for line in recipe.labels)
    assert labels["org.opencontainers.image.title"] == "tiersep"
    assert "%test" in DEF_FILE.read_text() and "tiersep --help" in DEF_FILE.read_text()


# --- envs/tiersep.yaml ------------------------------------------------------------------------

def test_conda_env_pins_match_pyproject():
    env = yaml.safe_load(ENV_FILE.read_text())
    conda = [d for d in env["dependencies"] if isinstance(d, str)]
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    assert "python=3.11" in conda and "ffmpeg" in conda
    pinned = {m.group(1).lower(): m.group(2) for m in (re.match(r"^([A-Za-z0-9_.-]+)(.*)$", p) for p in pip)}
    expected = {k: v for k, v in _pyproject_dependencies().items() if k != "snakemake"}
    assert pinned == expected, "envs/tiersep.yaml pip section drifted from pyproject.toml"
    assert (ENV_FILE.parent / "tiersep.post-deploy.sh").is_file()


# --- the recording stand-in itself ------------------------------------------------------------

def _stub_env(log: Path) -> dict:
    return {**os.environ, "PATH": f"{STUB_DIR}{os.pathsep}{BIN}{os.pathsep}{os.environ['PATH']}",
            "TIERSEP_APPTAINER_LOG": str(log)}


def test_stub_logs_the_call_and_runs_the_command_on_the_host(tmp_path):
    image = tmp_path / "img.sif"
    image.write_bytes(b"")
    log = tmp_path / "calls.jsonl"
    env = {**_stub_env(log), "SINGULARITYENV_STAGE": "train"}
    version = subprocess.run(["apptainer", "--version"], env=env, text=True, capture_output=True)
    assert version.stdout.startswith("apptainer version 1.")
    # The shape Snakemake uses: apptainer exec --home CWD ARGS IMAGE bash -c 'CMD'
    proc = subprocess.run(["apptainer", "--quiet", "exec", "--home", str(tmp_path), "--nv", "--bind", "/tmp",
                           str(image), "bash", "-c", 'echo "$STAGE $HOME" > out.txt; exit 3'],
                          cwd=tmp_path, env=env, text=True, capture_output=True)
    assert proc.returncode == 3, proc.stderr  # the command's own exit status comes back
    assert (tmp_path / "out.txt").read_text().split() == ["train", str(tmp_path)]
    (call,) = [json.loads(line) for line in log.read_text().splitlines()]
    assert call["image"] == str(image) and "--nv" in call["options"]
    assert call["command"][:2] == ["bash", "-c"]
    missing = subprocess.run(["apptainer", "exec", str(tmp_path / "none.sif"), "true"], env=env,
                             text=True, capture_output=True)
    assert missing.returncode != 0 and "could not open image" in missing.stderr


# --- the pipeline under --sdm apptainer -------------------------------------------------------

@pytest.mark.slow
def test_pipeline_runs_every_rule_through_apptainer_with_nv(tmp_path):
    workdir = copy_workflow(tmp_path / "wf")
    image = workdir / "containers" / "tiersep.sif"  # the rules' default `container:`
    image.parent.mkdir(parents=True, exist_ok=True)
    image.write_bytes(b"placeholder: the stand-in only checks that the image exists")
    log = tmp_path / "apptainer_calls.jsonl"
    env = {"PATH": _stub_env(log)["PATH"], "TIERSEP_APPTAINER_LOG": str(log)}
    tiny_config(workdir / "apptainer-tiny.yaml")   # every rule in the container; no `large` traced
    started = time.monotonic()
    proc = run_snakemake(workdir, "--profile", str(workdir / "profiles" / "apptainer"),
                         "--configfile", "apptainer-tiny.yaml", "--cores", "2",
                         timeout=600, env=env)
    seconds = time.monotonic() - started
    print(f"pipeline under --sdm apptainer (stand-in): {seconds:.1f} s")
    assert (workdir / "results" / "report" / "index.html").is_file()

    calls = [json.loads(line) for line in log.read_text().splitlines()]
    # Every job that ran (the DAG grows after the train checkpoint); `all` runs nothing
    finished = re.findall(r"Finished jobid: \d+ \(Rule: (\w+)\)", proc.stdout)
    executed = {rule: finished.count(rule) for rule in set(finished) if rule != "all"}
    assert executed.get("evaluate") == 1 and executed.get("train") == 1, executed
    # Snakemake prefixes the rule's command ("set -euo pipefail; tiersep train ...").
    stages = [m.group(1) for c in calls for m in [re.search(r"\btiersep (\w+)", c["command"][-1])] if m]
    assert len(calls) == sum(executed.values()), (executed, [c["command"] for c in calls])
    command_of = {"fit_matrix": "fit"}   # tiersep fit --gpus; every other rule is named after its command
    assert sorted(stages) == sorted(command_of.get(rule, rule) for rule, n in executed.items() for _ in range(n))
    for call in calls:
        assert "--nv" in call["options"], call["argv"]
        assert (Path(call["cwd"]) / call["image"]).resolve() == image.resolve(), call["image"]
        assert call["options"][call["options"].index("--home") + 1] == str(workdir)
