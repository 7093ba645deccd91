"""`tiersep separate`'s stems keep the whole band, and its console is readable in a log: the real
CLI in its own process on a tiny trained tier (test_separate's fixtures), 8 kHz, so its band ends at
4 kHz."""
from __future__ import annotations

import re

import numpy as np
import soundfile as sf

from test_separate import STEMS, last_line, run, sidecar, songs, ws  # noqa: F401 (fixtures)

RATE = 44100
MODEL_BAND_HZ = 4000.0


def above_share(x: np.ndarray, hz: float = 4200.0) -> float:
    """The share of the energy of x [S, C] above `hz` (a little above the band's edge: the
    resampler's transition)."""
    spectrum = np.abs(np.fft.rfft(x, axis=0)) ** 2
    return float(spectrum[np.fft.rfftfreq(len(x), 1 / RATE) > hz].sum() / spectrum.sum())


def bright_song(path, seconds: float = 4.0) -> np.ndarray:
    """A 440 Hz tone with a 9 kHz one and noise over the whole band (as a 192 kHz master has)."""
    t = np.arange(int(RATE * seconds)) / RATE
    x = 0.2 * np.sin(2 * np.pi * 440 * t) + 0.1 * np.sin(2 * np.pi * 9000 * t)
    x = x + 0.02 * np.random.default_rng(0).standard_normal(len(t))
    song = np.stack([x, 0.8 * x], axis=1).astype(np.float32)
    sf.write(path, song, RATE, subtype="FLOAT")
    return song


def test_the_band_above_the_models_is_kept_in_other_and_reported(ws, tmp_path):
    song = bright_song(tmp_path / "bright.wav")
    out = tmp_path / "out"
    proc = run(ws, str(tmp_path / "bright.wav"), "--out", str(out), "--bits", "32f", "--clip", "none")
    assert proc.returncode == 0, proc.stderr[-3000:]
    stems = {s: sf.read(str(out / "bright" / f"{s}.wav"), dtype="float32")[0] for s in STEMS}
    total = sum(stems.values())
    share = above_share(song)
    assert share > 0.15
    # the stems hold the band above the model's as the input has it; what they miss is in-band only
    assert abs(above_share(total) * (total ** 2).sum() / (share * (song ** 2).sum()) - 1) < 0.01
    residual = np.fft.rfft(song - total, axis=0)
    above = np.fft.rfftfreq(len(song), 1 / RATE) > 4200
    assert (np.abs(residual[above]) ** 2).sum() < 1e-4 * (np.abs(np.fft.rfft(song, axis=0)[above]) ** 2).sum()
    assert all(above_share(stems[s]) < 1e-3 for s in ("vocals", "drums", "bass"))   # only other holds it
    band = sidecar(out, "bright")["band"]
    assert band["model_band_hz"] == MODEL_BAND_HZ and band["kept_in"] == "other"
    assert abs(band["above_band_energy_share"] - share) < 0.01
    assert re.search(rf"note: {100 * band['above_band_energy_share']:.2f}% of the song's energy is above the "
                     r"model's band \(4000 Hz\), which it cannot separate: kept in other, so the stems hold the "
                     r"whole band", proc.stderr), proc.stderr[-2000:]


def test_two_stems_keep_the_band_in_the_complement_and_a_song_at_the_models_rate_has_none(ws, songs, tmp_path):
    bright_song(tmp_path / "bright.wav")
    out = tmp_path / "out"
    proc = run(ws, str(tmp_path / "bright.wav"), str(songs / "short.wav"), "--out", str(out), "--stems", "vocals")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sidecar(out, "bright")["band"]["kept_in"] == "no_vocals"
    assert sidecar(out, "short")["band"] == {"model_band_hz": MODEL_BAND_HZ, "above_band_energy_share": 0.0,
                                             "kept_in": None}                 # 8 kHz: nothing above
    assert proc.stderr.count("above the model's band") == 1


def test_progress_is_plain_lines_by_seconds_written_when_not_a_terminal(ws, tmp_path):
    bright_song(tmp_path / "bright.wav", seconds=6.0)
    proc = run(ws, str(tmp_path / "bright.wav"), "--out", str(tmp_path / "out"), "--chunk", "1", "--batch", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "\r" not in proc.stderr and "\x1b" not in proc.stderr
    lines = re.findall(r"^\[1/1\] bright: (\d+\.\d) of 6\.0 s written \((\d+)%\) in \d+ s(, about \d+ s left)?$",
                       proc.stderr, re.M)
    assert len(lines) >= 3, proc.stderr
    written = [float(w) for w, _, _ in lines]
    assert written == sorted(set(written)) and written[-1] == 6.0 and lines[-1][2] == ""


def test_the_console_and_the_sidecar_name_one_quantity_once(ws, songs, tmp_path):
    out = tmp_path / "out"
    proc = run(ws, str(songs / "short.wav"), "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    memory = sidecar(out, "short")["memory"]
    found = re.search(r"booked (\d+\.\d\d) GiB \(predicted peak (\d+\.\d\d) (GiB|MiB|KiB)\) within", proc.stderr)
    assert found, proc.stderr
    assert float(found.group(1)) == round(memory["booked_bytes"] / 2**30, 2)
    scale = {"GiB": 2**30, "MiB": 2**20, "KiB": 2**10}[found.group(3)]
    assert float(found.group(2)) == round(memory["predicted_peak_bytes"] / scale, 2)
    assert "estimated peak" not in proc.stderr and not any(k.startswith("estimated") for k in memory)


def test_progress_is_a_bar_by_seconds_written_on_a_terminal(ws, tmp_path):
    import os
    import subprocess

    from conftest import on_a_terminal
    from test_separate import REPO, TIERSEP

    bright_song(tmp_path / "bright.wav", seconds=6.0)
    cmd = [TIERSEP, "separate", "--config", str(ws["config_file"]), "--model", str(ws["model"]), "--device", "cpu",
           str(tmp_path / "bright.wav"), "--out", str(tmp_path / "out"), "--chunk", "1", "--batch", "1"]
    proc, seen = on_a_terminal(cmd, stdout=subprocess.DEVNULL, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.wait(timeout=300) == 0, seen[-3000:]
    text = seen.decode(errors="replace")
    bars = re.findall(r"\r\[1/1\] bright: +(\d+)%\|[^\r\n]*\| (\d\.\d)/6\.0 s written \[", text)
    assert len(bars) >= 3, text[-2000:]
    # tqdm draws at most every 0.1 s and clears the bar at the end: the last drawn need not be 6.0
    assert [float(s) for _, s in bars] == sorted(float(s) for _, s in bars) and float(bars[-1][1]) >= 3
    assert " of 6.0 s written (" not in text              # no plain lines on a terminal
