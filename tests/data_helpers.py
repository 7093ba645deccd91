"""Small builders shared by the tests/test_data_*.py modules (not a test module itself)."""
from __future__ import annotations

from pathlib import Path

from tiersep import config as C
from tiersep.data import synthetic

# Tiny synthetic set: 3 train tracks (the last one valid) and 1 test track of 1.5 s at 16 kHz.
TINY = {"seed": 3, "sample_rate": 16000, "train_tracks": 3, "valid_tracks": 1, "test_tracks": 1,
        "track_seconds": 1.5}


def make_cfg(tmp_path: Path, **data) -> dict:
    """A validated config (defaults filled) whose prepared/raw folders live under tmp_path."""
    data.setdefault("prepared_dir", str(tmp_path / "data" / "prepared"))
    data.setdefault("synthetic", dict(TINY))
    return C.validate({"data": data}, "config.schema.yaml", "test config")


def write_musdb_layout(root: Path, sample_rate: int = 44100, seconds: float = 1.0, train: int = 3,
                       test: int = 1, seed: int = 11) -> dict:
    """A small, valid MUSDB18-HQ folder (the synthetic generator's output) to point sources at."""
    settings = {"generator": "tiersep.data.synthetic", "version": synthetic.GENERATOR_VERSION,
                "seed": seed, "sample_rate": sample_rate, "train_tracks": train, "valid_tracks": 1,
                "test_tracks": test, "track_seconds": seconds}
    return synthetic.generate(root, settings, progress=False)
