"""Resampling a stream block by block, exactly as prepare resamples a whole track.

torchaudio.functional.resample is a polyphase FIR filter: after reducing the rates by their gcd
(orig -> new), each group of `orig` input samples gives `new` output samples, computed from the
input around the group with a fixed kernel (`width` samples of context on each side). So a stream
can be resampled group by group as soon as the context after a group has arrived, with the same
kernel and the same arithmetic as the whole track: the same numbers (up to the convolution's
float rounding) whatever the block sizes. The settings are prepare's (data.prepare.RESAMPLING), so
a song is resampled as the training data was.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F


class StreamResampler:
    """push(block [C, n]) -> the resampled samples ready so far [C, m] (or None); close() -> the
    rest (or None). The total output length is ceil(total input * new / orig), as torchaudio's."""

    def __init__(self, orig_rate: int, new_rate: int):
        from torchaudio.functional.functional import _get_sinc_resample_kernel

        from tiersep.data.prepare import RESAMPLING

        self.identity = orig_rate == new_rate
        gcd = math.gcd(int(orig_rate), int(new_rate))
        self.orig, self.new = orig_rate // gcd, new_rate // gcd
        if not self.identity:
            self.kernel, self.width = _get_sinc_resample_kernel(orig_rate, new_rate, gcd, **RESAMPLING,
                                                                dtype=torch.float32)
        else:
            self.kernel, self.width = None, 0
        self.buffer = None        # [C, n]: input from position base - width on (front zeros included)
        self.group = 0            # next output group to compute
        self.received = 0

    def push(self, block: torch.Tensor) -> torch.Tensor | None:
        block = torch.as_tensor(block, dtype=torch.float32)
        if self.identity:
            return block
        if self.buffer is None:
            self.buffer = torch.zeros(block.shape[0], self.width)   # torchaudio pads `width` zeros in front
        self.buffer = torch.cat([self.buffer, block], dim=1)
        self.received += block.shape[1]
        # group g reads padded input [g*orig, g*orig + 2*width + orig): ready once it has all arrived
        ready = (self.buffer.shape[1] - 2 * self.width) // self.orig
        return self._groups(ready)

    def close(self) -> torch.Tensor | None:
        if self.identity or self.buffer is None:
            return None
        total = math.ceil(self.new * self.received / self.orig)
        done = self.group * self.new                                    # emitted before close
        self.buffer = F.pad(self.buffer, (0, self.width + self.orig))   # torchaudio's end padding
        out = self._groups((self.buffer.shape[1] - 2 * self.width) // self.orig)
        keep = total - done
        return out[:, :keep] if out is not None and keep > 0 else None

    def _groups(self, count: int) -> torch.Tensor | None:
        channels = self.buffer.shape[0]
        if count <= 0:
            return None
        span = (count - 1) * self.orig + 2 * self.width + self.orig
        out = F.conv1d(self.buffer[:, None, :span], self.kernel, stride=self.orig)   # [C, new, count]
        out = out.transpose(1, 2).reshape(channels, -1)
        self.buffer = self.buffer[:, count * self.orig:].clone()        # keep the context of the next group
        self.group += count
        return out
