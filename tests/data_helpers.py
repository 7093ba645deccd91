"""Small builders shared by the tests/test_data_*.py modules (not a test module itself)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import soundfile as sf

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


# One pure tone per stem (Hz), all below 4 kHz so that they survive at 8 kHz; "other" also holds
# ALIAS_HZ, which an 8 kHz prepare must filter out (decimating without a low-pass would fold it to
# 8000 - ALIAS_HZ).
TONES = {"drums": 3000.0, "bass": 110.0, "other": 660.0, "vocals": 1250.0}
ALIAS_HZ = 6000.0


def write_tone_track(folder: Path, sample_rate: int, seconds: float) -> None:
    """A MUSDB18-HQ track folder whose stems are the TONES (stereo float32 WAV, the right channel at
    half the left), mixture = their sum."""
    t = np.arange(int(round(seconds * sample_rate))) / sample_rate
    stems = {stem: 0.2 * np.sin(2 * np.pi * hz * t) for stem, hz in TONES.items()}
    stems["other"] = stems["other"] + 0.1 * np.sin(2 * np.pi * ALIAS_HZ * t)
    folder.mkdir(parents=True)
    for stem, mono in stems.items():
        sf.write(str(folder / f"{stem}.wav"), np.stack([mono, 0.5 * mono], axis=1).astype(np.float32),
                 sample_rate, subtype="FLOAT")
    mixture = sum(stems.values())
    sf.write(str(folder / "mixture.wav"), np.stack([mixture, 0.5 * mixture], axis=1).astype(np.float32),
             sample_rate, subtype="FLOAT")
