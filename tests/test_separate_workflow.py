"""The Snakemake `separate` target: two songs, one tier, each tier's job its own process."""
from __future__ import annotations

import json

import numpy as np
import pytest
import soundfile as sf
import yaml

from conftest import copy_workflow, run_snakemake

STEMS = ["vocals", "drums", "bass", "other"]


@pytest.mark.slow
def test_the_separate_target_separates_every_song_with_every_trained_tier(tmp_path):
    work = copy_workflow(tmp_path / "wf")
    songs = tmp_path / "my music"
    (songs / "album").mkdir(parents=True)
    rng = np.random.default_rng(0)
    sf.write(songs / "album" / "first song.wav", 0.1 * rng.standard_normal((44100 * 2, 2)), 44100)
    sf.write(songs / "second.flac", 0.1 * rng.standard_normal((22050 * 3, 1)), 22050)
    (work / "separate.yaml").write_text(yaml.safe_dump(
        {"separate": {"inputs": [str(songs)], "tiers": ["test_tiny"], "chunk_seconds": 1.0, "device": "cpu"}}))
    configs = ["--configfile", "tests/configs/tiny.yaml", "separate.yaml"]

    plan = run_snakemake(work, "-n", *configs).stdout          # the default target is unchanged
    assert "separate_tier" not in plan
    run_snakemake(work, "--cores", "1", "separate", *configs)
    folder = work / "results" / "separated" / "test_tiny"
    for song, rate, channels in (("first song", 44100, 2), ("second", 22050, 1)):
        for stem in STEMS:
            info = sf.info(str(folder / song / f"{stem}.wav"))
            assert (info.samplerate, info.channels) == (rate, channels)
        record = json.loads((folder / song / "separate.json").read_text())
        assert record["tier"] == "test_tiny" and record["chunk_samples"] == 8000
    assert "tiersep separate: test_tiny on cpu" in (work / "logs" / "separate" / "test_tiny.log").read_text()
    again = run_snakemake(work, "--cores", "1", "separate", *configs).stdout
    assert "Nothing to be done" in again
