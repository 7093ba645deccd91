"""The synthetic MUSDB18-HQ generator: real layout, parsed by the real musdb, exact mixtures,
deterministic, musically structured stems."""
from __future__ import annotations

from pathlib import Path

import musdb
import museval
import numpy as np
import pytest
import soundfile as sf
import yaml
from museval.metrics import Framing, _any_source_silent

from data_helpers import TINY, make_cfg
from tiersep.data import synthetic
from tiersep.data.errors import DataError
from tiersep.data.prepare import resample

STEMS = ("drums", "bass", "other", "vocals")
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    cfg = make_cfg(tmp_path_factory.mktemp("synth"))
    root, info = synthetic.ensure_synthetic(cfg, progress=False)
    return cfg, root, info


def test_output_parses_with_musdb_wav_layout(generated):
    _cfg, root, info = generated
    db = musdb.DB(root=str(root), is_wav=True)
    assert len(db) == TINY["train_tracks"] + TINY["test_tracks"]
    assert sorted(t.name for t in db) == sorted(t["name"] for t in info["tracks"])
    assert [t.subset for t in musdb.DB(root=str(root), is_wav=True, subsets="test")] == ["test"]
    for track in db:
        assert " - " in track.name and track.artist and track.title
        assert track.rate == TINY["sample_rate"]
        assert track.samples == int(TINY["track_seconds"] * TINY["sample_rate"])
        assert set(track.sources) == set(STEMS)
    # musdb decodes through ffmpeg to 16-bit: its reading matches the float file to 16-bit precision
    track = db.tracks[0]
    ours = sf.read(str(root / track.subset / track.name / "vocals.wav"), dtype="float32")[0]
    assert track.sources["vocals"].audio.shape == ours.shape == (track.samples, 2)
    np.testing.assert_allclose(track.sources["vocals"].audio, ours, atol=2 / 32768)


def test_mixture_is_exactly_the_sum_of_the_stems(generated):
    _cfg, root, info = generated
    for entry in info["tracks"]:
        folder = root / entry["subset"] / entry["name"]
        stems = {s: sf.read(str(folder / f"{s}.wav"), dtype="float32")[0] for s in STEMS}
        mixture, _ = sf.read(str(folder / "mixture.wav"), dtype="float32")
        assert sf.info(str(folder / "mixture.wav")).subtype == "FLOAT"
        assert np.array_equal(mixture, ((stems["drums"] + stems["bass"]) + stems["other"]) + stems["vocals"])
        assert np.abs(mixture).max() <= 0.9


def test_valid_tracks_are_the_last_train_tracks(generated):
    _cfg, _root, info = generated
    train = [t["name"] for t in info["tracks"] if t["subset"] == "train"]
    assert info["valid_tracks"] == train[-TINY["valid_tracks"]:]


def test_deterministic_and_seed_dependent(tmp_path, generated):
    cfg, root, info = generated
    again = synthetic.generate(tmp_path / "again", synthetic.generator_settings(cfg), progress=False)
    assert [t["name"] for t in again["tracks"]] == [t["name"] for t in info["tracks"]]
    for entry in info["tracks"]:
        for stem in ("mixture", *STEMS):
            rel = f"{entry['subset']}/{entry['name']}/{stem}.wav"
            assert np.array_equal(_audio(root / rel), _audio(tmp_path / "again" / rel)), rel
    other = synthetic.generate(tmp_path / "other", {**synthetic.generator_settings(cfg), "seed": 4}, progress=False)
    first, ours = other["tracks"][0], info["tracks"][0]
    theirs = _audio(tmp_path / "other" / first["subset"] / first["name"] / "mixture.wav")
    assert not np.array_equal(theirs, _audio(root / ours["subset"] / ours["name"] / "mixture.wav"))


def test_cached_folder_is_reused(generated):
    cfg, root, _info = generated
    marker = root / synthetic.MARKER
    before = marker.stat().st_mtime_ns
    again_root, _ = synthetic.ensure_synthetic(cfg, progress=False)
    assert again_root == root and marker.stat().st_mtime_ns == before
    assert root.parent == synthetic.raw_root(cfg) and root.name.startswith("synthetic-")


def test_tracks_differ_in_tempo_key_and_gains(generated):
    _cfg, _root, info = generated
    assert len({t["bpm"] for t in info["tracks"]}) == len(info["tracks"])
    assert len({(t["key"], t["mode"]) for t in info["tracks"]}) > 1


def test_stems_are_musically_distinct():
    """Bass sits low, drums are noise-like and broadband, the voice is pitched in a singing range
    and has silences (rests between phrases)."""
    sr = 16000
    rng = np.random.default_rng(np.random.SeedSequence([5, 0]))
    stems, params = synthetic.synth_track(rng, sr, 8 * sr)
    spectra = {k: np.abs(np.fft.rfft(v.mean(axis=1))) ** 2 for k, v in stems.items()}
    freqs = np.fft.rfftfreq(8 * sr, 1 / sr)

    def share_below(stem, hz):
        return spectra[stem][freqs < hz].sum() / spectra[stem].sum()

    assert share_below("bass", 400) > 0.9
    assert share_below("drums", 400) < 0.8 and share_below("drums", 2000) < 0.95  # broadband
    assert 0.1 < share_below("vocals", 400) < 0.95
    flatness = {k: _spectral_flatness(v[:, 0]) for k, v in stems.items()}
    assert flatness["drums"] > 0.02  # noise-like hits...
    assert max(flatness["bass"], flatness["other"], flatness["vocals"]) < 0.005  # ...the rest harmonic
    vocal_frames = stems["vocals"][: 8 * sr // 400 * 400, 0].reshape(-1, 400)
    assert (np.abs(vocal_frames).max(axis=1) < 1e-6).mean() > 0.03  # some silence: breaths
    for stem in STEMS:
        assert np.sqrt((stems[stem] ** 2).mean()) > 1e-3, stem
        assert stems[stem].dtype == np.float32 and stems[stem].shape == (8 * sr, 2)
    assert set(params["sections"]) <= {"verse", "chorus"} and set(params["rests_s"]) == {"drums", "bass"}
    assert all(length <= synthetic.MAX_REST_S for rests in params["rests_s"].values() for _, length in rests)


def test_silences_are_short_and_stems_play_throughout():
    """Every stem plays through the track: no silence (museval's sense: channel sum exactly 0)
    reaches a 1 s frame, and almost every 1 s frame holds the stem within 30 dB of its level (a
    nearly silent reference frame would make a degenerate score, even though museval keeps it);
    but there are silences (drum stops, bass rests, vocal breaths)."""
    sr = 8000
    longest = dict.fromkeys(STEMS, 0.0)
    for index in range(12):
        stems, _params = synthetic.synth_entry({"seed": 1, "sample_rate": sr, "track_seconds": 12.0},
                                               {"index": index})
        for stem, audio in stems.items():
            longest[stem] = max(longest[stem], _longest_silence(audio) / sr)
            frames = audio[: len(audio) // sr * sr].reshape(-1, sr, 2).astype(np.float64)
            level_db = 10 * np.log10((frames ** 2).mean(axis=(1, 2)) / (audio.astype(np.float64) ** 2).mean())
            assert (level_db > -30).mean() >= 0.9, (index, stem, np.round(level_db, 1))
    assert max(longest.values()) < 0.9, longest
    assert longest["drums"] > 0.2 and longest["vocals"] > 0.2 and longest["bass"] > 0.1, longest


def _longest_silence(audio):
    """Longest run of samples whose channel sum is exactly 0 (museval's silence), in samples."""
    edges = np.diff(np.concatenate([[0], (audio.sum(axis=1) == 0).astype(np.int8), [0]]))
    starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
    return int((ends - starts).max()) if len(starts) else 0


# ----------------------------------------------------------------------------- museval frames
def museval_valid_frames(references: np.ndarray, rate: int) -> np.ndarray:
    """Which 1 s frames museval scores, by museval's own code: BSSEval v4 frames come from
    museval.metrics.Framing (window = hop = 1 s, as `tiersep evaluate` and SiSEC use), and bss_eval
    skips a frame when museval.metrics._any_source_silent holds for the references or the
    estimates. The mixture stands in as every stem's estimate. references: [4, S, 2] (museval's
    layout) -> bool [frames]."""
    estimates = np.broadcast_to(references.sum(axis=0), references.shape)
    return np.array([not _any_source_silent(references[:, w]) and not _any_source_silent(estimates[:, w])
                     for w in Framing(rate, rate, references.shape[1])])


def default_run_settings(tmp_path) -> dict:
    """The generator settings of the default run: config/config.yaml's data.synthetic."""
    data = yaml.safe_load((REPO / "config" / "config.yaml").read_text())["data"]
    return synthetic.generator_settings(make_cfg(tmp_path, synthetic=data["synthetic"]))


def test_default_test_set_is_scored_by_museval(tmp_path):
    """At least 90% of the 1 s frames of every default test track are valid for museval (all four
    stems sounding), at the generator's rate and at each CPU tier's rate (resampled as prepare
    does); and there are at least 5 test tracks, so that one cannot decide the median."""
    settings = default_run_settings(tmp_path)
    assert settings["test_tracks"] >= 5
    tier_rates = sorted({yaml.safe_load(p.read_text())["audio"]["sample_rate"]
                         for p in (REPO / "config" / "presets").glob("cpu_*.yaml")})
    assert tier_rates == [8000]  # the rate this test is about; extend it if a CPU tier changes
    counts = {}
    for entry in [t for t in synthetic.plan_tracks(settings) if t["subset"] == "test"]:
        stems, _params = synthetic.synth_entry(settings, entry)
        references = np.stack([stems[s] for s in STEMS])  # [4, S, 2]
        for rate in (settings["sample_rate"], *tier_rates):
            at_rate = references if rate == settings["sample_rate"] else \
                np.moveaxis(resample(np.moveaxis(references, 1, 2), settings["sample_rate"], rate), 2, 1)
            valid = museval_valid_frames(at_rate, rate)
            counts[entry["name"], rate] = f"{valid.sum()}/{len(valid)}"
            assert len(valid) == int(settings["track_seconds"]) and valid.mean() >= 0.9, counts
    assert len(counts) == settings["test_tracks"] * (1 + len(tier_rates))


def test_frame_rule_is_what_museval_evaluate_does():
    """museval_valid_frames agrees with museval.evaluate itself: a stem silenced over a whole 1 s
    frame makes that frame NaN for every stem; the others are scored. (museval runs on each stem's
    channel sum, which its silence test looks at anyway: a mono solve is 6x cheaper than stereo.)"""
    rate = 8000
    stems, _params = synthetic.synth_entry({"seed": 2, "sample_rate": rate, "track_seconds": 4.0}, {"index": 0})
    references = np.stack([stems[s] for s in STEMS])
    references[3, int(0.8 * rate): int(2.3 * rate)] = 0  # vocals silent over all of frame 1 (1 s .. 2 s)
    valid = museval_valid_frames(references, rate)
    assert valid.tolist() == [True, False, True, True]
    mono = references.sum(axis=2, keepdims=True)  # [4, S, 1]
    estimates = np.broadcast_to(mono.sum(axis=0), mono.shape)
    sdr, _isr, _sir, _sar = museval.evaluate(mono, estimates, win=rate, hop=rate, mode="v4")
    assert sdr.shape == (4, 4)
    np.testing.assert_array_equal(~np.isnan(sdr), np.broadcast_to(valid, sdr.shape))


def _audio(path):
    # not the file bytes: libsndfile stamps float WAVs with the time of writing (PEAK chunk)
    return sf.read(str(path), dtype="float32")[0]


def _spectral_flatness(x, frame=512):
    """Median over sounding frames of geometric / arithmetic mean power (1 = white noise, 0 = tones)."""
    frames = x[: len(x) // frame * frame].reshape(-1, frame) * np.hanning(frame)
    power = np.abs(np.fft.rfft(frames, axis=1))[:, 3:200] ** 2 + 1e-12
    sounding = power.sum(axis=1) > 1e-6 * power.sum(axis=1).max()
    power = power[sounding]
    return float(np.median(np.exp(np.log(power).mean(axis=1)) / power.mean(axis=1)))


def test_publish_never_replaces_a_complete_folder(tmp_path):
    """Two jobs generating the same set at once: the second keeps the first's folder (which the
    first may be reading) instead of deleting it; a stale folder of the generator's (its marker,
    other settings) is replaced; a folder without the marker is a user's and is refused, untouched."""
    final, staging = tmp_path / "final", tmp_path / "staging"
    for folder, text in ((final, "first"), (staging, "second")):
        folder.mkdir()
        (folder / "marker").write_text(text)
    synthetic.publish_dir(staging, final, lambda p: (p / "marker").is_file())
    assert (final / "marker").read_text() == "first"
    (final / "marker").unlink()
    (final / "partial").write_text("")
    with pytest.raises(DataError, match=r"final: holds files tiersep did not make \('partial'; no "
                                        r"tiersep_synthetic.json\); tiersep never removes them"):
        synthetic.publish_dir(staging, final, lambda p: (p / "marker").is_file())
    assert sorted(p.name for p in final.iterdir()) == ["partial"] and (staging / "marker").is_file()
    (final / synthetic.MARKER).write_text('{"settings": {"seed": -1}}')
    synthetic.publish_dir(staging, final, lambda p: (p / "marker").is_file())
    assert (final / "marker").read_text() == "second" and not staging.exists()
