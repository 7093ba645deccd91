"""Shared pieces of the training tests (no tests here): a tiny prepared dataset made by the real
tiersep.data pipeline, a tiny real preset, and runners for `tiersep train` in-process or as a
separate process (needed to SIGKILL / SIGTERM it)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

from tiersep import config as C

REPO = Path(__file__).resolve().parents[1]

# A real TF-Locoformer and loss, sized for seconds: 8 kHz, 0.25 s segments, 1 layer x 8 channels.
# Dropout > 0 on purpose: a resumed run must restore the generator dropout draws from.
TINY_PRESET = {
    "name": "train_test_tiny",
    "audio": {"sample_rate": 8000, "channels": 2, "segment_samples": 2000, "n_fft": 128, "hop": 64},
    "model": {"n_layers": 1, "emb_dim": 8, "attention_dim": 8, "n_heads": 2, "ffn_hidden": 16,
              "norm_groups": 2, "dropout": 0.1},
    "train": {"device": "cpu", "batch_size": 2, "grad_accum": 1, "precision": "fp32", "lr": 2.0e-3,
              "steps": 8, "warmup_steps": 2, "num_workers": 0, "checkpoint_every": 4,
              "validate_every": 4, "validate_segments": 2},
}


def tiny_preset(**sets) -> dict:
    """TINY_PRESET validated with defaults, with dotted overrides: tiny_preset(**{"train.steps": 3})."""
    preset = C.validate(yaml.safe_load(yaml.safe_dump(TINY_PRESET)), "preset.schema.yaml", "tiny")
    for key, value in sets.items():
        preset = C.set_field(preset, key, value)
    preset = C.validate(preset, "preset.schema.yaml", "tiny")
    C.check_preset(preset, "tiny")
    return preset


def make_workspace(root: Path) -> dict:
    """A config whose presets_dir holds the tiny preset, and a small prepared dataset made with the
    real synthetic generator + musdb ingest + resampling (2 train, 1 valid, 1 test track of 2 s)."""
    from tiersep.data.prepare import prepare

    root.mkdir(parents=True, exist_ok=True)
    presets = root / "presets"
    presets.mkdir(exist_ok=True)
    (presets / f"{TINY_PRESET['name']}.yaml").write_text(yaml.safe_dump(TINY_PRESET, sort_keys=False))
    raw = {"data": {"source": "synthetic", "prepared_dir": str(root / "data" / "prepared"),
                    "synthetic": {"seed": 3, "sample_rate": 16000, "train_tracks": 3, "valid_tracks": 1,
                                  "test_tracks": 1, "track_seconds": 2}},
           "presets_dir": str(presets), "tiers": [TINY_PRESET["name"]], "estimate_tiers": [],
           "budget_gib": 24}
    config_file = root / "config.yaml"
    config_file.write_text(yaml.safe_dump(raw, sort_keys=False))
    cfg = C.load_config(config_file)
    data = root / "data" / "prepared" / "synthetic" / "8000"
    prepare(cfg, data, 8000, progress=False)
    return {"root": root, "cfg": cfg, "config_file": config_file, "data": data}


def cli_train(ws: dict, out: Path, *args: str, env: dict | None = None,
              preset: str = TINY_PRESET["name"]) -> subprocess.Popen:
    """Start `tiersep train` as its own process (stdout/stderr to out.log); returns the Popen."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    log = open(str(out) + ".log", "a")
    cmd = [sys.executable, "-m", "tiersep.cli", "train", "--config", str(ws["config_file"]),
           "--preset", preset, "--data", str(ws["data"]), "--out", str(out), *args]
    # One thread: the tensors are tiny, so a second thread only adds synchronisation.
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


# The shipped cpu_tiny tier, short: no validation or checkpoint before the end, the last weights
# exported (the data-parallel tests train it in real torchrun processes).
CPU_TINY_FILE = str(REPO / "config" / "presets" / "cpu_tiny.yaml")
CPU_TINY_SHORT = ["--set", "train.validate_every=1000", "--set", "train.checkpoint_every=1000",
                  "--set", "train.validate_segments=1", "--set", "train.export=last",
                  "--set", "train.warmup_steps=2"]


def cpu_tiny_command(ws: dict, out: Path, *sets: str) -> list[str]:
    """`tiersep train --preset cpu_tiny`, short (CPU_TINY_SHORT), then `sets`."""
    return [sys.executable, "-m", "tiersep.cli", "train", "--config", str(ws["config_file"]),
            "--preset", CPU_TINY_FILE, "--data", str(ws["data"]), "--out", str(out), *CPU_TINY_SHORT, *sets]


def metrics_rows(out: Path) -> list[dict]:
    import csv

    path = Path(out) / "metrics.csv"
    if not path.is_file():
        return []
    with open(path, newline="") as f:
        return [row for row in csv.DictReader(f) if row.get("step", "").isdigit()]
