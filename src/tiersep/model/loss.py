"""Training loss: weighted time-domain L1 plus multi-resolution complex-STFT L1.

Both terms are linear in the error, so the STFTs are taken once, of (estimate - target), rather
than of each signal: same value, half the STFT work and memory. fp32, no data-dependent control
flow (traced on fake tensors by the memory estimator).
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from .stft import make_window, stft


def default_resolutions(n_fft: int) -> list[tuple[int, int]]:
    """n_fft/2, n_fft and 2*n_fft of the preset, each with hop = its own n_fft / 4."""
    return [(size, max(size // 4, 1)) for size in (n_fft // 2, n_fft, 2 * n_fft)]


class SeparationLoss(nn.Module):
    """loss(estimates [B, n, C, S], targets [B, n, C, S]) -> 0-dim tensor.

    time_weight * mean |e| + stft_weight * mean over resolutions of mean |Re E|, |Im E|, where
    e = estimates - targets and E its STFT (Hann window, centred, zero padded, scaled by
    1/sqrt(n_fft) so that both terms are of similar size).
    """

    def __init__(self, time_weight: float, stft_weight: float, resolutions: list[tuple[int, int]]):
        super().__init__()
        if stft_weight > 0 and not resolutions:
            raise ValueError("train.loss.stft_resolutions: empty while train.loss.stft_l1 > 0")
        for size, hop in resolutions:
            if hop > size:
                raise ValueError(f"train.loss.stft_resolutions: hop {hop} exceeds n_fft {size}")
        self.time_weight, self.stft_weight = time_weight, stft_weight
        self.resolutions = [(int(size), int(hop)) for size, hop in resolutions]

    def forward(self, estimates: Tensor, targets: Tensor) -> Tensor:
        terms = self.terms(estimates, targets)
        return terms["time_l1"] + terms["stft_l1"] if "stft_l1" in terms else terms["time_l1"]

    def terms(self, estimates: Tensor, targets: Tensor) -> dict[str, Tensor]:
        """The loss's weighted terms, which sum to its value: {"time_l1", "stft_l1" (when weighted)}
        (validation logs each: tiersep.train.validation)."""
        if estimates.shape != targets.shape:
            raise ValueError(f"loss: estimates {tuple(estimates.shape)} and targets "
                             f"{tuple(targets.shape)} differ in shape")
        with torch.autocast(estimates.device.type, enabled=False):
            error = estimates.float() - targets.float()  # [B, n, C, S]
            out = {"time_l1": self.time_weight * error.abs().mean()}
            if self.stft_weight > 0:
                terms = []
                for size, hop in self.resolutions:
                    window = make_window("hann", size, device=error.device)
                    spec = stft(error, size, hop, window, normalized=True, pad_mode="constant")
                    terms.append(torch.view_as_real(spec).abs().mean())  # [B, n, C, F, T, 2] -> 0-dim
                out["stft_l1"] = self.stft_weight * torch.stack(terms).mean()
        return out


def build_loss(preset: dict) -> SeparationLoss:
    """The loss preset["train"]["loss"] describes."""
    cfg = preset["train"]["loss"]
    resolutions = cfg["stft_resolutions"] or default_resolutions(preset["audio"]["n_fft"])
    return SeparationLoss(cfg["time_l1"], cfg["stft_l1"], [tuple(r) for r in resolutions])
