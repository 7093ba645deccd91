"""The excerpt the report plays: one stretch of one test track, the mixture, each estimated stem and
each reference, encoded small (Ogg Opus through ffmpeg) into results/eval/<tier>/listen/ with a
listen.json record (workflow/schemas/records/listen.schema.yaml).

evaluate offers every track it separates; the first one is used (deterministic, and the estimates
are already in memory). The stretch is the `evaluate.listen_seconds` with the most mixture energy;
a shorter track is used whole. The files of a tier stay under the schema's 2 MB cap: the bitrate
is lowered up front to fit it, and the record is checked against the cap before it is written.
"""
from __future__ import annotations

import contextlib
import shutil
import subprocess
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from tiersep import records
from tiersep.config import ConfigError
from tiersep.io import atomic_dir, write_json

MAX_BYTES = records.schema("listen")["properties"]["bytes"]["maximum"]
HEADROOM = 0.9        # Ogg pages and constrained VBR may run a few % over the nominal bitrate
HOP_SECONDS = 0.5     # candidate starts of the loudest stretch
FADE_SECONDS = 0.01   # a cut mid-waveform clicks; a 10 ms fade at each end does not
CODEC, MIME, SUFFIX = "opus", "audio/ogg; codecs=opus", ".ogg"


def loudest_start(mixture: np.ndarray, length: int, hop: int) -> int:
    """The first start (a multiple of hop) of the `length` samples of mixture [C, S] with the most
    energy; 0 when the track is not longer than `length`."""
    samples = mixture.shape[-1]
    if samples <= length:
        return 0
    power = np.concatenate([[0.0], np.cumsum(np.square(mixture, dtype=np.float64).sum(0))])
    starts = np.arange(0, samples - length + 1, max(1, hop))
    return int(starts[np.argmax(power[starts + length] - power[starts])])


def fitting_kbps(kbps: int, files: int, seconds: float) -> int:
    """`kbps`, or less where `files` excerpts of `seconds` would not fit under the cap."""
    return min(kbps, int(MAX_BYTES * 8 * HEADROOM / (files * seconds * 1000)))


def encode(audio: np.ndarray, rate: int, kbps: int, path: Path) -> None:
    """Write audio [C, S] (float) to `path` as Ogg Opus at `kbps` (48 kHz, as Opus plays)."""
    command = ["ffmpeg", "-nostdin", "-hide_banner", "-loglevel", "error", "-f", "f32le", "-ar", str(rate),
               "-ac", str(audio.shape[0]), "-i", "pipe:0", "-c:a", "libopus", "-b:a", f"{kbps}k",
               "-vbr", "constrained", "-ar", "48000", "-map_metadata", "-1", "-fflags", "+bitexact",
               "-flags:a", "+bitexact", "-f", "ogg", "-y", str(path)]
    raw = np.ascontiguousarray(audio.T, dtype="<f4").tobytes()   # interleaved [S, C]
    done = subprocess.run(command, input=raw, capture_output=True)
    if done.returncode != 0:
        last = (done.stderr.decode(errors="replace").strip().splitlines() or ["no message"])[-1]
        raise RuntimeError(f"{path}: ffmpeg could not encode the excerpt ({last})")


def check_encoder() -> None:
    """ConfigError unless ffmpeg is on PATH with the Opus encoder: said before any track is
    separated, not after the scoring."""
    if shutil.which("ffmpeg") is None:
        raise ConfigError("ffmpeg not found on PATH: evaluate.listen_seconds needs it to encode the "
                          "report's excerpt (install ffmpeg, or set evaluate.listen_seconds: 0)")
    done = subprocess.run(["ffmpeg", "-hide_banner", "-h", "encoder=libopus"], capture_output=True, text=True)
    if done.returncode != 0 or not done.stdout.startswith("Encoder libopus"):
        raise ConfigError(f"{shutil.which('ffmpeg')}: built without the Opus encoder (libopus) that "
                          "evaluate.listen_seconds needs; install an ffmpeg with it, or set "
                          "evaluate.listen_seconds: 0")


def write_excerpt(folder: Path, preset: str, track: str, mixture: np.ndarray, estimates: np.ndarray,
                  references: np.ndarray, sources: list[str], rate: int, settings: dict) -> dict:
    """Encode the excerpt of one track (mixture [C, S], estimates and references [n, C, S]) into
    `folder` and write folder/listen.json; returns the record."""
    length = int(round(settings["listen_seconds"] * rate))
    start = loudest_start(mixture, length, int(HOP_SECONDS * rate))
    cut = slice(start, start + length)
    parts = [("mixture", None, mixture[:, cut])]
    for i, stem in enumerate(sources):
        parts += [("estimate", stem, estimates[i][:, cut]), ("reference", stem, references[i][:, cut])]
    samples = parts[0][2].shape[-1]
    peak = max(float(np.max(np.abs(audio), initial=0.0)) for _role, _stem, audio in parts)
    gain = min(1.0, 0.99 / peak) if peak > 0 else 1.0     # one gain for all: levels stay comparable
    fade = np.ones(samples, dtype=np.float32)
    ramp = min(int(FADE_SECONDS * rate), samples // 2)
    if ramp:
        fade[:ramp] = np.sin(np.linspace(0, np.pi / 2, ramp)) ** 2
        fade[samples - ramp:] = fade[:ramp][::-1]
    kbps = fitting_kbps(settings["listen_kbps"], len(parts), samples / rate)
    files = []
    for role, stem, audio in parts:
        name = "mixture" + SUFFIX if stem is None else f"{stem}.{role}{SUFFIX}"
        encode(audio * (gain * fade), rate, kbps, folder / name)
        files.append({"role": role, "stem": stem, "file": name, "bytes": (folder / name).stat().st_size})
    record = {"preset": preset, "track": track, "start": start / rate, "seconds": samples / rate,
              "sample_rate": rate, "codec": CODEC, "mime": MIME, "kbps": kbps, "gain": gain,
              "bytes": sum(f["bytes"] for f in files), "files": files}
    records.validate_record("listen", record, folder / "listen.json")   # the 2 MB cap among others
    write_json(folder / "listen.json", record)
    return record


@contextlib.contextmanager
def excerpt_writer(folder: Path, preset: str, sources: list[str], rate: int,
                   settings: dict) -> Iterator[Callable]:
    """Yield offer(track, mixture, estimates, references): the first track offered becomes the
    excerpt, later ones are ignored. The folder is built under a temporary name and appears only
    when the block succeeds, replacing an earlier one (evaluate's own folder, claimed by it). With
    evaluate.listen_seconds 0 nothing is encoded and an earlier excerpt is removed: it would play
    another model."""
    folder = Path(folder)
    if not settings["listen_seconds"]:
        yield lambda *track: None
        if folder.is_symlink() or folder.is_file():
            folder.unlink()
        elif folder.is_dir():
            shutil.rmtree(folder)
        return
    check_encoder()
    with atomic_dir(folder, replace=True) as tmp:
        written: list[dict] = []

        def offer(track: str, mixture: np.ndarray, estimates: np.ndarray, references: np.ndarray) -> None:
            if not written:
                written.append(write_excerpt(tmp, preset, track, mixture, estimates, references,
                                             sources, rate, settings))
        yield offer
