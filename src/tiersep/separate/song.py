"""One song through the stream: decode -> resample -> separate -> resample back -> write, in blocks.

    ffmpeg [C, n] @ song rate --(mono: both channels)--> StreamResampler --> OverlapAdd (or
    ShiftAverage) @ model rate --> [n_src, C, m] --> StreamResampler back --> [n_src, C, m'] @ song
    rate --(mono: mean of both)--> SongFiles

Every stage keeps only what its next output needs, so memory is bounded by the chunk and batch,
whatever the song's length. Two-stem mode writes the chosen stem and its complement, the mixture
minus the stem, at the song's own rate: the decoded blocks wait in a queue until the stem's samples
of the same span come out, so stem + complement is the mixture.

The band above the model's (its rate's Nyquist, e.g. 4 kHz for an 8 kHz tier) cannot be separated,
and resampling drops it from every stem. It is kept: the decoded mixture minus that mixture
resampled to the model's rate and back (`_AboveBand`) is added to `other` (four stems), or is in
`no_STEM` already (two stems, the mixture minus the stem). Its share of the song's energy is reported.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass

import numpy as np
import torch

from .overlap_add import OverlapAdd, ShiftAverage

from .audio import AudioInfo, Decoder, SongError
from .resample import StreamResampler
from .stems import SongFiles

# Shifts delay the song by up to this long (demucs's max_shift: 0.5 s).
MAX_SHIFT_SECONDS = 0.5
# The stem that keeps the band above the model's (the last stem when a model has no such stem)
ABOVE_BAND_STEM = "other"


@dataclass
class StreamSettings:
    chunk_samples: int
    batch: int
    overlap: float
    precision: str
    shifts: int
    seed: int
    block_frames: int


def complement_name(stem: str) -> str:
    return f"no_{stem}"


def shift_delays(shifts: int, seed: int, rate: int) -> list[int]:
    """Delays (samples) of the passes: none for one pass, else random, the same for every song."""
    if shifts <= 1:
        return [0]
    rng = np.random.default_rng(seed)
    return [int(d) for d in rng.integers(0, int(MAX_SHIFT_SECONDS * rate) + 1, size=shifts)]


class _Queue:
    """Decoded mixture blocks [C, n] waiting for the stems of the same span (two-stem mode)."""

    def __init__(self):
        self.blocks, self.offset = collections.deque(), 0

    def append(self, block: np.ndarray) -> None:
        self.blocks.append(block)

    def take(self, count: int) -> np.ndarray:
        parts = []
        while count > 0:
            head = self.blocks[0]
            part = head[:, self.offset:self.offset + count]
            parts.append(part)
            count -= part.shape[1]
            self.offset += part.shape[1]
            if self.offset == head.shape[1]:
                self.blocks.popleft()
                self.offset = 0
        return np.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]


class _AboveBand:
    """The decoded mixture above the model's band, at the song's rate and channels: the mixture
    minus itself resampled to the model's rate and back, queued until the stems of the same span
    are written (they come later: the separation's latency)."""

    def __init__(self, info: AudioInfo, model_rate: int):
        self.mixture, self.ready = _Queue(), _Queue()
        self.back = StreamResampler(model_rate, info.rate)
        self.mono = info.channels == 1
        self.pending = 0                        # mixture samples not yet matched by the band below
        self.energy_above = self.energy = 0.0

    def push_mixture(self, block: np.ndarray) -> None:
        self.mixture.append(block)
        self.pending += block.shape[1]
        self.energy += float(np.square(block, dtype=np.float64).sum())

    def push_model(self, resampled: torch.Tensor | None) -> None:
        """The mixture as the model gets it (its rate and channels)."""
        if resampled is not None:
            self._below(self.back.push(resampled))

    def close(self) -> None:
        self._below(self.back.close())

    def _below(self, low: torch.Tensor | None) -> None:
        if low is None:
            return
        low = (low.mean(dim=0, keepdim=True) if self.mono else low).numpy()[:, :self.pending]
        if low.shape[1] == 0:
            return
        above = self.mixture.take(low.shape[1]) - low
        self.pending -= low.shape[1]
        self.energy_above += float(np.square(above, dtype=np.float64).sum())
        self.ready.append(above)

    def take(self, count: int) -> np.ndarray:
        return self.ready.take(count)

    def share(self) -> float:
        return self.energy_above / self.energy if self.energy > 0 else 0.0


class _SongOutput:
    """Stems [n_src, C, m] at the model's rate -> the song's rate and channels -> its files."""

    def __init__(self, info: AudioInfo, sources: list[str], files: SongFiles, two_stem: str | None,
                 back: StreamResampler, above: _AboveBand | None, on_frames=None):
        self.info, self.sources, self.files, self.two_stem, self.back = info, sources, files, two_stem, back
        self.above, self.on_frames = above, on_frames
        self.keeper = ABOVE_BAND_STEM if ABOVE_BAND_STEM in sources else sources[-1]
        self.mixture = _Queue() if two_stem else None     # the decoded mixture, for the complement
        self.written = 0
        self.limit = None                                  # the song's length, once decoded

    def push(self, stems: torch.Tensor | None, block_frames: int) -> None:
        """A batch's finished span goes on in pieces of `block_frames`: what the song's rate and the
        encoders hold at a time stays that size, whatever the chunk and batch."""
        if stems is None:
            return
        n_src, channels, _ = stems.shape
        for piece in stems.split(block_frames, dim=-1):
            self._write(self.back.push(piece.reshape(n_src * channels, -1)), n_src, channels)

    def close(self, n_src: int, channels: int) -> None:
        self._write(self.back.close(), n_src, channels)

    def _write(self, out: torch.Tensor | None, n_src: int, channels: int) -> None:
        if out is None:
            return
        out = out.reshape(n_src, channels, -1)
        if self.limit is not None:            # resampling back may give a sample or two more
            out = out[..., :max(0, self.limit - self.written)]
        if self.info.channels == 1 and channels != 1:
            out = out.mean(dim=1, keepdim=True)             # mono in, mono out
        stems = out.numpy()
        if stems.shape[-1] == 0:
            return
        count = stems.shape[-1]
        above = self.above.take(count) if self.above is not None else None
        if self.two_stem:              # the complement holds the band above: mixture - stem
            stem = stems[self.sources.index(self.two_stem)]
            blocks = {self.two_stem: stem, complement_name(self.two_stem): self.mixture.take(count) - stem}
        else:
            blocks = {name: stems[i] for i, name in enumerate(self.sources)}
            if above is not None:
                blocks[self.keeper] = blocks[self.keeper] + above
        self.files.write(blocks)
        self.written += count
        if self.on_frames is not None:
            self.on_frames(count)


def separate_song(model: torch.nn.Module, preset: dict, info: AudioInfo, files: SongFiles, settings: StreamSettings,
                  device: torch.device, two_stem: str | None, on_frames=None, on_block=None) -> dict:
    """Stream the song `info` into `files` (not committed here). Returns {seconds, frames, notes,
    band}. on_frames(n): n more frames of every stem written; on_block(): after each model output."""
    sources = list(preset["model"]["sources"])
    model_rate, model_channels = preset["audio"]["sample_rate"], preset["audio"]["channels"]
    if info.channels not in (1, model_channels):
        raise SongError(f"{info.path}: has {info.channels} channels; this model separates "
                        f"{model_channels}-channel songs (and mono ones)")
    passes = [OverlapAdd(model, settings.chunk_samples, settings.overlap, settings.precision, device,
                         settings.batch, delay) for delay in shift_delays(settings.shifts, settings.seed, model_rate)]
    separator = passes[0] if len(passes) == 1 else ShiftAverage(passes)
    to_model = StreamResampler(info.rate, model_rate)
    # only a song above the model's rate has a band the model cannot hold
    above = _AboveBand(info, model_rate) if info.rate > model_rate else None
    output = _SongOutput(info, sources, files, two_stem, StreamResampler(model_rate, info.rate), above, on_frames)
    decoder = Decoder(info, settings.block_frames)

    def to_separator(resampled: torch.Tensor | None) -> None:
        if resampled is None:
            return
        if above is not None:            # before the separator: the band below is then always ahead
            above.push_model(resampled)
        separated(separator.push(resampled))

    def separated(stems: torch.Tensor | None) -> None:
        if stems is not None and on_block is not None:
            on_block()
        output.push(stems, settings.block_frames)

    for block in decoder:                                   # [C, n] float32 at the song's rate
        block = block.copy()                                # writable (ffmpeg's bytes are read-only)
        if output.mixture is not None:
            output.mixture.append(block)
        if above is not None:
            above.push_mixture(block)
        signal = torch.from_numpy(block)
        if info.channels == 1 and model_channels != 1:
            signal = signal.expand(model_channels, -1)      # mono separated as stereo
        to_separator(to_model.push(signal))
    output.limit = frames = decoder.frames
    to_separator(to_model.close())
    if above is not None:
        above.close()
    separated(separator.close())
    output.close(len(sources), model_channels)
    if output.written != frames:
        raise RuntimeError(f"{info.path}: wrote {output.written} of {frames} frames (a bug in the stream)")
    band = {"model_band_hz": model_rate / 2, "above_band_energy_share": above.share() if above else 0.0,
            "kept_in": None if above is None else complement_name(two_stem) if two_stem else output.keeper}
    return {"seconds": frames / info.rate, "frames": frames, "notes": list(decoder.notes), "band": band}
