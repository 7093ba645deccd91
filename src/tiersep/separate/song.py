"""One song through the stream: decode -> resample -> separate -> resample back -> write, in blocks.

    ffmpeg [C, n] @ song rate --(mono: both channels)--> StreamResampler --> OverlapAdd (or
    ShiftAverage) @ model rate --> [n_src, C, m] --> StreamResampler back --> [n_src, C, m'] @ song
    rate --(mono: mean of both)--> SongFiles

Every stage keeps only what its next output needs, so memory is bounded by the chunk and batch,
whatever the song's length. Two-stem mode writes the chosen stem and its complement, the mixture
minus the stem, at the song's own rate: the decoded blocks wait in a queue until the stem's samples
of the same span come out, so stem + complement is the mixture.
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


class _SongOutput:
    """Stems [n_src, C, m] at the model's rate -> the song's rate and channels -> its files."""

    def __init__(self, info: AudioInfo, sources: list[str], files: SongFiles, two_stem: str | None,
                 back: StreamResampler):
        self.info, self.sources, self.files, self.two_stem, self.back = info, sources, files, two_stem, back
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
        if self.two_stem:
            stem = stems[self.sources.index(self.two_stem)]
            blocks = {self.two_stem: stem, complement_name(self.two_stem): self.mixture.take(stem.shape[-1]) - stem}
        else:
            blocks = {name: stems[i] for i, name in enumerate(self.sources)}
        self.files.write(blocks)
        self.written += stems.shape[-1]


def separate_song(model: torch.nn.Module, preset: dict, info: AudioInfo, files: SongFiles, settings: StreamSettings,
                  device: torch.device, two_stem: str | None, on_seconds=None, on_block=None) -> dict:
    """Stream the song `info` into `files` (not committed here). Returns {seconds, frames, notes}.
    on_seconds(s): progress in seconds of audio decoded; on_block(): after each model output."""
    sources = list(preset["model"]["sources"])
    model_rate, model_channels = preset["audio"]["sample_rate"], preset["audio"]["channels"]
    if info.channels not in (1, model_channels):
        raise SongError(f"{info.path}: has {info.channels} channels; this model separates "
                        f"{model_channels}-channel songs (and mono ones)")
    passes = [OverlapAdd(model, settings.chunk_samples, settings.overlap, settings.precision, device,
                         settings.batch, delay) for delay in shift_delays(settings.shifts, settings.seed, model_rate)]
    separator = passes[0] if len(passes) == 1 else ShiftAverage(passes)
    to_model = StreamResampler(info.rate, model_rate)
    output = _SongOutput(info, sources, files, two_stem, StreamResampler(model_rate, info.rate))
    decoder = Decoder(info, settings.block_frames)

    def separated(stems: torch.Tensor | None) -> None:
        if stems is not None and on_block is not None:
            on_block()
        output.push(stems, settings.block_frames)

    for block in decoder:                                   # [C, n] float32 at the song's rate
        block = block.copy()                                # writable (ffmpeg's bytes are read-only)
        if output.mixture is not None:
            output.mixture.append(block)
        signal = torch.from_numpy(block)
        if info.channels == 1 and model_channels != 1:
            signal = signal.expand(model_channels, -1)      # mono separated as stereo
        resampled = to_model.push(signal)
        if resampled is not None:
            separated(separator.push(resampled))
        if on_seconds is not None:
            on_seconds(block.shape[1] / info.rate)
    output.limit = frames = decoder.frames
    resampled = to_model.close()
    if resampled is not None:
        separated(separator.push(resampled))
    separated(separator.close())
    output.close(len(sources), model_channels)
    if output.written != frames:
        raise RuntimeError(f"{info.path}: wrote {output.written} of {frames} frames (a bug in the stream)")
    return {"seconds": frames / info.rate, "frames": frames, "notes": list(decoder.notes)}
