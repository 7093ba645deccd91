"""Ingest checks: every bad input gives a clear error naming the track and file (or, with
data.skip_invalid, a skipped track with its reason in the manifest), and nothing is left behind."""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from data_helpers import make_cfg, write_musdb_layout
from tiersep.data import ingest
from tiersep.data.errors import DataError
from tiersep.data.prepare import prepare
from tiersep.data.tracks import load_manifest


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """A valid 44.1 kHz MUSDB18-HQ layout: 3 train tracks, 1 test track, 1 s each."""
    root = tmp_path_factory.mktemp("pristine") / "musdb18hq"
    info = write_musdb_layout(root)
    return root, info


@pytest.fixture
def layout(tmp_path, pristine):
    """A fresh copy of the pristine layout to damage, the names of its tracks, and a config."""
    root, info = pristine
    copy = tmp_path / "musdb18hq"
    shutil.copytree(root, copy)
    train = [t["name"] for t in info["tracks"] if t["subset"] == "train"]
    test = [t["name"] for t in info["tracks"] if t["subset"] == "test"]
    cfg = make_cfg(tmp_path, source="musdb18hq", root=str(copy), valid_tracks=[train[-1]])
    return copy, train, test, cfg


def out_of(cfg):
    return Path(cfg["data"]["prepared_dir"]) / "musdb18hq" / "8000"


def fails(cfg, match):
    out = out_of(cfg)
    with pytest.raises(DataError, match=match):
        prepare(cfg, out, 8000, progress=False)
    assert not out.exists()
    leftovers = list(out.parent.glob(".*.tmp")) if out.parent.exists() else []
    assert not leftovers, leftovers


def rewrite(path: Path, audio=None, rate=None):
    """Overwrite a WAV with other audio and/or another rate (float32)."""
    data, old_rate = sf.read(str(path), dtype="float32", always_2d=True)
    sf.write(str(path), data if audio is None else audio, rate or old_rate, subtype="FLOAT")


def test_good_layout_prepares(layout):
    root, train, test, cfg = layout
    manifest = prepare(cfg, out_of(cfg), 8000, progress=False)
    assert manifest["splits"] == {"train": train[:-1], "valid": train[-1:], "test": test}
    assert manifest["skipped"] == []
    assert manifest["source"] == "musdb18hq" and manifest["parser"] == "musdb 0.4.3"
    assert manifest["version"] == "MUSDB18-HQ (wav)" and manifest["root"] == str(root.resolve())


def test_missing_stem(layout):
    root, train, _test, cfg = layout
    (root / "train" / train[0] / "vocals.wav").unlink()
    fails(cfg, rf"track '{train[0]}': missing stem file .*/{train[0]}/vocals\.wav")


def test_mono_stem(layout):
    root, train, _test, cfg = layout
    path = root / "train" / train[0] / "bass.wav"
    rewrite(path, sf.read(str(path), dtype="float32")[0][:, :1])
    fails(cfg, rf"track '{train[0]}': .*/bass\.wav is mono \(1 channel\); MUSDB stems must be stereo")


def test_three_channel_stem(layout):
    root, train, _test, cfg = layout
    path = root / "train" / train[1] / "other.wav"
    data = sf.read(str(path), dtype="float32")[0]
    rewrite(path, np.concatenate([data, data[:, :1]], axis=1))
    fails(cfg, rf"track '{train[1]}': .*/other\.wav is 3 channels; MUSDB stems must be stereo")


def test_stem_length_mismatch(layout):
    root, train, _test, cfg = layout
    path = root / "train" / train[0] / "drums.wav"
    rewrite(path, sf.read(str(path), dtype="float32")[0][:-100])
    fails(cfg, rf"track '{train[0]}': stem length mismatch: .*/drums\.wav has 44000 samples but "
               r"mixture\.wav has 44100")


def test_each_track_is_resampled_from_its_own_rate(layout):
    """A user's folder need not be at 44.1 kHz, nor all at one rate: a track whose files are all at
    48 kHz is prepared from 48 kHz (its 44100 samples are 0.91875 s there)."""
    root, train, _test, cfg = layout
    for path in (root / "train" / train[2]).glob("*.wav"):
        rewrite(path, rate=48000)
    manifest = prepare(cfg, out_of(cfg), 8000, progress=False)
    assert manifest["source_sample_rates"] == [44100, 48000]
    rates = {t["name"]: (t["source_rate"], t["source_samples"], t["samples"]) for t in manifest["tracks"]}
    assert rates.pop(train[2]) == (48000, 44100, 7350)
    assert set(rates.values()) == {(44100, 44100, 8000)}


def test_mixed_sample_rates(layout):
    root, train, _test, cfg = layout
    rewrite(root / "train" / train[0] / "vocals.wav", rate=22050)
    fails(cfg, rf"track '{train[0]}': mixed sample rates: .*/vocals\.wav is 22050 Hz but mixture\.wav is 44100 Hz")


def test_corrupt_file(layout):
    root, _train, test, cfg = layout
    (root / "test" / test[0] / "mixture.wav").write_bytes(b"RIFF\x00\x00not really a wave file" * 10)
    fails(cfg, rf"track '{test[0]}': cannot read .*/{test[0]}/mixture\.wav")


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_nan_or_inf_samples(layout, bad):
    root, train, _test, cfg = layout
    path = root / "train" / train[1] / "vocals.wav"
    data = sf.read(str(path), dtype="float32")[0]
    data[1234, 1] = bad
    rewrite(path, data)
    fails(cfg, rf"track '{train[1]}': .*/vocals\.wav contains NaN or Inf samples \(first at sample 1234\)")


def test_empty_root(tmp_path):
    (tmp_path / "empty" / "train").mkdir(parents=True)
    cfg = make_cfg(tmp_path, source="musdb18hq", root=str(tmp_path / "empty"))
    fails(cfg, r"musdb18hq: no tracks under .*/empty \(empty root; expected .*mixture,drums,bass,other,vocals")


def test_missing_root(tmp_path):
    cfg = make_cfg(tmp_path, source="musdb18hq", root=str(tmp_path / "nowhere"))
    with pytest.raises(DataError, match=r"data.root: .*/nowhere does not exist"):
        prepare(cfg, out_of(cfg), 8000, progress=False)
    assert not (tmp_path / "data").exists()


def test_empty_test_split(layout):
    root, _train, test, cfg = layout
    shutil.rmtree(root / "test" / test[0])
    fails(cfg, r"musdb18hq: split test is empty: no usable tracks for it under .*/test")


def test_empty_official_valid_split(layout):
    """musdb's official validation list names real MUSDB tracks; a folder without them has no
    valid split unless data.valid_tracks names one."""
    root, _train, _test, cfg = layout
    cfg["data"]["valid_tracks"] = None
    fails(cfg, r"split valid is empty: none of musdb's official validation tracks .* name the validation "
               r"tracks in data.valid_tracks")


def test_unknown_valid_track(layout):
    _root, _train, _test, cfg = layout
    cfg["data"]["valid_tracks"] = ["Nobody - Nothing"]
    fails(cfg, r"data.valid_tracks: 'Nobody - Nothing' not found under .*/train \(train tracks: '")


def test_skip_invalid_records_reasons(layout):
    """With skip_invalid a corrupt mixture (which would stop musdb's own parse), a mono stem and a
    NaN stem only cost their tracks; the manifest says why."""
    root, train, test, cfg = layout
    broken_mix, with_nan = root / "train" / "Zz Extra - Broken Mixture", root / "train" / "Zz Extra - Nan Stem"
    for extra in (broken_mix, with_nan):
        shutil.copytree(root / "train" / train[0], extra)
    (broken_mix / "mixture.wav").write_bytes(b"garbage" * 100)
    data = sf.read(str(with_nan / "other.wav"), dtype="float32")[0]
    data[5] = np.nan
    rewrite(with_nan / "other.wav", data)
    path = root / "train" / train[0] / "bass.wav"
    rewrite(path, sf.read(str(path), dtype="float32")[0][:, :1])

    cfg["data"]["skip_invalid"] = True
    manifest = prepare(cfg, out_of(cfg), 8000, progress=False)
    reasons = {s["name"]: s["reason"] for s in manifest["skipped"]}
    assert set(reasons) == {broken_mix.name, with_nan.name, train[0]}
    assert "cannot read" in reasons[broken_mix.name] and "mixture.wav" in reasons[broken_mix.name]
    assert "mono" in reasons[train[0]] and "bass.wav" in reasons[train[0]]
    assert "NaN" in reasons[with_nan.name] and "other.wav" in reasons[with_nan.name]
    assert manifest["splits"] == {"train": [train[1]], "valid": [train[2]], "test": test}
    assert load_manifest(out_of(cfg))["skipped"] == manifest["skipped"]
    assert sorted(p.name for p in (out_of(cfg) / "train").iterdir()) == [train[1]]


def test_no_ffmpeg_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # a PATH on which nothing is found
    with pytest.raises(DataError, match=r"ffmpeg and ffprobe not found on PATH; .*apt-get install ffmpeg"):
        ingest.require_ffmpeg()


def test_musdb_sample_offline_fails_cleanly(tmp_path, monkeypatch):
    """Offline, the real download fails, and neither the raw folder, nor the prepared folder, nor a
    temporary download folder remains. Offline is forced, whatever this machine can reach: every
    request goes through a proxy on a local port that nothing listens on (connection refused)."""
    import socket
    import urllib.request

    with socket.socket() as probe:   # a free port, closed again: connecting there is refused
        probe.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{probe.getsockname()[1]}"
    for name in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY"):
        monkeypatch.setenv(name, closed)
    for name in ("no_proxy", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(urllib.request, "_opener", None)   # urlopen builds its opener (and proxies) anew
    monkeypatch.setattr(ingest, "DOWNLOAD_TIMEOUT_S", 5.0)  # keep it short if the network hangs
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # musdb's default download root is ~/MUSDB18
    cfg = make_cfg(tmp_path, source="musdb-sample")
    before = set(Path(tempfile.gettempdir()).glob("tiersep-musdb-sample-*"))
    with pytest.raises(DataError, match=r"musdb-sample: could not download the MUSDB18 7-second preview from "
                                        r"https://\S+ \(URLError: .*[Cc]onnection refused.*\); it needs internet "
                                        r"access\. Offline, use "
                                        r"data.source: synthetic .* MUSDB18-HQ"):
        prepare(cfg, Path(cfg["data"]["prepared_dir"]) / "musdb-sample" / "8000", 8000, progress=False)
    assert not (tmp_path / "data").exists()
    assert not (tmp_path / "home").exists()
    assert set(Path(tempfile.gettempdir()).glob("tiersep-musdb-sample-*")) == before
    assert os.listdir(tmp_path) == []


def test_prepared_folder_outlives_its_source(layout, capsys):
    """A folder prepared from a local MUSDB18-HQ stays usable when that root is moved away; a
    changed root (a file added) is prepared again."""
    root, train, _test, cfg = layout
    prepare(cfg, out_of(cfg), 8000, progress=False)
    shutil.move(str(root), str(root.parent / "moved"))
    prepare(cfg, out_of(cfg), 8000, progress=False)
    assert "nothing to do" in capsys.readouterr().out
    shutil.move(str(root.parent / "moved"), str(root))
    extra = root / "train" / "Zz Extra - Copy"
    shutil.copytree(root / "train" / train[0], extra)
    manifest = prepare(cfg, out_of(cfg), 8000, progress=False)
    assert "rebuilding (prepared for other settings (fingerprint changed))" in capsys.readouterr().out
    assert extra.name in manifest["splits"]["train"]


def test_fingerprint_and_checks_survive_broken_links(tmp_path):
    """Dangling and looping symlinks (a .stem.mp4, a track folder) are recorded, not followed: no
    FileNotFoundError or ELOOP; the track check names the file and why."""
    train = tmp_path / "musdb" / "train"
    train.mkdir(parents=True)
    (train / "A - Loop.stem.mp4").symlink_to("A - Loop.stem.mp4")
    (train / "B - Gone.stem.mp4").symlink_to(tmp_path / "gone.stem.mp4")
    (train / "C - Loop Folder").symlink_to("C - Loop Folder")
    root = train.parent
    before = {is_wav: ingest.root_fingerprint(root, is_wav) for is_wav in (True, False)}
    assert [name for name, _ in ingest.candidates(root, "train", False)] == ["A - Loop", "B - Gone"]
    with pytest.raises(ingest.TrackProblem, match=r"track 'A - Loop': \S*A - Loop\.stem\.mp4 is a symlink loop"):
        ingest.check_stem_track("A - Loop", train / "A - Loop.stem.mp4", None, "musdb18")
    with pytest.raises(ingest.TrackProblem, match=r"B - Gone\.stem\.mp4 is a broken symlink \(to \S*gone\.stem\.mp4: "
                                                  r"No such file or directory\)"):
        ingest.check_stem_track("B - Gone", train / "B - Gone.stem.mp4", None, "musdb18")
    (tmp_path / "gone.stem.mp4").write_bytes(b"\0" * 10)  # the link works again: another root
    assert ingest.root_fingerprint(root, False) != before[False]
    assert ingest.root_fingerprint(root, True) == before[True]  # no track folders either way
