"""Separation metrics: SI-SDR and the SiSEC SDR (museval BSSEval v4).

Signals are laid out [C, S] (channels, samples), sources [n, C, S]. All sums run in float64.

- SI-SDR (Le Roux et al., 2019): the mean is removed per channel, then both channels are taken
  together as one signal: alpha = <e, r> / <r, r> over channels and time,
  SI-SDR = 10 log10(|alpha r|^2 / |alpha r - e|^2). On mono it equals torchmetrics'
  scale_invariant_signal_distortion_ratio(zero_mean=True) (same eps terms, float64 eps).
- SDR: in BSSEval v4 (time-invariant distortion filters, `bss_eval_images`) the SDR of one frame is
  exactly 10 log10(sum r^2 / sum (e - r)^2) over both channels; the filters only shape SIR/ISR/SAR.
  `framewise_sdr` reproduces museval.evaluate's SDR matrix (framing, silent frames -> NaN,
  perfect frames -> inf, estimates padded/cropped to the reference length) without the filters.
- SiSEC aggregation is museval's own (tiersep.evaluate.scoring: TrackStore quantisation, EvalStore
  medians); `museval_quantize` and `track_median` here are thin wrappers of that one path.

One implementation of each whole-signal metric: the batched torch functions (`si_sdr_torch`,
`sdr_torch`), which training validation runs on its device; `si_sdr` and `fast_sdr` wrap them for
numpy arrays. `framewise_sdr` stays numpy: it runs in the museval worker processes, which never load
torch. Undefined cases follow museval: a silent reference or estimate (every sample's channel sum is
0, museval's own test) gives NaN, which the medians skip.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch


# ---------------------------------------------------------------------------------------------
# numpy: museval framing (the museval workers never load torch) and wrappers of the torch metrics
# ---------------------------------------------------------------------------------------------
def match_length(estimate: np.ndarray, length: int) -> np.ndarray:
    """Zero-pad or crop the last axis to `length`, as museval.pad_or_truncate does to estimates."""
    have = estimate.shape[-1]
    if have > length:
        return estimate[..., :length]
    if have < length:
        pad = [(0, 0)] * (estimate.ndim - 1) + [(0, length - have)]
        return np.pad(estimate, pad)
    return estimate


def is_silent(signal: np.ndarray) -> np.ndarray:
    """museval's silence test on [..., C, S]: the channel sum is zero at every sample."""
    return np.all(np.sum(signal, axis=-2) == 0, axis=-1)


def _db(num: float, den: float) -> float:
    """10 log10(num / den) with museval's _safe_db convention: den == 0 gives +inf."""
    if den == 0:
        return float("inf")
    if num == 0:
        return float("-inf")
    return float(10 * np.log10(num / den))


def si_sdr(estimate: np.ndarray, reference: np.ndarray) -> float:
    """SI-SDR in dB of one estimate [C, S] against its reference [C, S] (`si_sdr_torch`).

    The estimate is padded/cropped to the reference length first. NaN when the reference or the
    estimate is silent (undefined: alpha is 0/0 or the target is 0).
    """
    import torch

    return float(si_sdr_torch(torch.as_tensor(np.asarray(estimate)), torch.as_tensor(np.asarray(reference))))


def fast_sdr(estimate: np.ndarray, reference: np.ndarray) -> float:
    """museval v4 SDR formula over the whole given signal [C, S] (`sdr_torch`).

    Equals museval's SDR for one frame spanning the signal. NaN when either signal is silent
    (museval's test), +inf for a perfect estimate.
    """
    import torch

    return float(sdr_torch(torch.as_tensor(np.asarray(estimate)), torch.as_tensor(np.asarray(reference))))


def frame_slices(length: int, win: int, hop: int) -> list[slice]:
    """museval's Framing: floor((S - win + hop) / hop) full frames (a partial tail is dropped);
    one frame over the whole signal when it is not longer than the window."""
    if win >= length:
        return [slice(0, length)]
    count = (length - win + hop) // hop
    return [slice(t * hop, min(t * hop + win, length)) for t in range(count)]


def framewise_sdr(estimates: np.ndarray, references: np.ndarray, win: int, hop: int) -> np.ndarray:
    """SDR per source and frame [n, frames], equal to museval.evaluate(...)[0] on the same input.

    estimates, references: [n, C, S] (all sources of the track: museval marks a frame NaN for
    every source when any reference or any estimate is silent in it). win, hop in samples.
    Converted to float64 one frame at a time, so long tracks cost no full-length copies.
    """
    references = np.asarray(references)
    estimates = match_length(np.asarray(estimates), references.shape[-1])
    if estimates.shape != references.shape:
        raise ValueError(f"estimates {estimates.shape} and references {references.shape} differ "
                         "in sources or channels")
    frames = frame_slices(references.shape[-1], win, hop)
    out = np.full((references.shape[0], len(frames)), np.nan)
    for t, span in enumerate(frames):
        ref = references[..., span].astype(np.float64)              # [n, C, frame]
        est = estimates[..., span].astype(np.float64)
        if is_silent(ref).any() or is_silent(est).any():
            continue  # NaN for every source, as museval does
        num = np.sum(ref**2, axis=(-2, -1))
        den = np.sum((est - ref) ** 2, axis=(-2, -1))
        out[:, t] = [_db(a, b) for a, b in zip(num, den)]
    return out


def stored_frames(track: str, frames: dict[str, np.ndarray], metric: str = "SDR"):
    """museval's long table (track, target, metric, time, score) of one metric's per-frame values
    {target: [frames]}, stored as museval's TrackStore stores them (1e-5 steps, inf as NaN)."""
    import museval

    store = museval.TrackStore(track_name=track, win=1.0, hop=1.0)
    for target, values in frames.items():
        values = np.asarray(values, dtype=np.float64).tolist()
        nothing = [math.nan] * len(values)
        store.add_target(target_name=target, values={"SDR": values, "SIR": nothing, "ISR": nothing,
                                                     "SAR": nothing})
    table = store.df
    return table[table.metric == "SDR"].assign(metric=metric)


def museval_quantize(values) -> np.ndarray:
    """Frame values [frames] as museval stores them (TrackStore: 1e-5 steps, inf -> NaN)."""
    flat = np.asarray(values, dtype=np.float64).ravel()
    table = stored_frames("track", {"target": flat})
    return table.sort_values("time")["score"].to_numpy(dtype=np.float64).reshape(np.shape(values))


def track_median(frame_values) -> np.ndarray:
    """SiSEC per-track score of frame values [..., frames]: museval's EvalStore median over the
    stored frames, skipping NaN (NaN when no frame is valid)."""
    import museval

    values = np.asarray(frame_values, dtype=np.float64)
    rows = values.reshape(-1, values.shape[-1])
    store = museval.EvalStore(frames_agg="median")
    store.add_track(stored_frames("track", {str(i): row for i, row in enumerate(rows)}))
    medians = store.agg_frames_scores()
    return np.array([medians[("track", str(i), "SDR")] for i in range(len(rows))]).reshape(values.shape[:-1])


# ---------------------------------------------------------------------------------------------
# torch: batched over leading axes, signals [..., C, S] (training validation, and `si_sdr`/`fast_sdr`)
# ---------------------------------------------------------------------------------------------
def _match_length_torch(estimate: "torch.Tensor", length: int) -> "torch.Tensor":
    import torch.nn.functional as F

    have = estimate.shape[-1]
    if have > length:
        return estimate[..., :length]
    if have < length:
        return F.pad(estimate, (0, length - have))
    return estimate


def _silent_torch(signal: "torch.Tensor") -> "torch.Tensor":
    return (signal.sum(dim=-2) == 0).all(dim=-1)


def si_sdr_torch(estimate: "torch.Tensor", reference: "torch.Tensor") -> "torch.Tensor":
    """Batched SI-SDR (dB, float64) of estimate [..., C, S] against reference [..., C, S] -> [...].

    Same definition as `si_sdr`; NaN where the reference or the estimate is silent (filter with
    torch.isfinite or nanmean when aggregating).
    """
    reference = reference.double()
    estimate = _match_length_torch(estimate.double(), reference.shape[-1])
    silent = _silent_torch(reference) | _silent_torch(estimate)
    reference = reference - reference.mean(dim=-1, keepdim=True)
    estimate = estimate - estimate.mean(dim=-1, keepdim=True)
    eps = float(np.finfo(np.float64).eps)
    dims = (-2, -1)
    alpha = (((estimate * reference).sum(dim=dims) + eps)
             / (reference.square().sum(dim=dims) + eps))               # [...]
    target = alpha[..., None, None] * reference                       # [..., C, S]
    ratio = (target.square().sum(dim=dims) + eps) / ((target - estimate).square().sum(dim=dims) + eps)
    value = 10 * ratio.log10()
    return value.masked_fill(silent, float("nan"))


def sdr_torch(estimate: "torch.Tensor", reference: "torch.Tensor") -> "torch.Tensor":
    """Batched museval v4 SDR formula (dB, float64) over each whole signal [..., C, S] -> [...].

    Same as `fast_sdr`: NaN where either signal is silent, +inf for a perfect estimate.
    """
    reference = reference.double()
    estimate = _match_length_torch(estimate.double(), reference.shape[-1])
    silent = _silent_torch(reference) | _silent_torch(estimate)
    num = reference.square().sum(dim=(-2, -1))
    den = (estimate - reference).square().sum(dim=(-2, -1))
    value = 10 * (num.log10() - den.log10())  # den == 0 -> +inf, as museval's _safe_db
    return value.masked_fill(silent, float("nan"))
