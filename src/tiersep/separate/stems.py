"""The stem files of one song: written block by block under temporary names, renamed together.

Nothing half-written: every stem goes to a tiersep temporary name beside its final path
(`.<name>.<8 chars>.tmp`, which `tiersep.outputs.exclusive` removes after a killed run); only when
all stems of the song are complete are they renamed into place, with the modes the umask gives
(0644 under the usual 022). A failure (a full disk included) removes the temporaries.

Clipping (`clip`), and what is reported per stem (peak, samples beyond full scale):
- clamp: samples are clipped to [-1, 1];
- none: written as computed (float32 wav keeps values beyond full scale; 16/24-bit PCM saturates
  them, mp3 decoders clip them);
- rescale: one gain for all stems of the song, 1 / max(1.01 x their peak, 1) as demucs's, so the
  stems keep their levels and still add up. The gain is known only at the end, so the stems
  first go to float32 temporaries, then are encoded in blocks with the gain.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np
import soundfile as sf

from tiersep.io import current_umask

from .audio import Encoder

CLIP_MODES = ("rescale", "clamp", "none")
RESCALE_HEADROOM = 1.01
COPY_BLOCK = 1 << 16        # frames per block when encoding a rescaled temporary
MP3_BYTES_PER_SECOND = 320_000 // 8 + 1000      # 320 kbit/s and its frame headers, generously
FILE_HEADER_BYTES = 64 * 1024


def disk_bytes(stems: int, frames: int, channels: int, rate: int, fmt: str, bits: str, clip: str) -> int:
    """The most disk one song's stems hold at once: the finished files (flac booked as PCM, its
    worst case; mp3 at its bitrate), and with rescale the float32 temporaries beside the first one
    encoded from them."""
    samples = frames * channels
    final = (samples * {"16": 2, "24": 3, "32f": 4}[bits] if fmt != "mp3"
             else int(frames / rate * MP3_BYTES_PER_SECOND)) + FILE_HEADER_BYTES
    if clip == "rescale":
        return stems * (samples * 4 + FILE_HEADER_BYTES) + final
    return stems * final


def temporary_path(final: Path) -> Path:
    """A new empty file named as tiersep's temporaries, beside `final`."""
    fd, name = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent)
    os.close(fd)
    return Path(name)


class SongFiles:
    """Write each stem of one song (paths: stem -> final path) in blocks, then commit or abort."""

    def __init__(self, paths: dict[str, Path], fmt: str, bits: str, rate: int, channels: int, clip: str):
        if clip not in CLIP_MODES:
            raise ValueError(f"clip: {clip!r} (allowed: {', '.join(CLIP_MODES)})")
        self.paths, self.fmt, self.bits, self.rate, self.channels, self.clip = paths, fmt, bits, rate, channels, clip
        self.made_dirs: list[Path] = []
        self.temps: dict[str, Path] = {}
        self.encoders: dict[str, Encoder] = {}
        self.stats = {stem: {"peak": 0.0, "clipped_samples": 0} for stem in paths}
        self.gain = 1.0
        for stem, final in paths.items():
            self._make_dirs(final.parent)
            self.temps[stem] = temporary_path(final)
            # rescale: float32 first, encoded with the gain at the end
            fmt_, bits_ = ("wav", "32f") if clip == "rescale" else (fmt, bits)
            self.encoders[stem] = Encoder(self.temps[stem], fmt_, bits_, rate, channels, shown=final)

    def _make_dirs(self, folder: Path) -> None:
        missing = []
        while not folder.exists():
            missing.append(folder)
            folder = folder.parent
        for path in reversed(missing):
            path.mkdir()
            self.made_dirs.append(path)

    def write(self, blocks: dict[str, np.ndarray]) -> None:
        """One block [C, n] per stem, in track order."""
        for stem, block in blocks.items():
            stats = self.stats[stem]
            magnitude = np.abs(block)
            if magnitude.size:
                stats["peak"] = max(stats["peak"], float(magnitude.max()))
                stats["clipped_samples"] += int(np.count_nonzero(magnitude > 1.0))
            if self.clip == "clamp":
                block = np.clip(block, -1.0, 1.0)
            self.encoders[stem].write(block)

    def commit(self) -> dict:
        """Finish every file and rename them all into place; returns the clipping report."""
        for encoder in self.encoders.values():
            encoder.close()
        if self.clip == "rescale":
            peak = max((s["peak"] for s in self.stats.values()), default=0.0)
            self.gain = 1.0 / max(RESCALE_HEADROOM * peak, 1.0)
            for stem, raw in list(self.temps.items()):
                self.temps[stem] = self._encode_scaled(raw, self.paths[stem])
        mode = 0o666 & ~current_umask()        # mkstemp made them 0600; stems are read like any output
        for stem, temp in self.temps.items():
            os.chmod(temp, mode)
            os.replace(temp, self.paths[stem])
        self.temps = {}
        return self.report()

    def _encode_scaled(self, raw: Path, final: Path) -> Path:
        """Encode the float32 temporary `raw` with the song's gain into a new temporary (returned);
        `raw` is removed once that succeeded, and stays a temporary for abort() otherwise."""
        encoded = temporary_path(final)
        encoder = Encoder(encoded, self.fmt, self.bits, self.rate, self.channels, shown=final)
        try:
            with sf.SoundFile(str(raw)) as source:
                for block in source.blocks(COPY_BLOCK, dtype="float32", always_2d=True):
                    encoder.write(block.T * np.float32(self.gain))
            encoder.close()
        except BaseException:
            encoder.abort()
            encoded.unlink(missing_ok=True)
            raise
        raw.unlink()
        return encoded

    def report(self) -> dict:
        return {"mode": self.clip, "gain": self.gain,
                "stems": {stem: {"peak": round(s["peak"], 6), "clipped_samples": s["clipped_samples"]}
                          for stem, s in self.stats.items()}}

    def abort(self) -> None:
        """Remove every temporary (and the folders this song made, when left empty)."""
        for encoder in self.encoders.values():
            encoder.abort()
        for temp in self.temps.values():
            temp.unlink(missing_ok=True)
        self.temps = {}
        for folder in reversed(self.made_dirs):
            try:
                folder.rmdir()
            except OSError:
                pass
