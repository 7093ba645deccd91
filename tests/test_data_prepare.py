"""prepare(): layout, manifest, resampling, idempotence, the stems .mp4 source, and the CLI."""
from __future__ import annotations

import hashlib
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import yaml

from data_helpers import ALIAS_HZ, TINY, TONES, make_cfg, write_musdb_layout, write_tone_track
from tiersep.data import synthetic
from tiersep.data.errors import DataError
from tiersep.data.prepare import MANIFEST, check_prepared, prepare, request_of, resample

STEM_FILES = ("mixture", "drums", "bass", "other", "vocals")
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("prep")
    cfg = make_cfg(tmp)
    out = tmp / "data" / "prepared" / "synthetic" / "8000"
    return cfg, out, prepare(cfg, out, 8000, progress=False)


def test_layout_and_manifest(prepared):
    cfg, out, manifest = prepared
    _root, info = synthetic.ensure_synthetic(cfg, progress=False)
    assert manifest["splits"]["valid"] == info["valid_tracks"]
    assert len(manifest["splits"]["train"]) == TINY["train_tracks"] - TINY["valid_tracks"]
    assert len(manifest["splits"]["test"]) == TINY["test_tracks"]
    assert manifest["source"] == "synthetic" and manifest["generator"]["seed"] == TINY["seed"]
    assert manifest["version"].startswith("tiersep.data.synthetic v")
    assert manifest["sample_rate"] == 8000 and manifest["skipped"] == []
    assert manifest["versions"]["musdb"] == "0.4.3"
    expected = math.ceil(TINY["track_seconds"] * TINY["sample_rate"] * 8000 / TINY["sample_rate"])
    for track in manifest["tracks"]:
        assert track["samples"] == expected and track["rate"] == 8000 and track["channels"] == 2
        assert track["source_rate"] == TINY["sample_rate"]
        for stem in STEM_FILES:
            entry = track["files"][stem]
            path = out / entry["path"]
            assert entry["path"] == f"{track['split']}/{track['name']}/{stem}.wav"
            assert hashlib.sha256(path.read_bytes()).hexdigest() == entry["sha256"]
            sfinfo = sf.info(str(path))
            assert (sfinfo.samplerate, sfinfo.channels, sfinfo.frames, sfinfo.subtype) == (8000, 2, expected, "FLOAT")
    assert sorted(p.name for p in out.iterdir()) == [MANIFEST, "test", "train", "valid"]
    assert not list(out.parent.glob(".*.tmp"))


def test_resampled_mixture_is_still_the_sum(prepared):
    _cfg, out, manifest = prepared
    track = manifest["tracks"][0]
    folder = out / track["split"] / track["name"]
    audio = {s: sf.read(str(folder / f"{s}.wav"), dtype="float32")[0] for s in STEM_FILES}
    np.testing.assert_allclose(audio["mixture"], sum(audio[s] for s in STEM_FILES[1:]), atol=2e-6)
    assert np.abs(audio["vocals"]).max() > 0.01


def test_second_prepare_does_nothing(prepared, capsys):
    cfg, out, _manifest = prepared
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    again = prepare(cfg, out, 8000, progress=False)
    assert "nothing to do" in capsys.readouterr().out
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == before
    assert again == json.loads((out / MANIFEST).read_text())


def test_damage_or_other_settings_mean_rebuild(tmp_path, capsys):
    cfg = make_cfg(tmp_path)
    out = tmp_path / "prepared" / "synthetic" / "16000"
    first = prepare(cfg, out, 16000, progress=False)
    victim = out / first["tracks"][0]["files"]["bass"]["path"]
    victim.unlink()
    prepare(cfg, out, 16000, progress=False)
    assert "rebuilding" in capsys.readouterr().out and victim.is_file()
    assert check_prepared(out, request_of(cfg, 16000))[0] is not None
    cfg["data"]["synthetic"]["seed"] += 1  # another dataset: the folder no longer answers the request
    assert check_prepared(out, request_of(cfg, 16000)) == (None, "prepared for other settings (generator changed)")
    cfg["data"]["skip_invalid"] = True
    assert check_prepared(out, request_of(cfg, 16000))[1] == \
        "prepared for other settings (generator, skip_invalid changed)"


def test_equal_rate_is_an_exact_copy(tmp_path):
    cfg = make_cfg(tmp_path)
    out = tmp_path / "prepared" / "synthetic" / "16000"
    manifest = prepare(cfg, out, TINY["sample_rate"], progress=False)
    root, _info = synthetic.ensure_synthetic(cfg, progress=False)
    track = manifest["tracks"][-1]
    for stem in STEM_FILES:
        ours = sf.read(str(out / track["files"][stem]["path"]), dtype="float32")[0]
        theirs = sf.read(str(root / track["subset"] / track["name"] / f"{stem}.wav"), dtype="float32")[0]
        assert np.array_equal(ours, theirs), stem


def test_resample_48k_to_44k1_keeps_a_sine():
    seconds, freq = 1.5, 1000.0
    t = np.arange(int(seconds * 48000)) / 48000
    sine = np.stack([np.sin(2 * np.pi * freq * t), 0.5 * np.sin(2 * np.pi * freq * t)]).astype(np.float32)
    out = resample(sine, 48000, 44100)
    assert out.dtype == np.float32 and out.shape == (2, math.ceil(sine.shape[1] * 441 / 480)) == (2, 66150)
    spectrum = np.abs(np.fft.rfft(out[0] * np.hanning(out.shape[1])))
    peak_hz = np.argmax(spectrum) * 44100 / out.shape[1]
    assert abs(peak_hz - freq) < 1.0
    # away from the edges it is the ideal 1 kHz sine at 44.1 kHz, to within -60 dB
    t_new = np.arange(out.shape[1]) / 44100
    ideal = np.sin(2 * np.pi * freq * t_new)
    inner = slice(2000, -2000)
    error = out[0, inner] - ideal[inner]
    assert 10 * np.log10(np.sum(error ** 2) / np.sum(ideal[inner] ** 2)) < -60
    np.testing.assert_allclose(out[1, inner], 0.5 * out[0, inner], atol=1e-6)
    assert resample(sine, 48000, 48000) is not sine and np.array_equal(resample(sine, 48000, 48000), sine)


def test_48k_source_prepared_at_44k1(tmp_path):
    cfg = make_cfg(tmp_path, synthetic={**TINY, "sample_rate": 48000, "train_tracks": 2, "track_seconds": 1.0})
    manifest = prepare(cfg, tmp_path / "out", 44100, progress=False)
    for track in manifest["tracks"]:
        assert track["source_rate"] == 48000 and track["source_samples"] == 48000
        assert track["samples"] == 44100
        assert sf.info(str(tmp_path / "out" / track["files"]["vocals"]["path"])).frames == 44100


# ----------------------------------------------------------------------------- a user's 48 kHz stems
@pytest.fixture(scope="module")
def studio_48k(tmp_path_factory):
    """A user's MUSDB18-HQ-layout folder at 48 kHz: 2 train tracks (1 s), a test track and a test
    track of pure tones (1.5 s)."""
    root = tmp_path_factory.mktemp("studio") / "stems-48k"
    info = write_musdb_layout(root, sample_rate=48000, seconds=1.0, train=2, test=1)
    write_tone_track(root / "test" / "Tone - Check", 48000, 1.5)
    return root, info["valid_tracks"]


@pytest.mark.parametrize("rate", [44100, 8000])
def test_48k_multitracks_prepared_once_at_a_tier_rate(tmp_path, studio_48k, rate, capsys):
    """Through the real musdb parser (source musdb18hq): lengths follow the rate change, a tone keeps
    its frequency, a tone above the new Nyquist is filtered rather than folded, the manifest records
    the source rate, and a second prepare does no work."""
    root, valid = studio_48k
    cfg = make_cfg(tmp_path, source="musdb18hq", root=str(root), valid_tracks=valid)
    out = tmp_path / "prepared" / "musdb18hq" / str(rate)
    manifest = prepare(cfg, out, rate, progress=False)
    assert manifest["source_sample_rates"] == [48000] and manifest["sample_rate"] == rate
    assert "from 48000 Hz" in capsys.readouterr().out
    assert len(manifest["tracks"]) == 4 and manifest["parser"] == "musdb 0.4.3"
    for track in manifest["tracks"]:
        seconds = 1.5 if track["name"] == "Tone - Check" else 1.0
        assert (track["source_rate"], track["source_samples"]) == (48000, int(seconds * 48000))
        assert track["samples"] == int(seconds * rate) and track["rate"] == rate
        for entry in track["files"].values():
            assert sf.info(str(out / entry["path"])).frames == track["samples"]

    tone = next(t for t in manifest["tracks"] if t["name"] == "Tone - Check")
    spectra = {}
    for stem, hz in TONES.items():
        audio = sf.read(str(out / tone["files"][stem]["path"]), dtype="float32")[0]
        np.testing.assert_allclose(audio[:, 1], 0.5 * audio[:, 0], atol=1e-6)
        spectra[stem] = np.abs(np.fft.rfft(audio[:, 0] * np.hanning(len(audio))))
        freqs = np.fft.rfftfreq(len(audio), 1 / rate)
        assert abs(freqs[np.argmax(spectra[stem])] - hz) < 0.5, stem  # bins of 0.67 Hz: 1.5 s
    level_db = 20 * np.log10(spectra["other"] / spectra["other"].max() + 1e-20)
    if rate < 2 * ALIAS_HZ:  # filtered: nothing at the fold-over frequency
        assert level_db[np.abs(freqs - (rate - ALIAS_HZ)) < 20].max() < -80
    else:  # kept, at its level (half the 660 Hz tone's)
        assert abs(level_db[np.abs(freqs - ALIAS_HZ) < 2].max() - 20 * np.log10(0.5)) < 0.5

    before = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    assert prepare(cfg, out, rate, progress=False) == manifest
    assert "nothing to do" in capsys.readouterr().out
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == before


def test_48k_track_with_a_44k1_stem_is_an_error(tmp_path, studio_48k):
    """One rate per track: a stem bounced at another rate than its mixture names that file."""
    root, valid = studio_48k
    copy = tmp_path / "stems-48k"
    shutil.copytree(root, copy)
    vocals = copy / "test" / "Tone - Check" / "vocals.wav"
    sf.write(str(vocals), sf.read(str(vocals), dtype="float32")[0], 44100, subtype="FLOAT")
    cfg = make_cfg(tmp_path, source="musdb18hq", root=str(copy), valid_tracks=valid)
    with pytest.raises(DataError, match=r"musdb18hq: track 'Tone - Check': mixed sample rates: "
                                        r"\S*/Tone - Check/vocals\.wav is 44100 Hz but mixture\.wav is 48000 Hz$"):
        prepare(cfg, tmp_path / "out", 8000, progress=False)
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- MUSDB18 (.stem.mp4)
@pytest.fixture(scope="module")
def stems_layout(tmp_path_factory):
    """A MUSDB18-style folder of 3 stem files (AAC in mp4, as stempeg writes them), 0.5 s each."""
    import stempeg

    root = tmp_path_factory.mktemp("musdb18") / "musdb18"
    wav_root = root.parent / "wav"
    settings = {**synthetic.generator_settings(make_cfg(root.parent)), "sample_rate": 44100, "train_tracks": 2,
                "valid_tracks": 1, "test_tracks": 1, "track_seconds": 0.5}
    info = synthetic.generate(wav_root, settings, progress=False)
    for entry in info["tracks"]:
        folder = wav_root / entry["subset"] / entry["name"]
        audio = np.stack([sf.read(str(folder / f"{s}.wav"), dtype="float32")[0] for s in STEM_FILES])
        (root / entry["subset"]).mkdir(parents=True, exist_ok=True)
        stempeg.write_stems(str(root / entry["subset"] / f"{entry['name']}.stem.mp4"), audio, sample_rate=44100,
                            writer=stempeg.StreamsWriter(codec="aac", bitrate=256000))
    return root, wav_root, info


def test_musdb18_stems_are_decoded_and_trimmed(tmp_path, stems_layout):
    root, wav_root, info = stems_layout
    valid = info["valid_tracks"]
    cfg = make_cfg(tmp_path, source="musdb18", root=str(root), valid_tracks=valid)
    manifest = prepare(cfg, tmp_path / "out", 44100, progress=False)
    assert manifest["splits"]["valid"] == valid and len(manifest["splits"]["test"]) == 1
    for track in manifest["tracks"]:
        assert track["source_samples"] == 22050 and track["samples"] == 22050  # AAC padding trimmed
        entry = next(t for t in info["tracks"] if t["name"] == track["name"])
        original = sf.read(str(wav_root / entry["subset"] / entry["name"] / "bass.wav"), dtype="float32")[0]
        decoded = sf.read(str(tmp_path / "out" / track["files"]["bass"]["path"]), dtype="float32")[0]
        assert decoded.shape == original.shape
        assert np.corrcoef(decoded[:, 0], original[:, 0])[0, 1] > 0.95  # lossy, but aligned


def test_musdb18_missing_stream(tmp_path, stems_layout):
    import stempeg

    root, _wav_root, info = stems_layout
    copy = tmp_path / "musdb18"
    shutil.copytree(root, copy)
    name = info["tracks"][0]["name"]
    stempeg.write_stems(str(copy / "train" / f"{name}.stem.mp4"), np.zeros((4, 4410, 2), np.float32),
                        sample_rate=44100, writer=stempeg.StreamsWriter(codec="aac", bitrate=128000))
    cfg = make_cfg(tmp_path, source="musdb18", root=str(copy), valid_tracks=info["valid_tracks"])
    with pytest.raises(DataError, match=rf"track '{name}': .*{name}\.stem\.mp4 has 4 audio streams, expected 5 "
                                        r"\(mixture, drums, bass, other, vocals\); a stem is missing"):
        prepare(cfg, tmp_path / "out", 8000, progress=False)
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- the CLI
def test_cli_prepare_twice_and_bad_source(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({
        "data": {"prepared_dir": str(tmp_path / "prepared"), "synthetic": {**TINY, "train_tracks": 2}},
        "presets_dir": str(REPO / "config" / "presets")}))
    tiersep = str(Path(sys.executable).parent / "tiersep")
    # at the source's own rate: no resampling, so the subprocess need not import torch (seconds)
    cmd = [tiersep, "prepare", "--config", str(config), "--out", str(tmp_path / "out"),
           "--sample-rate", str(TINY["sample_rate"])]
    first = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    second = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path)
    assert second.returncode == 0 and "nothing to do" in second.stdout
    assert json.loads((tmp_path / "out" / MANIFEST).read_text())["sample_rate"] == TINY["sample_rate"]
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"data": {"source": "musdb18hq", "root": str(tmp_path / "nowhere")},
                                   "presets_dir": str(REPO / "config" / "presets")}))
    proc = subprocess.run([*cmd[:3], str(bad), *cmd[4:]], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0
    assert "nowhere does not exist" in proc.stderr
