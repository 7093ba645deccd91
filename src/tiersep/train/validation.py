"""Validation during training: loss, SDR and SI-SDR on fixed segments of the valid split."""
from __future__ import annotations

import math

import torch

from tiersep.model.step import autocast


def validate(model, loss_fn, mixtures, stems, batch_size, preset, device,
             audio_samples: int = 0) -> tuple[dict, dict]:
    """(scores, audio). scores: mean loss, SDR and SI-SDR (dB, mean over segments and stems),
    val_si_sdr_<stem> per stem and val_loss_<term> per loss term (time_l1, stft_l1); audio: the first `audio_samples` of the mixture and of each stem's
    estimate, mono (tiersep.train.tracking.validation_audio; empty when 0)."""
    from tiersep.evaluate.metrics import sdr_torch, si_sdr_torch
    from tiersep.train.tracking import validation_audio

    sources = list(preset["model"]["sources"])
    model.eval()
    losses, sdrs, si_sdrs, heard_mix, heard_est = [], [], [], [], []
    heard, term_sums = 0, {}
    with torch.no_grad():
        for start in range(0, mixtures.shape[0], batch_size):
            mix = mixtures[start:start + batch_size].to(device)      # [b, C, S]
            ref = stems[start:start + batch_size].to(device)         # [b, n, C, S]
            with autocast(preset["train"]["precision"], device.type):
                est = model(mix)
            est = est.float()                                         # [b, n, C, S]
            terms = loss_fn.terms(est, ref)
            for name, value in terms.items():
                term_sums[name] = term_sums.get(name, 0.0) + float(value) * mix.shape[0]
            losses.append(sum(terms.values()).float() * mix.shape[0])
            sdrs.append(sdr_torch(est, ref).float().reshape(-1))
            si_sdrs.append(si_sdr_torch(est, ref).float())            # [b, n]
            if heard < audio_samples:   # only the segments the clips need, in mono: [k, S], [k, n, S]
                k = -(-(audio_samples - heard) // mix.shape[-1])
                heard_mix.append(mix[:k].float().mean(dim=1).cpu())
                heard_est.append(est[:k].mean(dim=2).cpu())
                heard += heard_mix[-1].numel()
    model.train()
    sdr, si_sdr = torch.cat(sdrs), torch.cat(si_sdrs)
    scores = {"val_loss": float(torch.stack(losses).sum()) / mixtures.shape[0],
              "val_sdr": _finite_mean(sdr), "val_si_sdr": _finite_mean(si_sdr.reshape(-1))}
    scores.update({f"val_si_sdr_{stem}": _finite_mean(si_sdr[:, i]) for i, stem in enumerate(sources)})
    scores.update({f"val_loss_{name}": total / mixtures.shape[0] for name, total in term_sums.items()})
    audio = (validation_audio(torch.cat(heard_mix), torch.cat(heard_est), sources, audio_samples)
             if heard_mix else {})
    return scores, audio


def _finite_mean(values: torch.Tensor) -> float:
    finite = torch.isfinite(values)
    return float(values[finite].mean()) if finite.any() else math.nan
