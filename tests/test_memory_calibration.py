"""Device calibrations: built-in entries, files from `tiersep calibrate`, and their errors."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tiersep import config as C
from tiersep.memory import calibration, estimate

H100 = "NVIDIA H100 80GB HBM3"


def test_builtin_h100_is_the_shared_measurement():
    record = calibration.resolve(H100)
    # tests/data/gpu/h100-2026-11-22: the largest outside-torch figure of the 16 configurations
    rows = [json.loads(line) for name in ("measurements.jsonl", "expandable_segments.jsonl")
            for line in open(f"tests/data/gpu/h100-2026-11-22/{name}")]
    assert record["context_bytes"] == max(r["outside_torch_bytes"] for r in rows)
    assert record["used"] == {"name": H100, "source": "built-in", "why": "given"}


def test_auto_matches_the_gpu_name_or_falls_back_saying_so():
    assert calibration.resolve("auto", device_name=H100)["used"]["why"] == "matched this GPU"
    other = calibration.resolve("auto", device_name="NVIDIA GeForce RTX 4090")["used"]
    assert other["name"] == H100 and "no built-in calibration for 'NVIDIA GeForce RTX 4090'" in other["why"]
    assert "most conservative" in other["why"]


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(C.ConfigError, match=r"unknown calibration 'A100' \(known: NVIDIA H100 80GB HBM3"):
        calibration.resolve("A100")


@pytest.mark.parametrize("content, message", [
    (None, "calibration file not found"),
    ("{not json", "not valid JSON"),
    ('["a list"]', "expected a JSON object"),
    ('{"name": "x", "context_bytes": 1, "cublas_workspace_bytes": 1}', "torch: missing"),
    ('{"name": "x", "torch": "2.11.0", "context_bytes": -5, "cublas_workspace_bytes": 1}',
     "context_bytes: expected a non-negative integer, got -5"),
    ('{"name": "x", "torch": "2.3.1", "context_bytes": 5, "cublas_workspace_bytes": 1}',
     "torch: calibrated with torch 2.3.1, this is"),
    ('{"name": "x", "torch": "2.11.0", "context_bytes": 5, "cublas_workspace_bytes": 1, "capability": "sm75"}',
     "capability: expected [major, minor] (two non-negative integers), got 'sm75'"),
])
def test_bad_calibration_files_name_the_file_and_field(tmp_path, content, message):
    path = tmp_path / "cal.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(C.ConfigError) as caught:
        calibration.resolve(str(path))
    assert str(caught.value).startswith(f"{path}: ") and message in str(caught.value)
    assert "\n" not in str(caught.value)


def test_a_calibration_file_sets_the_context_the_estimate_books(tmp_path):
    """peak_bytes = the allocator's reserved peak + the calibrated context, whichever file is used."""
    preset = C.load_preset("cpu_tiny")
    mine = {**{k: v for k, v in calibration.resolve(H100).items() if k != "used"},
            "name": "my GPU", "torch": torch.__version__, "context_bytes": 300 * 2**20}
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(mine))
    builtin = estimate(preset, device="cuda", calibration_spec=H100)
    custom = estimate(preset, device="cuda", calibration_spec=str(path))
    assert builtin["peak_bytes"] - custom["peak_bytes"] == calibration.resolve(H100)["context_bytes"] - 300 * 2**20
    assert custom["calibration"] == {"name": "my GPU", "source": str(path), "why": "given",
                                     "context_bytes": 300 * 2**20}
    assert custom["overhead_detail"]["cuda_context"] == 300 * 2**20


def test_cli_calibrate_without_a_gpu_and_a_bad_calibration_are_one_line_errors(tmp_path):
    run = lambda *a: subprocess.run([sys.executable, "-m", "tiersep.cli", *a], capture_output=True, text=True)
    if not torch.cuda.is_available():
        done = run("calibrate", "--out", str(tmp_path / "c.json"))
        assert done.returncode == 2 and "no CUDA device is visible" in done.stderr
        assert len(done.stderr.strip().splitlines()) == 1 and not (tmp_path / "c.json").exists()
    done = run("estimate", "--preset", "cpu_tiny", "--device", "cuda", "--calibration", "RTX 9090",
               "--out", str(tmp_path / "e.json"))
    assert done.returncode == 2 and "unknown calibration 'RTX 9090' (known: " in done.stderr
    assert not (tmp_path / "e.json").exists()
