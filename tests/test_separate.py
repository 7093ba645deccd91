"""`tiersep separate` end to end: real songs from the synthetic generator converted by the real
ffmpeg, a real tier trained for a few steps, the real CLI in its own process."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from tiersep.data import synthetic

from test_train_support import TINY_PRESET, cli_train, make_workspace

REPO = Path(__file__).resolve().parents[1]
TIERSEP = str(Path(sys.executable).parent / "tiersep")
STEMS = ["vocals", "drums", "bass", "other"]
# (file name, ffmpeg output options): every container and codec, 22.05 / 44.1 / 48 / 96 kHz, mono and stereo
CONVERSIONS = [
    ("mono 22k.mp3", ["-ar", "22050", "-ac", "1", "-c:a", "libmp3lame", "-b:a", "128k"]),
    ("stereo 44k.flac", ["-ar", "44100", "-ac", "2"]),
    ("stereo 48k.ogg", ["-ar", "48000", "-ac", "2", "-c:a", "libvorbis"]),
    ("stereo 44k aac.m4a", ["-ar", "44100", "-ac", "2", "-c:a", "aac"]),
    ("mono 48k aac.m4a", ["-ar", "48000", "-ac", "1", "-c:a", "aac"]),
    ("stereo 96k.wav", ["-ar", "96000", "-ac", "2"]),
    ("mono 22k wav.wav", ["-ar", "22050", "-ac", "1"]),
]


def ffmpeg(*args: str) -> None:
    subprocess.run(["ffmpeg", "-v", "error", "-nostdin", "-y", *args], check=True)


def decode(path: Path, stream: int = 0) -> np.ndarray:
    """What ffmpeg decodes from audio stream `stream`, float32 [C, S] (the reference of a test)."""
    channels = int(subprocess.run(["ffprobe", "-v", "error", "-select_streams", f"a:{stream}", "-show_entries",
                                   "stream=channels", "-of", "csv=p=0", str(path)],
                                  capture_output=True, text=True, check=True).stdout.split()[0])
    raw = subprocess.run(["ffmpeg", "-v", "error", "-nostdin", "-i", str(path), "-map", f"0:a:{stream}",
                          "-f", "f32le", "-"], capture_output=True, check=True).stdout
    return np.frombuffer(raw, dtype="<f4").reshape(-1, channels).T


def synthetic_song(seconds: float, rate: int = 44100, seed: int = 0) -> dict[str, np.ndarray]:
    """The generator's stems of one track [S, 2] and their mixture."""
    settings = {"seed": seed, "sample_rate": rate, "train_tracks": 1, "valid_tracks": 0, "test_tracks": 0,
                "track_seconds": seconds}
    stems, _ = synthetic.synth_entry(settings, {"index": 0})
    stems["mixture"] = sum(stems[s] for s in synthetic.STEMS).astype(np.float32)
    return stems


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    """A prepared tiny dataset and the tiny preset trained for 4 steps (model.pt)."""
    ws = make_workspace(tmp_path_factory.mktemp("separate") / "ws")
    out = ws["root"] / "train"
    proc = cli_train(ws, out, "--set", "train.steps=4", "--set", "train.checkpoint_every=2",
                     "--set", "train.validate_every=2")
    assert proc.wait(timeout=300) == 0, (Path(str(out) + ".log")).read_text()[-3000:]
    ws["model"] = out / "model.pt"
    return ws


@pytest.fixture(scope="module")
def songs(tmp_path_factory) -> Path:
    """A folder of songs in every format (3 s each), a MUSDB-style .stem.mp4 and a song shorter than
    one chunk, in subfolders (folders are searched recursively)."""
    root = tmp_path_factory.mktemp("songs")
    master = root / "master.wav"
    track = synthetic_song(3.0)
    sf.write(master, track["mixture"], 44100, subtype="FLOAT")
    folder = root / "in" / "nested"
    folder.mkdir(parents=True)
    for name, options in CONVERSIONS:
        ffmpeg("-i", str(master), *options, str(folder / name))
    # MUSDB's .stem.mp4: stream 0 is the mixture, then drums, bass, other, vocals
    parts = [root / f"{s}.wav" for s in ("mixture", *synthetic.STEMS)]
    for part, stem in zip(parts, ("mixture", *synthetic.STEMS)):
        sf.write(part, track[stem], 44100, subtype="FLOAT")
    inputs = [a for p in parts for a in ("-i", str(p))]
    maps = [a for i in range(len(parts)) for a in ("-map", f"{i}:a")]
    ffmpeg(*inputs, *maps, "-c:a", "aac", "-b:a", "256k", str(root / "in" / "Artist - Title.stem.mp4"))
    sf.write(root / "in" / "short.wav", track["mixture"][:2400], 8000, subtype="PCM_16")   # 0.3 s
    return root / "in"


def run(ws: dict, *args: str, model: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    cmd = [TIERSEP, "separate", "--config", str(ws["config_file"]), "--model", str(model or ws["model"]),
           "--device", "cpu", *args]                  # the CPU, GPU or not: budgets here are host RAM
    return subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def last_line(proc) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return lines[-1] if lines else ""


def temporaries(folder: Path) -> list[Path]:
    return [p for p in folder.rglob(".*.tmp")] if folder.exists() else []


def sidecar(out: Path, song: str) -> dict:
    return json.loads((out / song / "separate.json").read_text())


# ------------------------------------------------------------------------------ separating
def test_every_format_rate_and_channel_count(ws, songs, tmp_path):
    out = tmp_path / "out"
    proc = run(ws, str(songs), "--out", str(out), "--chunk", "2", "--batch", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    inputs = sorted(p for p in songs.rglob("*") if p.is_file())
    assert f"separated {len(inputs)} song(s)" in proc.stdout
    for path in inputs:
        song = path.name.removesuffix(".stem.mp4") if path.name.endswith(".stem.mp4") else path.stem
        reference = decode(path)
        rate = sf.info(str(path)).samplerate if path.suffix in (".wav", ".flac", ".ogg") else \
            int(subprocess.run(["ffprobe", "-v", "error", "-select_streams", "a:0", "-show_entries",
                                "stream=sample_rate", "-of", "csv=p=0", str(path)],
                               capture_output=True, text=True).stdout.split()[0])
        for stem in STEMS:
            info = sf.info(str(out / song / f"{stem}.wav"))
            assert (info.samplerate, info.channels, info.frames, info.subtype) == \
                (rate, reference.shape[0], reference.shape[1], "PCM_16"), (song, stem)
        record = sidecar(out, song)
        assert record["chunk_samples"] == 16000 and record["batch"] in (1, 2)
        assert record["tier"] == TINY_PRESET["name"] and record["sample_rate"] == rate
        memory = record["memory"]
        assert 0 < memory["measured_peak_bytes"] <= memory["booked_bytes"] < memory["budget_bytes"]
        assert record["real_time_factor"] > 0 and record["settings"]["clip"] == "rescale"
    assert not temporaries(out)


def test_two_stems_add_up_to_the_mixture_at_the_songs_own_rate(ws, songs, tmp_path):
    out = tmp_path / "out"
    proc = run(ws, str(songs), "--out", str(out), "--stems", "vocals", "--bits", "32f", "--clip", "none",
               "--chunk", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    for path in sorted(p for p in songs.rglob("*") if p.is_file()):
        song = path.name.removesuffix(".stem.mp4") if path.name.endswith(".stem.mp4") else path.stem
        assert sorted(os.listdir(out / song)) == ["no_vocals.wav", "separate.json", "vocals.wav"]
        vocals, rate = sf.read(out / song / "vocals.wav", dtype="float32", always_2d=True)
        rest, _ = sf.read(out / song / "no_vocals.wav", dtype="float32", always_2d=True)
        mixture = decode(path)              # stream 0 of the .stem.mp4: its mixture
        assert vocals.T.shape == mixture.shape
        np.testing.assert_allclose(vocals.T + rest.T, mixture, atol=1e-5, rtol=0)
        assert np.abs(vocals).max() > 0


def test_separate_gives_the_si_sdr_evaluate_reports(ws, tmp_path):
    from tiersep import config as C
    from tiersep.data.tracks import read_track, track_names
    from tiersep.evaluate import metrics
    from tiersep.evaluate.run import evaluate

    cfg, data = ws["cfg"], ws["data"]
    preset = C.load_preset(TINY_PRESET["name"], cfg)
    scores = evaluate(cfg, preset, ws["model"], data, tmp_path / "eval")
    name = track_names(data, "test")[0]
    out = tmp_path / "out"
    proc = run(ws, str(data / "test" / name / "mixture.wav"), "--out", str(out), "--bits", "32f",
               "--clip", "none", "--chunk", str(cfg["evaluate"]["chunk_seconds"]), "--batch", "1",
               "--overlap", str(cfg["evaluate"]["overlap"]))
    assert proc.returncode == 0, proc.stderr[-3000:]
    _, references = read_track(data, "test", name, STEMS)
    for i, stem in enumerate(STEMS):
        estimate, _ = sf.read(out / "mixture" / f"{stem}.wav", dtype="float32", always_2d=True)
        ours = metrics.si_sdr(estimate.T, references[i])
        assert abs(ours - scores["per_track"][name][stem]["si_sdr"]) <= 1e-6, stem


def test_shifts_change_the_output_and_repeat_under_a_seed(ws, songs, tmp_path):
    song = str(songs / "nested" / "mono 22k wav.wav")
    outputs = {}
    for label, extra in (("plain", []), ("a", ["--shifts", "2", "--seed", "3"]), ("b", ["--shifts", "2", "--seed", "3"]),
                         ("c", ["--shifts", "2", "--seed", "4"])):
        proc = run(ws, song, "--out", str(tmp_path / label), "--chunk", "1", "--bits", "32f", "--clip", "none", *extra)
        assert proc.returncode == 0, proc.stderr[-3000:]
        outputs[label] = sf.read(tmp_path / label / "mono 22k wav" / "vocals.wav", dtype="float32")[0]
    assert np.array_equal(outputs["a"], outputs["b"])
    assert not np.allclose(outputs["a"], outputs["plain"], atol=1e-6)
    assert not np.allclose(outputs["a"], outputs["c"], atol=1e-6)
    assert sidecar(tmp_path / "a", "mono 22k wav")["settings"]["shifts"] == 2


def test_formats_and_clipping_are_reported(ws, tmp_path):
    """A song far beyond full scale (float wav): rescale keeps every stem under it with one gain,
    clamp clips, none keeps the values in float32; the sidecar reports what went beyond."""
    loud = tmp_path / "loud.wav"
    sf.write(loud, 8 * synthetic_song(2.0, 8000, seed=2)["mixture"], 8000, subtype="FLOAT")
    runs = {"rescale": ("flac", "24"), "clamp": ("mp3", "16"), "none": ("wav", "32f")}
    for clip, (fmt, bits) in runs.items():
        out = tmp_path / clip
        proc = run(ws, str(loud), "--out", str(out), "--clip", clip, "--format", fmt, "--bits", bits, "--chunk", "1")
        assert proc.returncode == 0, proc.stderr[-3000:]
        report = sidecar(out, "loud")["clipping"]
        peaks = {stem: s["peak"] for stem, s in report["stems"].items()}
        decoded = {stem: decode(out / "loud" / f"{stem}.{fmt}") for stem in STEMS}
        assert max(peaks.values()) > 1.0 and sum(s["clipped_samples"] for s in report["stems"].values()) > 0
        if clip == "rescale":
            assert report["gain"] == pytest.approx(1 / (1.01 * max(peaks.values())))
            assert max(np.abs(d).max() for d in decoded.values()) < 1.0
            assert "all stems scaled by" in proc.stderr
            assert sf.info(str(out / "loud" / "vocals.flac")).subtype == "PCM_24"
        elif clip == "none":
            assert max(np.abs(d).max() for d in decoded.values()) == pytest.approx(max(peaks.values()), rel=1e-6)
        else:
            assert abs(decoded["vocals"].shape[1] / 8000 - 2.0) < 0.1        # mp3 (encoder padding aside)
            assert "clamped to full scale" in proc.stderr


def test_a_tight_budget_gives_a_shorter_chunk_and_the_process_stays_under_it(ws, songs, tmp_path):
    from tiersep import config as C
    from tiersep.probe import measure_peak_rss
    from tiersep.memory import GateSettings
    from tiersep.separate.plan import SeparationRequest, estimate_for

    import torch

    preset = C.load_preset(TINY_PRESET["name"], ws["cfg"])
    common = (SeparationRequest(max_chunk=80000, min_chunk=8000, max_batch=1, overlap=0.25, shifts=1,
                                longest_samples=10**9, rate_ratio=44100 / 8000), GateSettings(0.08, "auto"))
    shortest = estimate_for(preset, torch.device("cpu"), 8000, 1, None, *common)["gate_required_bytes"]
    longest = estimate_for(preset, torch.device("cpu"), 80000, 1, None, *common)["gate_required_bytes"]
    budget_gib = (shortest + longest) / 2 / 0.92 / 2**30
    out = tmp_path / "out"
    cmd = [TIERSEP, "separate", "--config", str(ws["config_file"]), "--model", str(ws["model"]),
           str(songs / "nested" / "stereo 44k.flac"), "--out", str(out), "--budget", f"{budget_gib:.6f}", "--chunk", "10",
           "--device", "cpu"]
    with open(tmp_path / "log", "w+") as log:
        measured = measure_peak_rss(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=REPO, log=log, timeout=300)
        log.seek(0)
        text = log.read()
    assert measured["returncode"] == 0, text[-3000:]
    record = sidecar(out, "stereo 44k")
    assert 8000 <= record["chunk_samples"] < 80000
    # the longest chunk fits only with the CPU gate's tight malloc mode, which the process applied
    assert record["memory"]["malloc"]["mode"] == "tuned" and record["memory"]["malloc"]["applied"]
    assert measured["peak_rss_bytes"] < budget_gib * 2**30          # the whole process, exit included
    assert record["memory"]["measured_peak_bytes"] < record["memory"]["budget_bytes"]


def test_a_budget_below_the_shortest_chunk_is_refused_up_front(ws, songs, tmp_path):
    out = tmp_path / "out"
    proc = run(ws, str(songs), "--out", str(out), "--budget", "0.1")
    assert proc.returncode == 3
    assert re.search(r"error: preset train_test_tiny: the shortest chunk \(1 s, batch 1\) needs an estimated "
                     r"[\d.]+ GiB \(the process's peak RSS, trace on cpu\) \+ 8% margin, more than the budget of "
                     r"0\.10 GiB", last_line(proc))
    assert not out.exists()


# ------------------------------------------------------------------------------ bad input
class Payload:
    """What a tampered model.pt carries: unpickling it would run a command."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def tampered_model(source: Path, path: Path, marker: Path) -> Path:
    """A complete-looking model.pt whose weights would run code when loaded fully."""
    import torch

    state = torch.load(source, weights_only=True)
    state["model"] = Payload(marker)
    torch.save(state, path)
    return path


def bad_input(case: str, folder: Path) -> Path:
    """Make the bad input of `case` in `folder`; returns the path to give separate."""
    if case == "empty file":
        (folder / "empty.flac").write_bytes(b"")
        return folder / "empty.flac"
    if case == "text named .wav":
        (folder / "notes.wav").write_text("not audio\n" * 50)
        return folder / "notes.wav"
    if case == "folder without audio":
        (folder / "docs").mkdir()
        (folder / "docs" / "a.txt").write_text("x")
        return folder / "docs"
    if case == "8 channels":
        ffmpeg("-f", "lavfi", "-i", "anoisesrc=d=1:a=0.1", "-ac", "8", str(folder / "surround.wav"))
        return folder / "surround.wav"
    return folder / "nowhere.mp3"


# case: (exit code, the last stderr line after "tiersep separate: error: ")
BAD_INPUTS = {
    "empty file": (2, r"empty\.flac: the file is empty \(0 bytes\)$"),
    "text named .wav": (2, r"notes\.wav: not an audio file ffmpeg can read \(Invalid data found when processing input\)$"),
    "folder without audio": (2, r"INPUT \S+/docs: a folder without audio files \(looked for \.wav"),
    "missing input": (2, r"INPUT \S+nowhere\.mp3: no such file or folder$"),
    "8 channels": (2, r"surround\.wav: has 8 channels; tiersep separates mono and stereo songs \(down-mix it first"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_songs_are_one_line_errors_with_nothing_written(ws, tmp_path, case):
    code, message = BAD_INPUTS[case]
    out = tmp_path / "out"
    proc = run(ws, str(bad_input(case, tmp_path)), "--out", str(out))
    assert proc.returncode == code, proc.stderr[-3000:]
    assert re.search(message, last_line(proc)), last_line(proc)
    assert last_line(proc).startswith("tiersep separate: error: ")
    assert not out.exists() or not [p for p in out.rglob("*") if p.name != ".tiersep"]


def test_bad_model_files_are_refused_before_any_song(ws, songs, tmp_path):
    song = str(songs / "short.wav")
    other = run(ws, song, "--out", str(tmp_path / "a"), "--preset", "cpu_tiny")
    assert other.returncode == 2
    assert re.search(r"model\.pt: trained with audio\.n_fft = 128, but preset 'cpu_tiny' has 256", last_line(other))
    marker = tmp_path / "PAYLOAD_RAN"
    tampered = run(ws, song, "--out", str(tmp_path / "b"), model=tampered_model(ws["model"], tmp_path / "evil.pt", marker))
    assert tampered.returncode == 2 and not marker.exists()
    assert re.search(r"evil\.pt: refused: this model file asks for the Python object posix\.system", last_line(tampered))
    cut = tmp_path / "cut.pt"
    cut.write_bytes(ws["model"].read_bytes()[:3000])
    truncated = run(ws, song, "--out", str(tmp_path / "c"), model=cut)
    assert truncated.returncode == 2 and "unreadable model file" in last_line(truncated)
    assert not any((tmp_path / x).exists() for x in "abc")


def test_corrupt_and_truncated_mp3_are_separated_with_a_note(ws, songs, tmp_path):
    good = (songs / "nested" / "mono 22k.mp3").read_bytes()
    rng = np.random.default_rng(0)
    corrupt = bytearray(good)
    for i in range(3000, len(corrupt) - 3000, 701):
        corrupt[i] = int(rng.integers(256))
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "corrupt.mp3").write_bytes(bytes(corrupt))
    (tmp_path / "in" / "truncated.mp3").write_bytes(good[:len(good) // 2])
    out = tmp_path / "out"
    proc = run(ws, str(tmp_path / "in"), "--out", str(out), "--chunk", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "note: ffmpeg reported" in proc.stderr and "decode error(s) and went on" in proc.stderr
    assert sidecar(out, "corrupt")["notes"][0].startswith("ffmpeg reported")
    assert re.search(r"note: decoded 1\.\d+ s, but the file declares 3\.\d+ s \(truncated\?\)", proc.stderr)
    assert sf.info(str(out / "truncated" / "vocals.wav")).frames < 22050 * 2


def test_one_failing_song_does_not_stop_the_others(ws, songs, tmp_path):
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "a.wav").write_bytes((songs / "short.wav").read_bytes())
    (folder / "b.wav").write_text("text, not audio\n")
    (folder / "c.wav").write_bytes((songs / "nested" / "mono 22k wav.wav").read_bytes())
    out = tmp_path / "out"
    proc = run(ws, str(folder), "--out", str(out), "--chunk", "1")
    assert proc.returncode == 2
    assert re.search(r"error: 1 of 3 songs failed: \S+/b\.wav: not an audio file ffmpeg can read", last_line(proc))
    assert (out / "a" / "vocals.wav").is_file() and (out / "c" / "separate.json").is_file()
    assert not (out / "b").exists() and not temporaries(out)


def test_an_output_folder_of_someone_else_is_refused(ws, songs, tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "thesis.tex").write_text("precious")
    proc = run(ws, str(songs / "short.wav"), "--out", str(out))
    assert proc.returncode == 2
    assert re.search(r"--out \S+/mine: holds files tiersep did not make \('thesis\.tex'\)", last_line(proc))
    assert sorted(os.listdir(out)) == ["thesis.tex"]


def test_a_killed_run_leaves_no_stem_and_the_next_run_cleans_up(ws, tmp_path):
    long_song = tmp_path / "long.wav"
    sf.write(long_song, np.random.default_rng(0).standard_normal((8000 * 120, 2)).astype(np.float32) * 0.1, 8000)
    out = tmp_path / "out"
    cmd = [TIERSEP, "separate", "--config", str(ws["config_file"]), "--model", str(ws["model"]), str(long_song),
           "--out", str(out), "--chunk", "1", "--batch", "1", "--device", "cpu"]
    log = tmp_path / "separate.log"        # what the run said, for a failure's message
    with open(log, "w") as stderr:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=stderr, cwd=REPO,
                                env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
    deadline = time.time() + 120
    while not temporaries(out) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    time.sleep(1.0)                                           # well into the song
    running = proc.poll() is None
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    said = log.read_text()[-3000:]
    # a CI run once found no temporary here: say whether the run had ended by itself, and what it said
    assert running, f"separate ended before it was killed (exit {proc.returncode}):\n{said}"
    assert temporaries(out) and not list(out.rglob("*.wav")), said   # only tiersep's temporaries
    again = run(ws, str(long_song), "--out", str(out), "--chunk", "2")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "removed" in again.stderr and "temporary file(s) a killed job left" in again.stderr
    assert not temporaries(out) and sf.info(str(out / "long" / "vocals.wav")).frames == 8000 * 120



def test_stems_in_an_output_folder_inside_the_input_folder_are_not_songs(ws, songs, tmp_path):
    music = tmp_path / "music"
    music.mkdir()
    (music / "a.wav").write_bytes((songs / "short.wav").read_bytes())
    for _ in range(2):                                  # the second run finds a/ stems under music/
        proc = run(ws, str(music), "--out", str(music / "separated"))
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "separated 1 song(s)" in proc.stdout
