"""run.evaluate end to end on a tiny prepared folder, checked against the real museval."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import simplejson
import soundfile as sf
import torch

from tiersep import config as C
from tiersep.config import ConfigError
from tiersep.evaluate import metrics
from tiersep.evaluate.run import evaluate, evaluate_model
from tiersep.evaluate.schema import SCORES_SCHEMA, validate_scores
from tiersep.io import torch_save

museval = pytest.importorskip("museval")

RATE = 8000
STEMS = ("vocals", "drums", "bass", "other")
# museval solves (n_src * channels * 512)^2 systems whatever the rate: 2 evaluated stems, and mono
# where stereo is not the point, keep the tests in seconds.
SOURCES = ["vocals", "bass"]


def write_prepared(root: Path, tracks: dict[str, np.ndarray]) -> Path:
    """The prepared layout of tiersep.data: manifest.json + test/<track>/<stem>.wav (float32)."""
    entries = []
    for name, stems in tracks.items():                      # stems [4, C, S] in STEMS order
        folder = root / "test" / name
        folder.mkdir(parents=True)
        for stem, audio in zip(STEMS, stems):
            sf.write(folder / f"{stem}.wav", audio.T, RATE, subtype="FLOAT")
        sf.write(folder / "mixture.wav", stems.sum(0).T, RATE, subtype="FLOAT")
        entries.append({"name": name, "split": "test", "samples": stems.shape[-1]})
    channels = next(iter(tracks.values())).shape[1]
    manifest = {"format": 1, "sample_rate": RATE, "channels": channels, "stems": list(STEMS),
                "splits": {"train": [], "valid": [], "test": list(tracks)}, "tracks": entries}
    (root / "manifest.json").write_text(json.dumps(manifest))
    return root


def synthetic_stems(seed: int, seconds: float, channels: int = 1) -> np.ndarray:
    """[4, C, S]: a tone, noise bursts, a low tone, filtered noise; distinct and non-silent."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * RATE)) / RATE
    vocals = np.sin(2 * np.pi * (300 + 50 * seed) * t) * (0.5 + 0.5 * np.sin(2 * np.pi * 0.7 * t))
    drums = rng.standard_normal(t.size) * (np.sin(2 * np.pi * 2 * t) > 0.3)
    bass = np.sin(2 * np.pi * 70 * t + seed)
    other = np.convolve(rng.standard_normal(t.size), np.ones(8) / 8, mode="same")
    mono = np.stack([vocals, drums, bass, other]) * 0.2
    right = 0.8 * mono + 0.01 * rng.standard_normal(mono.shape)
    return np.stack([mono, right][:channels], axis=1).astype(np.float32)


class MixtureShare(torch.nn.Module):
    """Every stem = mixture / n_src: SI-SDR equals the mixture baseline's (scale invariance)."""

    def __init__(self, n_src):
        super().__init__()
        self.n_src = n_src
        self.unused = torch.nn.Parameter(torch.zeros(1))

    def forward(self, x):  # [B, C, S] -> [B, n, C, S]
        return (x / self.n_src)[:, None].expand(-1, self.n_src, -1, -1).contiguous()


def make_cfg(**evaluate):
    settings = {"chunk_seconds": 1.0, "overlap": 0.25, "workers": 1, **evaluate}
    return C.validate({"evaluate": settings}, "config.schema.yaml", "test config")


def make_preset(sources=SOURCES, channels=1):
    preset = C.load_preset("cpu_tiny")
    preset["model"]["sources"] = list(sources)
    preset["audio"]["channels"] = channels
    return preset


@pytest.fixture(autouse=True)
def _one_thread(single_thread):
    """Every test here on one torch thread (see conftest.one_torch_thread)."""


@pytest.fixture
def prepared(tmp_path):
    tracks = {"Alpha - One": synthetic_stems(1, 3.3), "Beta - Two": synthetic_stems(2, 2.6),
              "Gamma - Three": synthetic_stems(3, 4.1)}
    tracks["Beta - Two"][0, :, RATE:2 * RATE] = 0          # vocals silent for a second: NaN frames
    return write_prepared(tmp_path / "prepared", tracks)


def read_museval(path: Path, name: str):
    return museval.aggregate.json2df(simplejson.loads(path.read_text(), allow_nan=True), name)


def test_scores_match_museval_and_baseline_for_a_scaled_mixture(prepared, tmp_path):
    from tiersep.data.tracks import read_track

    out = tmp_path / "eval"
    scores = evaluate_model(make_cfg(), make_preset(), MixtureShare(2), prepared, out)
    on_disk = json.loads((out / "scores.json").read_text())
    assert on_disk == scores
    validate_scores(on_disk)
    assert on_disk["tracks"] == 3 and on_disk["sources"] == SOURCES and on_disk["skipped"] == {}

    evals = museval.EvalStore()
    for name in ("Alpha - One", "Beta - Two", "Gamma - Three"):
        mixture, refs = read_track(prepared, "test", name, SOURCES)
        # museval's own scores of the same estimates, and of the mixture as the estimate
        sdr, isr, sir, sar = museval.evaluate(np.moveaxis(refs, 1, 2), np.moveaxis(np.stack([mixture / 2] * 2), 1, 2),
                                              win=RATE, hop=RATE)
        sdr_mix = museval.evaluate(np.moveaxis(refs, 1, 2), np.moveaxis(np.stack([mixture] * 2), 1, 2),
                                   win=RATE, hop=RATE)[0]
        track_df = read_museval(out / "museval" / f"{name}.json", name)
        evals.add_track(track_df)
        stored = track_df[track_df.metric == "SDR"].pivot(index="time", columns="target", values="score")
        for i, stem in enumerate(SOURCES):
            np.testing.assert_allclose(stored[stem].to_numpy(), metrics.museval_quantize(sdr[i]), equal_nan=True)
            got = on_disk["per_track"][name][stem]
            assert got["sdr"] == pytest.approx(float(metrics.track_median(sdr[i])), abs=1e-12)
            assert got["sar"] == pytest.approx(float(metrics.track_median(sar[i])), abs=1e-12)
            assert got["sdr_mixture"] == pytest.approx(float(metrics.track_median(sdr_mix[i])), abs=1.1e-5)
            # scale invariance: mixture / 2 scores exactly the mixture's SI-SDR
            assert got["si_sdr"] == pytest.approx(got["si_sdr_mixture"], abs=1e-6)  # float32 estimates
            assert got["si_sdr"] == pytest.approx(metrics.si_sdr(mixture, refs[i]), abs=1e-6)
        if name == "Beta - Two":
            assert np.isnan(sdr[:, 1]).all()        # the silent vocal second is a NaN frame
    # per stem: museval's own median of medians
    theirs = evals.agg_frames_tracks_scores()
    for stem in SOURCES:
        for metric in ("sdr", "sir", "isr", "sar"):
            assert on_disk["per_stem"][stem][metric] == pytest.approx(theirs[(stem, metric.upper())], abs=1e-12)
        assert on_disk["per_stem"][stem]["si_sdr_improvement"] == pytest.approx(0, abs=1e-6)
        assert on_disk["per_stem"][stem]["sdr_improvement"] == pytest.approx(
            on_disk["per_stem"][stem]["sdr"] - on_disk["per_stem"][stem]["sdr_mixture"])
    assert on_disk["overall"]["sdr"] == pytest.approx(np.mean([on_disk["per_stem"][s]["sdr"] for s in SOURCES]))
    assert not (out / "estimates").exists()


def test_parallel_scoring_and_saved_estimates_match_serial(prepared, tmp_path):
    serial = evaluate_model(make_cfg(max_tracks=2), make_preset(), MixtureShare(2), prepared, tmp_path / "serial")
    parallel = evaluate_model(make_cfg(workers=2, save_estimates=True, max_tracks=2), make_preset(),
                              MixtureShare(2), prepared, tmp_path / "parallel")
    assert parallel["workers"] == 2 and parallel["tracks"] == 2
    assert list(parallel["per_track"]) == ["Alpha - One", "Beta - Two"]
    for name in parallel["per_track"]:
        assert parallel["per_track"][name] == serial["per_track"][name]
        for stem in SOURCES:
            audio, rate = sf.read(tmp_path / "parallel" / "estimates" / name / f"{stem}.wav", dtype="float32",
                                  always_2d=True)
            mixture = sf.read(prepared / "test" / name / "mixture.wav", dtype="float32", always_2d=True)[0]
            assert rate == RATE and audio.shape == mixture.shape
            np.testing.assert_allclose(audio, mixture / 2, atol=1e-6)
    assert sorted(p.name for p in (tmp_path / "parallel" / "museval").iterdir()) == \
        ["Alpha - One.json", "Beta - Two.json"]


def test_a_wholly_silent_stem_is_refused_by_museval_and_recorded_not_fatal(tmp_path):
    tracks = {"Loud": synthetic_stems(4, 2.2), "No Bass": synthetic_stems(5, 2.2)}
    tracks["No Bass"][2] = 0
    prepared = write_prepared(tmp_path / "prepared", tracks)
    scores = evaluate_model(make_cfg(), make_preset(), MixtureShare(2), prepared, tmp_path / "eval")
    assert "museval refused" in scores["skipped"]["No Bass"]
    refused = scores["per_track"]["No Bass"]
    assert all(refused[s][m] is None for s in SOURCES for m in ("sdr", "sir", "isr", "sar"))
    assert refused["bass"]["si_sdr"] is None and refused["bass"]["sdr_mixture"] is None
    assert refused["vocals"]["si_sdr"] is not None          # SI-SDR is per stem: vocals still scored
    # medians over tracks skip the refused track, as museval's aggregation skips NaN
    assert scores["per_stem"]["bass"]["sdr"] == scores["per_track"]["Loud"]["bass"]["sdr"]
    assert not (tmp_path / "eval" / "museval" / "No Bass.json").exists()


def test_evaluate_loads_model_pt_of_a_real_tflocoformer(prepared, tmp_path):
    from tiersep.model import build_model

    preset = make_preset()
    torch.manual_seed(0)
    model = build_model(preset)
    torch_save({"model": model.state_dict(), "preset": preset, "step": 7}, tmp_path / "model.pt")
    scores = evaluate(make_cfg(max_tracks=1), preset, tmp_path / "model.pt", prepared, tmp_path / "eval")
    assert scores["step"] == 7 and scores["tracks"] == 1 and scores["device"] == "cpu"
    assert scores["model"] == str(tmp_path / "model.pt")
    for stem in SOURCES:
        assert isinstance(scores["per_stem"][stem]["si_sdr"], float)
        assert isinstance(scores["per_stem"][stem]["sdr"], float)
    assert (tmp_path / "eval" / "museval" / "Alpha - One.json").is_file()

    other = make_preset()
    other["model"]["emb_dim"] = 32
    with pytest.raises(ConfigError, match="model.emb_dim"):
        evaluate(make_cfg(), other, tmp_path / "model.pt", prepared, tmp_path / "eval2")
    other = make_preset()
    other["audio"]["sample_rate"] = 16000
    with pytest.raises(ConfigError, match="sample_rate"):
        evaluate_model(make_cfg(), other, MixtureShare(2), prepared, tmp_path / "eval3")


def test_scores_schema_rejects_broken_records(prepared, tmp_path):
    scores = evaluate_model(make_cfg(max_tracks=1), make_preset(), MixtureShare(2), prepared, tmp_path / "eval")
    assert SCORES_SCHEMA["required"] == ["preset", "sources", "sample_rate", "tracks", "overall", "per_stem",
                                         "per_track", "protocol", "seconds"]
    broken = json.loads(json.dumps(scores))
    del broken["overall"]["si_sdr_improvement"]
    with pytest.raises(ValueError, match="overall"):
        validate_scores(broken)
    broken = json.loads(json.dumps(scores))
    broken["per_track"]["Alpha - One"]["bass"]["sdr"] = "7 dB"
    with pytest.raises(ValueError, match="per_track/Alpha - One/bass/sdr"):
        validate_scores(broken)
    broken = json.loads(json.dumps(scores))
    broken["tracks"] = 2
    with pytest.raises(ValueError, match="per_track entries"):
        validate_scores(broken)


def test_automatic_workers_follow_cores_tracks_and_memory(monkeypatch):
    from tiersep.evaluate import scoring

    monkeypatch.setattr(scoring, "available_cores", lambda: 8)
    gib = 2**30
    assert scoring.resolve_workers(0, tracks=50) == 8                      # one per core
    assert scoring.resolve_workers(0, tracks=3) == 3                       # no idle workers
    assert scoring.resolve_workers(0, 50, peak_bytes=4 * gib, available_bytes=16 * gib) == 3  # 80% of 16 GiB
    assert scoring.resolve_workers(0, 50, peak_bytes=40 * gib, available_bytes=16 * gib) == 1
    assert scoring.resolve_workers(5, 50, peak_bytes=40 * gib, available_bytes=16 * gib) == 5  # as configured
    # a full-length MUSDB track (4 min, 44.1 kHz, 4 stereo stems) needs GBs per museval worker
    four_minutes = scoring.museval_peak_bytes(4, 2, 240 * 44100)
    assert 2 * gib < four_minutes < 8 * gib
    assert scoring.museval_peak_bytes(4, 2, 12 * 44100) < four_minutes
