"""The excerpt evaluate encodes for the report's Listen section (tiersep.evaluate.listen): real
evaluations into real folders, real ffmpeg encodes, checked with ffprobe and by decoding them back."""
from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest

from test_evaluate_run import SOURCES, MixtureShare, make_cfg, make_preset, synthetic_stems, write_prepared
from tiersep.config import ConfigError
from tiersep.evaluate.listen import MAX_BYTES, encode, fitting_kbps, loudest_start
from tiersep.evaluate.run import evaluate_model
from tiersep.records import read_record

RATE = 8000
FILES = ["mixture.ogg", "vocals.estimate.ogg", "vocals.reference.ogg", "bass.estimate.ogg",
         "bass.reference.ogg"]


@pytest.fixture(autouse=True)
def _one_thread(single_thread):
    """torch on one thread (see conftest.one_torch_thread)."""


def probe_seconds(path: Path) -> float:
    out = subprocess.run(["ffprobe", "-v", "error", "-show_entries", "format=duration", "-of", "csv=p=0",
                          str(path)], capture_output=True, text=True, check=True).stdout
    return float(out)


def decode(path: Path, rate: int, channels: int) -> np.ndarray:
    """[C, S] float32 at `rate`, through ffmpeg."""
    raw = subprocess.run(["ffmpeg", "-v", "error", "-i", str(path), "-f", "f32le", "-ac", str(channels),
                          "-ar", str(rate), "pipe:1"], capture_output=True, check=True).stdout
    return np.frombuffer(raw, dtype="<f4").reshape(-1, channels).T


@pytest.fixture
def prepared(tmp_path):
    """Three stereo tracks; the first (the excerpt's) is loud only from 2.5 s to 4.5 s."""
    loud = synthetic_stems(1, 6.0, channels=2)
    loud[..., : int(2.5 * RATE)] *= 0.05
    loud[..., int(4.5 * RATE):] *= 0.05
    tracks = {"Alpha - One": loud, "Beta - Two": synthetic_stems(2, 2.6, channels=2),
              "Gamma - Three": synthetic_stems(3, 3.1, channels=2)}
    return write_prepared(tmp_path / "prepared", tracks)


def test_the_loudest_stretch_of_the_first_track_is_encoded_small(prepared, tmp_path):
    out = tmp_path / "eval"
    evaluate_model(make_cfg(listen_seconds=2, max_tracks=2), make_preset(channels=2), MixtureShare(2), prepared, out)
    folder = out / "listen"
    record = read_record("listen", folder / "listen.json")
    assert sorted(p.name for p in folder.iterdir()) == sorted(FILES + ["listen.json"])
    assert [f["file"] for f in record["files"]] == FILES
    assert [(f["role"], f["stem"]) for f in record["files"]] == [
        ("mixture", None), ("estimate", "vocals"), ("reference", "vocals"), ("estimate", "bass"),
        ("reference", "bass")]
    assert record["track"] == "Alpha - One" and record["preset"] == "cpu_tiny"
    assert record["start"] == 2.5 and record["seconds"] == 2.0   # the loud 2 s, on the 0.5 s grid
    assert record["codec"] == "opus" and record["kbps"] == 48 and record["sample_rate"] == RATE
    for entry in record["files"]:
        path = folder / entry["file"]
        assert path.stat().st_size == entry["bytes"] and path.read_bytes().startswith(b"OggS")
        assert probe_seconds(path) == pytest.approx(2.0, abs=0.02)   # Opus pre-skip: 6.5 ms
    assert record["bytes"] == sum(f["bytes"] for f in record["files"]) < MAX_BYTES
    assert record["bytes"] < 5 * 2.0 * 48_000 / 8 * 1.1                # about the nominal bitrate

    # what was encoded is that stretch of the mixture, scaled by the recorded gain
    from tiersep.data.tracks import read_track

    mixture, _stems = read_track(prepared, "test", "Alpha - One", SOURCES)
    expected = mixture[:, int(2.5 * RATE): int(4.5 * RATE)] * record["gain"]
    heard = decode(folder / "mixture.ogg", RATE, 2)[:, : expected.shape[1]]
    inner = slice(int(0.05 * RATE), int(1.95 * RATE))   # without the 10 ms fades
    correlation = np.corrcoef(heard[:, inner].ravel(), expected[:, inner].ravel())[0, 1]
    assert correlation > 0.85   # Opus is perceptual: the noise stems do not come back sample for sample
    early = mixture[:, int(1.5 * RATE): int(3.5 * RATE)] * record["gain"]   # a second earlier: not it
    assert np.corrcoef(heard[:, inner].ravel(), early[:, inner].ravel())[0, 1] < 0.5
    assert 0 < record["gain"] <= 1 and np.abs(heard).max() < 1.0


def test_a_track_shorter_than_the_excerpt_is_used_whole(tmp_path):
    prepared = write_prepared(tmp_path / "prepared", {"Short": synthetic_stems(4, 3.3, channels=2)})
    out = tmp_path / "eval"
    evaluate_model(make_cfg(), make_preset(channels=2), MixtureShare(2), prepared, out)  # listen_seconds 10
    record = read_record("listen", out / "listen" / "listen.json")
    assert record["start"] == 0 and record["seconds"] == 3.3
    for entry in record["files"]:
        assert probe_seconds(out / "listen" / entry["file"]) == pytest.approx(3.3, abs=0.02)


def test_listen_seconds_0_writes_none_and_removes_an_earlier_excerpt(prepared, tmp_path):
    out = tmp_path / "eval"
    evaluate_model(make_cfg(listen_seconds=1, max_tracks=1), make_preset(channels=2), MixtureShare(2), prepared, out)
    assert (out / "listen" / "listen.json").is_file()
    evaluate_model(make_cfg(listen_seconds=0, max_tracks=1), make_preset(channels=2), MixtureShare(2), prepared, out)
    assert not (out / "listen").exists() and (out / "scores.json").is_file()


def test_without_ffmpeg_evaluate_stops_before_separating(prepared, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(ConfigError, match="ffmpeg not found on PATH: evaluate.listen_seconds needs it"):
        evaluate_model(make_cfg(), make_preset(channels=2), MixtureShare(2), prepared, tmp_path / "eval")
    assert not (tmp_path / "eval" / "scores.json").exists() and not (tmp_path / "eval" / "museval").exists()
    # an ffmpeg built without libopus answers as a real one does (ffmpeg 5.1 on Debian, `-h encoder=nope`)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ffmpeg").write_text("#!/bin/sh\necho \"Codec 'libopus' is not recognized by FFmpeg.\"\n")
    (bin_dir / "ffmpeg").chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    with pytest.raises(ConfigError, match="built without the Opus encoder"):
        evaluate_model(make_cfg(), make_preset(channels=2), MixtureShare(2), prepared, tmp_path / "eval")


def test_loudest_start():
    quiet = np.full((2, 100), 0.01, dtype=np.float32)
    quiet[:, 40:60] = 1
    assert loudest_start(quiet, 20, 10) == 40
    assert loudest_start(quiet, 20, 15) == 45    # the best start on the grid: 15 of its 20 are loud
    assert loudest_start(quiet, 100, 10) == 0 and loudest_start(quiet, 500, 10) == 0
    assert loudest_start(np.zeros((1, 100), np.float32), 20, 10) == 0   # silence: the first


def test_the_bitrate_is_lowered_so_that_the_longest_excerpt_fits_the_cap(tmp_path):
    """The worst case the schema allows: 30 s, 7 stems (15 files), white noise (Opus spends its
    whole budget on it), asked at the highest bitrate."""
    files, seconds = 15, 30.0
    kbps = fitting_kbps(256, files, seconds)
    assert kbps < 256 and fitting_kbps(48, 9, 10.0) == 48
    noise = np.random.default_rng(0).uniform(-0.5, 0.5, (2, int(seconds * 44100))).astype(np.float32)
    encode(noise, 44100, kbps, tmp_path / "noise.ogg")
    assert (tmp_path / "noise.ogg").stat().st_size * files <= MAX_BYTES
    assert (tmp_path / "noise.ogg").stat().st_size * files > 0.8 * MAX_BYTES   # not needlessly small
