"""The stem files of one song: written block by block under temporary names, renamed together.

Nothing half-written: every stem goes to a tiersep temporary name beside its final path
(`.<name>.<8 chars>.tmp`, which `tiersep.outputs.exclusive` removes after a killed run); only when
all stems of the song are complete are they renamed into place, with the modes the umask gives
(0644 under the usual 022), and last the files attached to them (the song's sidecar, written to a
temporary before any rename, so a disk that fills up then leaves no stem without its sidecar). A
failure (a full disk included) removes the temporaries.

Clipping (`clip`), and what is reported per stem (peak, samples beyond full scale):
- clamp: samples are clipped to [-1, 1];
- none: written as computed (float32 wav keeps values beyond full scale; 16/24-bit PCM saturates
  them, mp3 decoders clip them);
- rescale: one gain for all stems of the song, 1 / max(1.01 x their peak, 1) as demucs's, so the
  stems keep their levels and still add up. The gain is known only at the end, and no disk holds
  more than the stems themselves: the stems are written with the `gain` given (1 at first), and
  when their peak asks for a smaller one (`rescale_gain`), the caller discards them and writes the
  song again with it (separate/run.py). Each sample is then the computed one times the gain,
  rounded once into the output format.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np

from tiersep.io import current_umask

from .audio import Encoder, write_failure

CLIP_MODES = ("rescale", "clamp", "none")
RESCALE_HEADROOM = 1.01
MP3_BYTES_PER_SECOND = 320_000 // 8 + 1000      # 320 kbit/s and its frame headers, generously
FILE_HEADER_BYTES = 64 * 1024


def disk_bytes(stems: int, frames: int, channels: int, rate: int, fmt: str, bits: str) -> int:
    """The most disk one song's stems hold at once, whatever the clip mode: the finished files (flac
    booked as PCM, its worst case; mp3 at its bitrate), each with a header allowance (the sidecar's
    few KiB fit in it)."""
    samples = frames * channels
    final = (samples * {"16": 2, "24": 3, "32f": 4}[bits] if fmt != "mp3"
             else int(frames / rate * MP3_BYTES_PER_SECOND)) + FILE_HEADER_BYTES
    return stems * final


def temporary_path(final: Path) -> Path:
    """A new empty file named as tiersep's temporaries, beside `final`."""
    fd, name = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent)
    os.close(fd)
    return Path(name)


class SongFiles:
    """Write each stem of one song (paths: stem -> final path) in blocks, then commit or abort.
    gain: rescale's gain for this writing (see the module docstring); 1 for the other modes."""

    def __init__(self, paths: dict[str, Path], fmt: str, bits: str, rate: int, channels: int, clip: str,
                 gain: float = 1.0):
        if clip not in CLIP_MODES:
            raise ValueError(f"clip: {clip!r} (allowed: {', '.join(CLIP_MODES)})")
        if clip != "rescale" and gain != 1.0:
            raise ValueError(f"gain: {gain} with clip {clip!r} (only rescale scales)")
        self.paths, self.fmt, self.bits, self.rate, self.channels, self.clip = paths, fmt, bits, rate, channels, clip
        self.gain = gain
        self.made_dirs: list[Path] = []
        self.temps: dict[str, Path] = {}
        self.attached: dict[Path, Path] = {}        # final path -> temporary, renamed after the stems
        self.encoders: dict[str, Encoder] = {}
        self.stats = {stem: {"peak": 0.0, "clipped_samples": 0} for stem in paths}
        for stem, final in paths.items():
            self._make_dirs(final.parent)
            self.temps[stem] = temporary_path(final)
            self.encoders[stem] = Encoder(self.temps[stem], fmt, bits, rate, channels, shown=final)

    def _make_dirs(self, folder: Path) -> None:
        missing = []
        while not folder.exists():
            missing.append(folder)
            folder = folder.parent
        for path in reversed(missing):
            path.mkdir()
            self.made_dirs.append(path)

    def write(self, blocks: dict[str, np.ndarray]) -> None:
        """One block [C, n] per stem, in track order, as computed (the stats are of these values)."""
        for stem, block in blocks.items():
            stats = self.stats[stem]
            magnitude = np.abs(block)
            if magnitude.size:
                stats["peak"] = max(stats["peak"], float(magnitude.max()))
                stats["clipped_samples"] += int(np.count_nonzero(magnitude > 1.0))
            if self.clip == "clamp":
                block = np.clip(block, -1.0, 1.0)
            elif self.gain != 1.0:
                block = np.asarray(block, dtype=np.float32) * np.float32(self.gain)
            self.encoders[stem].write(block)

    def rescale_gain(self) -> float:
        """The gain the stems written so far need (rescale; 1.0: none, or another mode)."""
        if self.clip != "rescale":
            return 1.0
        peak = max((s["peak"] for s in self.stats.values()), default=0.0)
        return 1.0 / max(RESCALE_HEADROOM * peak, 1.0)

    def finish(self) -> None:
        """Complete every stem's temporary (a full disk fails here too); nothing is renamed yet."""
        for encoder in self.encoders.values():
            encoder.close()

    def attach(self, final: Path, data: bytes) -> None:
        """Write `data` now to a temporary of `final`, renamed into place after the stems by
        commit(): a disk too full for it fails the song before any stem is in place."""
        try:
            self.attached[final] = temporary_path(final)
            self.attached[final].write_bytes(data)
        except OSError as err:
            raise write_failure(final, err.strerror or str(err)) from None

    def commit(self) -> dict:
        """Finish every file and rename them all into place, the attached ones last; returns the
        clipping report."""
        self.finish()
        mode = 0o666 & ~current_umask()        # mkstemp made them 0600; stems are read like any output
        renames = [(temp, self.paths[stem]) for stem, temp in self.temps.items()] + \
            [(temp, final) for final, temp in self.attached.items()]
        for temp, final in renames:
            os.chmod(temp, mode)
            os.replace(temp, final)
        self.temps, self.attached = {}, {}
        return self.report()

    def report(self) -> dict:
        return {"mode": self.clip, "gain": self.gain,
                "stems": {stem: {"peak": round(s["peak"], 6), "clipped_samples": s["clipped_samples"]}
                          for stem, s in self.stats.items()}}

    def abort(self) -> None:
        """Remove every temporary (and the folders this song made, when left empty)."""
        for encoder in self.encoders.values():
            encoder.abort()
        for temp in [*self.temps.values(), *self.attached.values()]:
            temp.unlink(missing_ok=True)
        self.temps, self.attached = {}, {}
        for folder in reversed(self.made_dirs):
            try:
                folder.rmdir()
            except OSError:
                pass
