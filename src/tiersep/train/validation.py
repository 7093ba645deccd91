"""Validation during training: loss, SDR and SI-SDR on fixed segments of the valid split."""
from __future__ import annotations

import math

import torch

from tiersep.model.step import autocast


def validate(model, loss_fn, mixtures, stems, batch_size, preset, device) -> dict:
    """Mean loss, SDR and SI-SDR (dB, mean over segments and stems) on the fixed valid segments."""
    from tiersep.evaluate.metrics import sdr_torch, si_sdr_torch

    model.eval()
    losses, sdrs, si_sdrs = [], [], []
    with torch.no_grad():
        for start in range(0, mixtures.shape[0], batch_size):
            mix = mixtures[start:start + batch_size].to(device)      # [b, C, S]
            ref = stems[start:start + batch_size].to(device)         # [b, n, C, S]
            with autocast(preset["train"]["precision"], device.type):
                est = model(mix)
            est = est.float()                                         # [b, n, C, S]
            losses.append(loss_fn(est, ref).float() * mix.shape[0])
            sdrs.append(sdr_torch(est, ref).float().reshape(-1))
            si_sdrs.append(si_sdr_torch(est, ref).float().reshape(-1))
    model.train()
    sdr, si_sdr = torch.cat(sdrs), torch.cat(si_sdrs)
    return {"val_loss": float(torch.stack(losses).sum()) / mixtures.shape[0],
            "val_sdr": _finite_mean(sdr), "val_si_sdr": _finite_mean(si_sdr)}


def _finite_mean(values: torch.Tensor) -> float:
    finite = torch.isfinite(values)
    return float(values[finite].mean()) if finite.any() else math.nan
