"""The tiersep command: help for every stage, one-line errors, --set overrides."""
import subprocess
import sys
from pathlib import Path

import pytest

from tiersep import cli
from tiersep.config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[1]
TIERSEP = str(Path(sys.executable).parent / "tiersep")
STAGES = ["prepare", "estimate", "fit", "train", "evaluate", "report"]


def test_top_level_help_lists_every_stage():
    out = subprocess.run([TIERSEP, "--help"], capture_output=True, text=True, check=True).stdout
    for stage in STAGES:
        assert stage in out


@pytest.mark.parametrize("stage", STAGES)
def test_each_stage_has_help_with_config_option(stage):
    out = subprocess.run([TIERSEP, stage, "--help"], capture_output=True, text=True, check=True).stdout
    assert "--config" in out and "usage: tiersep " + stage in out


def test_bad_config_is_one_line_and_exit_2(tmp_path):
    bad = tmp_path / "c.yaml"
    bad.write_text("evaluate: {overlap: 5}\n")
    proc = subprocess.run([TIERSEP, "report", "--config", str(bad), "--out", str(tmp_path / "r")],
                          capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0
    assert f"{bad}: evaluate.overlap: 5 is greater than the maximum of 0.75" in proc.stderr


def test_set_overrides_are_validated():
    cfg = load_config(REPO / "config" / "config.yaml")
    preset = cli.resolve_preset("cpu_tiny", cfg, [("train.lr", 0.01), ("model.n_layers", 3)])
    assert preset["train"]["lr"] == 0.01 and preset["model"]["n_layers"] == 3
    with pytest.raises(ConfigError, match="train.lr"):
        cli.resolve_preset("cpu_tiny", cfg, [("train.lr", -1.0)])
    with pytest.raises(ConfigError, match="no such preset field"):
        cli.resolve_preset("cpu_tiny", cfg, [("train.nope.deeper", 1)])



# the CLI in a process of its own: its exit code, and whether it refused before `import torch` (3 s
# here); a trace, train's memory gate's or any other, needs torch
CLI_IN_A_PROCESS = """
import sys
from tiersep import cli
print(cli.main(sys.argv[1:]), "torch" in sys.modules)
"""


@pytest.mark.parametrize("argv", [
    ["estimate", "--preset", "nosuch", "--out", "OUT/x.json"],
    ["estimate", "--preset", "small", "--preset", "nosuch", "--out", "OUT/{preset}.json"],
    ["estimate", "--inference", "--preset", "nosuch", "--out", "OUT/x.json"],
    ["fit", "--preset", "nosuch", "--budget", "8", "--out", "OUT/x.yaml"],
    ["fit", "--preset", "nosuch", "--gpus", "8,t4", "--out", "OUT"],
], ids=["estimate", "estimate-several", "estimate-inference", "fit", "fit-gpus"])
def test_an_unknown_preset_is_refused_in_one_line_before_torch_is_imported(argv, tmp_path):
    argv = [a.replace("OUT", str(tmp_path / "out")) for a in argv]
    proc = subprocess.run([sys.executable, "-c", CLI_IN_A_PROCESS, *argv], capture_output=True, text=True, cwd=REPO)
    assert proc.stdout.split() == ["2", "False"], proc.stdout + proc.stderr
    assert proc.stderr.strip().count("\n") == 0
    assert "preset 'nosuch' not found (known presets: " in proc.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv, says", [
    (["train", "--preset", "cpu_tiny", "--data", "NOPE", "--out", "OUT"],
     "NOPE/manifest.json: not found; is NOPE a folder written by `tiersep prepare`?"),
    (["evaluate", "--preset", "cpu_tiny", "--model", "NOPE/model.pt", "--data", "NOPE", "--out", "OUT"],
     "NOPE/model.pt: model file not found"),
    (["evaluate", "--preset", "cpu_tiny", "--model", "MODEL", "--data", "NOPE", "--out", "OUT"],
     "NOPE/manifest.json: not found"),
    (["evaluate", "--preset", "cpu_tiny", "--model", "NOPE/model.pt", "--data", "NOPE", "--out", "MODEL"],
     "--out MODEL: is a file, not a folder"),
    (["separate", "--model", "NOPE/model.pt", "--out", "OUT", "MODEL"], "NOPE/model.pt: model file not found"),
    (["separate", "--model", "MODEL", "--out", "OUT", "NOPE/song.wav"], "INPUT NOPE/song.wav: no such file or folder"),
], ids=["train-data", "evaluate-model", "evaluate-data", "evaluate-out", "separate-model", "separate-input"])
def test_a_missing_input_of_train_evaluate_or_separate_is_refused_before_torch_or_a_trace(argv, says, tmp_path):
    """Train's memory gate traced a step (seconds) before it read --data; evaluate and separate
    imported torch (and took a GPU lease) before they read their inputs, and train imported torch
    (4 s) before its trainer read --data. Now each is one line first, torch not imported."""
    model = tmp_path / "model.pt"
    model.write_bytes(b"not read: only its presence is checked first")
    paths = {"NOPE": str(tmp_path / "nope"), "OUT": str(tmp_path / "out"), "MODEL": str(model)}

    def swap(text: str) -> str:
        for name, path in paths.items():
            text = text.replace(name, path)
        return text

    proc = subprocess.run([sys.executable, "-c", CLI_IN_A_PROCESS, *map(swap, argv)], capture_output=True, text=True,
                          cwd=REPO)
    assert proc.stdout.split() == ["2", "False"], proc.stdout + proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and swap(says) in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists()
