"""Separate a whole track of any length by chunked overlap-add inference.

The model sees one fixed-size chunk [1, C, chunk] at a time, so its memory on the device does not
depend on the track length; each chunk's output is weighted by a smooth window and added into a
preallocated CPU buffer, and the buffer is divided by the summed window at the end. Dividing by
the summed window (not relying on the window summing to one) makes the cross-fade exact for any
chunk, overlap and track length: a model that returns its input reconstructs the input.
"""
from __future__ import annotations

import math

import numpy as np
import torch
from tqdm import tqdm


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


def _as_precision_context(precision: str, device: torch.device):
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    if precision != "fp32":
        raise ValueError(f"precision: {precision!r} is not one of fp32, bf16")
    return torch.autocast(device_type=device.type, enabled=False)


def separate(
    model: torch.nn.Module,
    mixture: torch.Tensor | np.ndarray,
    chunk_samples: int,
    overlap: float,
    precision: str = "fp32",
    device: str | torch.device = "cpu",
    progress: bool = False,
) -> torch.Tensor:
    """Separate mixture [C, S] into [n_src, C, S] (float32, on the CPU).

    model: maps [B, C, chunk] -> [B, n_src, C, chunk]; it must already be on `device` and is run
    in eval mode (its training flag is restored afterwards). overlap: fraction of a chunk shared
    with the next (0 <= overlap < 1). precision: "bf16" runs the model under bf16 autocast (on CUDA
    and on CPU), "fp32" without.
    """
    device = torch.device(device)
    mixture = torch.as_tensor(mixture, dtype=torch.float32)
    if mixture.ndim != 2:
        raise ValueError(f"mixture: expected [channels, samples], got shape {tuple(mixture.shape)}")
    if chunk_samples < 1:
        raise ValueError(f"chunk_samples: must be positive, got {chunk_samples}")
    if not 0 <= overlap < 1:
        raise ValueError(f"overlap: must be in [0, 1), got {overlap}")
    channels, length = mixture.shape
    if length == 0:
        raise ValueError("mixture: has no samples")
    overlap_samples = min(int(round(chunk_samples * overlap)), chunk_samples - 1)
    window = chunk_window(chunk_samples, overlap_samples)            # [chunk]
    starts = plan_chunks(length, chunk_samples, overlap_samples)

    output = None                                                     # [n_src, C, S], CPU
    weight = torch.zeros(length, dtype=torch.float32)                 # summed window, [S]
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode(), _as_precision_context(precision, device):
            for start in tqdm(starts, desc="chunks", unit="chunk", leave=False, disable=not progress):
                lo, hi = max(start, 0), min(start + chunk_samples, length)   # part inside the track
                piece = torch.zeros(1, channels, chunk_samples)               # zero padding outside
                piece[0, :, lo - start:hi - start] = mixture[:, lo:hi]
                estimate = model(piece.to(device, non_blocking=True))         # [1, n_src, C, chunk]
                if estimate.ndim != 4 or estimate.shape[0] != 1 or estimate.shape[2:] != (channels, chunk_samples):
                    raise ValueError(f"model returned shape {tuple(estimate.shape)} for input "
                                     f"{tuple(piece.shape)}; expected [1, n_src, {channels}, {chunk_samples}]")
                estimate = estimate[0, :, :, lo - start:hi - start].float().cpu()  # [n_src, C, hi-lo]
                if output is None:
                    output = torch.zeros(estimate.shape[0], channels, length)
                w = window[lo - start:hi - start]
                output[:, :, lo:hi] += estimate * w
                weight[lo:hi] += w
            output /= weight                                          # in place: no second copy
    finally:
        model.train(was_training)
    return output
