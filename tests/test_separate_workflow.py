"""The Snakemake `separate` target: two songs, one tier, each tier's job its own process."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest
import soundfile as sf
import yaml

from conftest import FINISHED_CONFIG, copy_finished, run_snakemake

STEMS = ["vocals", "drums", "bass", "other"]


@pytest.mark.slow
def test_the_separate_target_separates_every_song_with_every_trained_tier(finished_tree, tmp_path):
    # A copy of the session's finished tiny run (conftest.finished_tree, shared with
    # tests/test_pipeline_e2e.py), run on its own configs plus a `separate` section: what it trained
    # stands, and the first run adds only the separations (the `separate` section changes no other
    # job's inputs or params).
    work = copy_finished(finished_tree, tmp_path / "wf")
    songs = tmp_path / "my music"
    (songs / "album").mkdir(parents=True)
    rng = np.random.default_rng(0)
    sf.write(songs / "album" / "first song.wav", 0.1 * rng.standard_normal((44100 * 2, 2)), 44100)
    sf.write(songs / "second.flac", 0.1 * rng.standard_normal((22050 * 3, 1)), 22050)
    (work / "separate.yaml").write_text(yaml.safe_dump(
        {"separate": {"inputs": [str(songs)], "tiers": ["test_tiny"], "chunk_seconds": 1.0, "device": "cpu"}}))
    configs = [*FINISHED_CONFIG, "separate.yaml"]

    plan = run_snakemake(work, "-n", *configs).stdout          # the default target is unchanged
    assert "separate_tier" not in plan
    first = run_snakemake(work, "--cores", "1", "separate", *configs).stdout
    ran = sorted(set(re.findall(r"^(?:local)?(?:rule|checkpoint) (\w+):", first, re.M)))
    assert ran == ["separate", "separate_tier"], ran   # nothing estimated or trained again
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

    # Issue 32: a config change (a budget and a new song) reruns, in ONE run, every job it affects,
    # and `snakemake -n` shows them first. It used to run only the `config` job, say "done", and
    # leave the estimates, the report and the separations stale until a second run.
    sf.write(tmp_path / "third.wav", 0.1 * rng.standard_normal((16000, 2)), 16000)
    (work / "changed.yaml").write_text(yaml.safe_dump(
        {"budget_gib": 30, "separate": {"inputs": [str(songs), str(tmp_path / "third.wav")], "tiers": ["test_tiny"],
                                        "chunk_seconds": 1.0, "device": "cpu"}}))
    changed = [*FINISHED_CONFIG, "changed.yaml"]
    plan = run_snakemake(work, "-n", "all", "separate", *changed).stdout
    # the jobs below the train checkpoint (separate_tier, report) join the plan once it has run
    assert "rule estimate:" in plan and "checkpoint train:" in plan and "rule config:" not in plan, plan[-3000:]
    run_snakemake(work, "--cores", "1", "all", "separate", *changed)
    assert yaml.safe_load((work / "results" / "config.yaml").read_text())["budget_gib"] == 30
    # large is estimated for a GPU, so it is judged against budget_gib (test_tiny, on CPU, against RAM)
    assert json.loads((work / "results" / "vram" / "large.json").read_text())["budget_bytes"] == 30 * 2**30
    assert "30 GiB" in (work / "results" / "report" / "report.md").read_text()
    for song in ("first song", "second", "third"):
        assert (folder / song / "separate.json").is_file(), song
    assert "Nothing to be done" in run_snakemake(work, "--cores", "1", "all", "separate", *changed).stdout
