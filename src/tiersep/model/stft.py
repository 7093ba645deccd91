"""STFT and an overlap-add iSTFT, both in fp32 and safe under FakeTensorMode.

torch.istft checks that the window envelope is non-zero with a data-dependent test, which fails on
fake tensors (the memory estimator traces the training step on them); the inverse here is the same
arithmetic (irfft, synthesis window, overlap-add, divide by the summed squared window) written with
F.fold and no data-dependent control flow.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

WINDOWS = ("hann", "sqrt_hann", "hamming")


def make_window(name: str, n_fft: int, device=None) -> Tensor:
    """Periodic analysis/synthesis window of length n_fft, fp32."""
    if name == "hann":
        return torch.hann_window(n_fft, device=device)
    if name == "sqrt_hann":
        return torch.hann_window(n_fft, device=device).sqrt()
    if name == "hamming":
        return torch.hamming_window(n_fft, device=device)
    raise ValueError(f"audio.window: unknown window {name!r} (allowed: {', '.join(WINDOWS)})")


def stft(signal: Tensor, n_fft: int, hop: int, window: Tensor, normalized: bool = False,
         pad_mode: str = "reflect") -> Tensor:
    """signal [..., S] -> complex spectrum [..., F = n_fft//2 + 1, T = 1 + S // hop] (centred frames)."""
    *lead, length = signal.shape
    with torch.autocast(signal.device.type, enabled=False):
        spec = torch.stft(signal.reshape(-1, length).float(), n_fft, hop, window=window.float(),
                          center=True, pad_mode=pad_mode, normalized=normalized,
                          return_complex=True)  # [N, F, T]
    return spec.reshape(*lead, *spec.shape[-2:])


def istft(spec: Tensor, n_fft: int, hop: int, window: Tensor, length: int) -> Tensor:
    """complex spectrum [..., F, T] -> signal [..., length]; inverse of stft() above."""
    return istft_from_parts(torch.view_as_real(spec).transpose(-3, -2), n_fft, hop, window, length)


def istft_from_parts(parts: Tensor, n_fft: int, hop: int, window: Tensor, length: int) -> Tensor:
    """Real and imaginary parts [..., T, F, 2] -> signal [..., length]; the same inverse.

    Real in, real out: the complex tensor exists only as the inverse FFT's input, which is what
    torch.compile handles (inductor generates no code for complex tensors; it calls the FFT).
    The FFT runs over the last axis of a contiguous [N, T, F] tensor, so the real FFT in its
    backward returns a contiguous result on every device, as inductor's shape rules predict.
    """
    *lead, n_frames, n_freq, _ = parts.shape
    with torch.autocast(parts.device.type, enabled=False):
        window = window.float()
        bins = torch.view_as_complex(parts.float().reshape(-1, n_frames, n_freq, 2).contiguous())
        frames = torch.fft.irfft(bins, n=n_fft, dim=-1) * window  # [N, T, n_fft]
        total = n_fft + hop * (n_frames - 1)
        fold = dict(output_size=(1, total), kernel_size=(1, n_fft), stride=(1, hop))
        signal = F.fold(frames.transpose(1, 2), **fold).reshape(-1, total)  # [N, total]
        envelope = F.fold((window ** 2)[None, :, None].expand(1, n_fft, n_frames), **fold)
        envelope = envelope.reshape(1, total)
        # Where no frame reaches (only possible with hop > n_fft / 2 at the edges) leave zeros.
        signal = signal / torch.where(envelope > 1e-11, envelope, torch.ones_like(envelope))
        start = n_fft // 2  # undo the centre padding
        signal = signal[:, start:start + length]  # [N, <= length]
        if signal.shape[-1] < length:  # frames may stop short of the end when hop > n_fft / 2
            signal = F.pad(signal, (0, length - signal.shape[-1]))
    return signal.reshape(*lead, length)
