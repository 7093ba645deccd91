"""`pip install .` (not editable) works from any directory: schemas, presets, captions, templates
and calibrations ship inside the package.

The package is really built and installed into a fresh virtual environment. Its dependencies
(torch, snakemake, ...) are not downloaded again: the new environment sees the project's
environment's site-packages through a .pth file (which does not pick up the editable install)."""
from __future__ import annotations

import json
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
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-deps",
                    "--no-build-isolation", str(REPO)], check=True, cwd=root, timeout=600)
    return {"python": python, "tiersep": venv / "bin" / "tiersep", "site": site, "cwd": root}


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
