"""A regular install (a wheel built from the checkout, `pip wheel .`, installed into a fresh virtual
environment, not editable) works from any directory: every subpackage, schema, preset, caption,
template and calibration ships, and every subcommand runs.

The wheel is really built and installed. Its dependencies (torch, snakemake, ...) are not downloaded
again: the new environment sees the project's environment's site-packages through a .pth file (which
does not pick up the editable install)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    root = tmp_path_factory.mktemp("pkg")
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               check=True, capture_output=True, text=True).stdout.strip())
    (site / "project_deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    # Built from a copy of what git would commit: a checkout's stale build/ folder would otherwise
    # put back into the wheel a module that the package list leaves out.
    source = root / "source"
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=REPO,
                           check=True, capture_output=True, text=True).stdout.split("\0")
    for name in filter(None, files):
        if (REPO / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, source / name)
    wheels = root / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "--wheel-dir", str(wheels), str(source)], check=True, cwd=root, timeout=600)
    (wheel,) = wheels.glob("tiersep-*.whl")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-deps",
                    str(wheel)], check=True, cwd=root, timeout=600)
    return {"python": python, "tiersep": venv / "bin" / "tiersep", "site": site, "cwd": root, "wheel": wheel}


def test_the_wheel_holds_every_subpackage_of_the_source(installed):
    """A package list written by hand once left out tiersep.separate and tiersep.report.sections."""
    import zipfile

    source = {p.parent.relative_to(REPO / "src").as_posix() for p in (REPO / "src").rglob("__init__.py")
              if "__pycache__" not in p.parts}
    shipped = {Path(n).parent.as_posix() for n in zipfile.ZipFile(installed["wheel"]).namelist()
               if n.endswith("/__init__.py")}
    assert {"tiersep/separate", "tiersep/report/sections"} <= source
    assert source - shipped == set()


def test_the_install_is_a_copy_with_its_data(installed):
    located = subprocess.run([str(installed["python"]), "-c", "import tiersep; print(tiersep.__file__)"],
                             cwd=installed["cwd"], check=True, capture_output=True, text=True).stdout.strip()
    package = installed["site"] / "tiersep"
    assert Path(located) == package / "__init__.py"     # not the source checkout
    for relative in ("schemas/config.schema.yaml", "schemas/preset.schema.yaml", "schemas/records/run.schema.yaml",
                     "presets/small.yaml", "presets/cpu_tiny.yaml", "captions/training_curves.rst",
                     "report/templates/index.html.j2", "memory/calibrations/nvidia-h100-80gb-hbm3.json",
                     "memory/analytic_calibration.json"):
        assert (package / relative).is_file(), relative


def test_the_cli_runs_outside_the_checkout(installed):
    help_text = subprocess.run([str(installed["tiersep"]), "--help"], cwd=installed["cwd"], check=True,
                               capture_output=True, text=True).stdout
    assert "calibrate" in help_text and "estimate" in help_text
    out = installed["cwd"] / "small.json"
    done = subprocess.run([str(installed["tiersep"]), "estimate", "--preset", "small", "--device", "cuda",
                           "--out", str(out)], cwd=installed["cwd"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    record = json.loads(out.read_text())
    assert record["preset"] == "small" and record["calibration"]["name"] == "NVIDIA H100 80GB HBM3"
    assert record["peak_bytes"] > record["reserved_peak_bytes"] > 0


def _run(installed, *args, timeout=300):
    done = subprocess.run([str(installed["tiersep"]), *args], cwd=installed["cwd"], capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, f"tiersep {' '.join(args)}: {done.stderr[-3000:]}"
    return done


def test_every_subcommand_and_the_version_answer(installed):
    import tiersep
    from tiersep.cli import build_parser

    assert _run(installed, "--version").stdout.strip() == f"tiersep {tiersep.__version__}"
    commands = build_parser()._subparsers._group_actions[0].choices
    assert {"prepare", "estimate", "fit", "train", "evaluate", "separate", "report"} <= set(commands)
    for command in commands:
        assert f"usage: tiersep {command}" in _run(installed, command, "--help").stdout


def test_a_train_step_and_a_separation_run_from_the_wheel(installed):
    """The installed package trains cpu_tiny for one step and separates a song with it, from a folder
    that is not the checkout (every module these import lazily must be in the wheel)."""
    import numpy as np
    import soundfile as sf

    cwd = installed["cwd"]
    (cwd / "config.yaml").write_text(
        "data: {source: synthetic, synthetic: {seed: 1, sample_rate: 16000, train_tracks: 2, valid_tracks: 1,"
        " test_tracks: 1, track_seconds: 2}}\ntiers: [cpu_tiny]\nestimate_tiers: []\n")
    _run(installed, "prepare", "--config", "config.yaml", "--out", "prepared")
    _run(installed, "train", "--config", "config.yaml", "--preset", "cpu_tiny", "--data", "prepared",
         "--out", "run", "--set", "train.steps=1", "--set", "train.warmup_steps=1",
         "--set", "train.validate_segments=1", "--set", "train.export=last", timeout=600)
    assert (cwd / "run" / "model.pt").is_file()
    rng = np.random.default_rng(0)
    sf.write(cwd / "song.wav", (0.1 * rng.standard_normal((8000, 2))).astype(np.float32), 8000)
    done = _run(installed, "separate", "--config", "config.yaml", "--model", "run/model.pt", "song.wav",
                "--out", "separated")
    assert "separated 1 song(s)" in done.stdout
    assert (cwd / "separated" / "song" / "vocals.wav").is_file()
