"""Chunked overlap-add separation, streamed: blocks of a track in, finished blocks of stems out.

The model sees fixed-size chunks [batch, C, chunk], so its memory does not depend on the track
length. Each chunk's output is weighted by a smooth window and added into a buffer that spans only
the chunks not yet finished; a sample is divided by its summed window and handed out as soon as no
later chunk reaches it. Dividing by the summed window (not relying on the window summing to one)
makes the cross-fade exact for any chunk, overlap and track length: a model that returns its input
reconstructs the input. Host memory is bounded by the chunk and the batch, not by the track.

`OverlapAdd` is the one implementation: `separate_track()` (evaluate, a whole track in memory) pushes a
track through it, and `tiersep separate` pushes decoded blocks of a song, so both give the same
numbers for the same chunk and batch. `ShiftAverage` averages several passes whose input is
delayed by different amounts (random-shift test-time augmentation, as demucs's --shifts).
"""
from __future__ import annotations

import math
from typing import Callable

import numpy as np
import torch
from tqdm import tqdm

from tiersep.model.step import autocast


def chunk_window(chunk: int, overlap: int) -> torch.Tensor:
    """Window [chunk]: sin^2 fade-in over the first `overlap` samples, cos^2 fade-out over the
    last `overlap`, 1 in between (min of the two when they meet). Strictly positive, so every
    covered sample has weight; fade-in + fade-out of neighbouring chunks sum to ~1 already."""
    window = torch.ones(chunk, dtype=torch.float64)
    if overlap > 0:
        ramp = torch.sin(0.5 * math.pi * (torch.arange(overlap, dtype=torch.float64) + 0.5) / overlap) ** 2
        window[:overlap] = torch.minimum(window[:overlap], ramp)
        window[chunk - overlap:] = torch.minimum(window[chunk - overlap:], ramp.flip(0))
    return window.float()


def plan_chunks(length: int, chunk: int, overlap: int) -> list[int]:
    """Start of each chunk in track samples. The track is padded by `overlap` zeros at the front
    (so its first samples are not on a fade-in) and as needed at the end (at least `overlap`)."""
    hop = chunk - overlap
    needed = length + 2 * overlap
    count = 1 + max(0, math.ceil((needed - chunk) / hop))
    return [k * hop - overlap for k in range(count)]


def overlap_samples(chunk_samples: int, overlap: float) -> int:
    """The cross-fade length in samples for an overlap fraction (at least one sample of hop)."""
    return min(int(round(chunk_samples * overlap)), chunk_samples - 1)


class OverlapAdd:
    """Streaming overlap-add separation: `push(block [C, n])` and finally `close()`, each returning
    the stems that are finished, [n_src, C, m] float32 on the CPU (m may be 0), in track order.

    model: maps [B, C, chunk] -> [B, n_src, C, chunk] and is already on `device`; it runs in eval
    mode under inference_mode (its training flag is restored after each call). batch: chunks per
    model call. delay: zeros put before the track (and dropped from the output), for shifts.
    on_chunks(count): called after each model call with the chunks it separated.
    """

    def __init__(self, model: torch.nn.Module, chunk_samples: int, overlap: float, precision: str = "fp32",
                 device: str | torch.device = "cpu", batch: int = 1, delay: int = 0,
                 on_chunks: Callable[[int], None] | None = None):
        if chunk_samples < 1:
            raise ValueError(f"chunk_samples: must be positive, got {chunk_samples}")
        if not 0 <= overlap < 1:
            raise ValueError(f"overlap: must be in [0, 1), got {overlap}")
        if batch < 1 or delay < 0:
            raise ValueError(f"batch: must be positive and delay not negative, got {batch}, {delay}")
        self.device = torch.device(device)
        autocast(precision, self.device.type, outer_off=True)   # an unknown precision fails here
        self.model, self.precision, self.batch, self.delay = model, precision, batch, delay
        self.chunk = chunk_samples
        self.overlap = overlap_samples(chunk_samples, overlap)
        self.hop = chunk_samples - self.overlap
        self.window = chunk_window(chunk_samples, self.overlap)          # [chunk]
        self.on_chunks = on_chunks
        self.channels = None
        self.received = 0          # samples of the delayed signal seen so far (delay included)
        self.inbuf = None          # [C, n]: the delayed signal from in_base on
        self.in_base = 0
        self.cut = 0               # index of the next chunk to cut from the input
        self.pending = []          # (chunk index, piece [C, chunk]) waiting for a model call
        self.acc = None            # [n_src, C, m]: weighted sum from out_base on
        self.wsum = torch.zeros(0)  # [m]: summed window from out_base on
        self.out_base = 0          # signal position of acc[..., 0]; everything before it is handed out
        self.closed = False

    # -- public -----------------------------------------------------------------------------------
    def push(self, block: torch.Tensor | np.ndarray) -> torch.Tensor | None:
        """Feed the next samples of the track [C, n]; returns the stems finished so far."""
        block = torch.as_tensor(block, dtype=torch.float32)
        if block.ndim != 2:
            raise ValueError(f"mixture: expected [channels, samples], got shape {tuple(block.shape)}")
        if self.closed:
            raise ValueError("push after close")
        if self.channels is None:
            self.channels = block.shape[0]
            self.inbuf = torch.zeros(self.channels, self.delay)
            self.received = self.delay
        elif block.shape[0] != self.channels:
            raise ValueError(f"mixture: a block of {block.shape[0]} channels after {self.channels}")
        self.inbuf = block if self.inbuf.shape[1] == 0 else torch.cat([self.inbuf, block], dim=1)
        self.received += block.shape[1]
        while self.cut * self.hop - self.overlap + self.chunk <= self.received:
            self._cut_next()
        self._drop_used_input()
        return self._finished(self._next_start())

    def close(self) -> torch.Tensor:
        """The track has ended: separate the remaining chunks (zero-padded) and return the rest."""
        if self.channels is None or self.received == self.delay:
            raise ValueError("mixture: has no samples")
        self.closed = True
        for _ in range(self.cut, len(plan_chunks(self.received, self.chunk, self.overlap))):
            self._cut_next()
        if self.pending:
            self._run()
        return self._finished(self.received)

    # -- internals --------------------------------------------------------------------------------
    def _start(self, index: int) -> int:
        return index * self.hop - self.overlap

    def _next_start(self) -> int:
        """Where the first chunk not yet separated starts: every sample before it is finished."""
        first = self.pending[0][0] if self.pending else self.cut
        return max(self._start(first), 0)

    def _cut_next(self) -> None:
        start = self._start(self.cut)
        lo, hi = max(start, 0), min(start + self.chunk, self.received)   # the part inside the signal
        piece = torch.zeros(self.channels, self.chunk)                    # zero padding outside
        piece[:, lo - start:hi - start] = self.inbuf[:, lo - self.in_base:hi - self.in_base]
        self.pending.append((self.cut, piece))
        self.cut += 1
        if len(self.pending) == self.batch:
            self._run()

    def _drop_used_input(self) -> None:
        keep_from = max(self._start(self.cut), 0)
        if keep_from > self.in_base:
            self.inbuf = self.inbuf[:, keep_from - self.in_base:].clone()   # free the used samples
            self.in_base = keep_from

    def _run(self) -> None:
        """One model call on the pending chunks; their weighted outputs are added to the buffer."""
        indices = [index for index, _ in self.pending]
        pieces = torch.stack([piece for _, piece in self.pending])          # [b, C, chunk]
        self.pending = []
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.inference_mode(), autocast(self.precision, self.device.type, outer_off=True):
                estimates = self.model(pieces.to(self.device, non_blocking=True))   # [b, n_src, C, chunk]
        finally:
            self.model.train(was_training)
        expected = (len(indices), self.channels, self.chunk)
        if estimates.ndim != 4 or (estimates.shape[0], *estimates.shape[2:]) != expected:
            raise ValueError(f"model returned shape {tuple(estimates.shape)} for input {tuple(pieces.shape)}; "
                             f"expected [{len(indices)}, n_src, {self.channels}, {self.chunk}]")
        for row, index in enumerate(indices):
            start = self._start(index)
            lo, hi = max(start, 0), min(start + self.chunk, self.received)
            estimate = estimates[row, :, :, lo - start:hi - start].float().cpu()   # [n_src, C, hi-lo]
            self._extend(estimate.shape[0], hi)
            w = self.window[lo - start:hi - start]
            self.acc[:, :, lo - self.out_base:hi - self.out_base] += estimate * w
            self.wsum[lo - self.out_base:hi - self.out_base] += w
        del estimates
        if self.on_chunks is not None:
            self.on_chunks(len(indices))

    def _extend(self, n_src: int, end: int) -> None:
        """Grow the buffer with zeros so that it reaches signal position `end`."""
        if self.acc is None:
            self.acc = torch.zeros(n_src, self.channels, 0)
        grow = end - self.out_base - self.acc.shape[-1]
        if grow > 0:
            self.acc = torch.cat([self.acc, torch.zeros(n_src, self.channels, grow)], dim=-1)
            self.wsum = torch.cat([self.wsum, torch.zeros(grow)])

    def _finished(self, until: int) -> torch.Tensor | None:
        """Hand out the signal up to `until` (divided by its summed window), without the delay."""
        count = min(until, self.out_base + (self.acc.shape[-1] if self.acc is not None else 0)) - self.out_base
        if count <= 0:
            return None
        out = self.acc[:, :, :count] / self.wsum[:count]
        self.acc, self.wsum = self.acc[:, :, count:].clone(), self.wsum[count:].clone()
        first = self.out_base
        self.out_base += count
        skip = max(0, self.delay - first)            # the delay's zeros are not part of the track
        return out[:, :, skip:] if skip < count else None


class ShiftAverage:
    """The mean of several OverlapAdd passes of one track, each with its own delay (random shifts:
    the chunk boundaries fall elsewhere in each pass). Same push/close interface."""

    def __init__(self, passes: list[OverlapAdd]):
        self.passes = passes
        self.ready = [[] for _ in passes]      # per pass: finished blocks not yet averaged

    def push(self, block) -> torch.Tensor | None:
        return self._average([p.push(block) for p in self.passes])

    def close(self) -> torch.Tensor | None:
        return self._average([p.close() for p in self.passes])

    def _average(self, outputs: list) -> torch.Tensor | None:
        for queue, out in zip(self.ready, outputs):
            if out is not None and out.shape[-1]:
                queue.append(out)
        count = min(sum(b.shape[-1] for b in queue) for queue in self.ready)
        if count == 0:
            return None
        total = None
        for queue in self.ready:
            joined = torch.cat(queue, dim=-1) if len(queue) > 1 else queue[0]
            part, rest = joined[..., :count], joined[..., count:]
            queue[:] = [rest.clone()] if rest.shape[-1] else []
            total = part.clone() if total is None else total.add_(part)
        return total.div_(len(self.passes))


def separate_track(
    model: torch.nn.Module,
    mixture: torch.Tensor | np.ndarray,
    chunk_samples: int,
    overlap: float,
    precision: str = "fp32",
    device: str | torch.device = "cpu",
    progress: bool = False,
    batch: int = 1,
) -> torch.Tensor:
    """Separate a whole mixture [C, S] into [n_src, C, S] (float32, on the CPU) with OverlapAdd.

    The mixture is pushed a chunk at a time (views, no copies) and each finished block is copied
    into the one output tensor, so memory is the track, its stems and one chunk batch.
    overlap: fraction of a chunk shared with the next (0 <= overlap < 1). precision: "bf16" or "fp16"
    runs the model under that autocast (on CUDA and on CPU), "fp32" without (model.step.autocast).
    """
    mixture = torch.as_tensor(mixture, dtype=torch.float32)
    if mixture.ndim != 2:
        raise ValueError(f"mixture: expected [channels, samples], got shape {tuple(mixture.shape)}")
    channels, length = mixture.shape
    stream = OverlapAdd(model, chunk_samples, overlap, precision, device, batch)
    total = len(plan_chunks(length, chunk_samples, stream.overlap))
    output, done = None, 0
    with tqdm(total=total, desc="chunks", unit="chunk", leave=False, disable=not progress) as bar:
        stream.on_chunks = bar.update

        def blocks():   # lazily: each finished block is copied out before the next is made
            for i in range(0, length, chunk_samples):
                yield stream.push(mixture[:, i:i + chunk_samples])
            yield stream.close()

        for block in blocks():
            if block is None:
                continue
            if output is None:
                output = torch.empty(block.shape[0], channels, length)
            output[:, :, done:done + block.shape[-1]] = block
            done += block.shape[-1]
    return output
