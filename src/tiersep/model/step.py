"""One optimisation step and the autocast rule, shared by the trainer, the memory estimator and
separation.

The estimator traces exactly this code on fake tensors, so what it predicts is what the trainer
runs: keep every allocation of a training step here (autocast, accumulation, clipping, AdamW).
Nothing here calls .item() or syncs: callers read the returned tensors when they need numbers.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterable

import torch


PRECISIONS = ("fp32", "bf16")


def autocast(precision: str, device_type: str, *, outer_off: bool = False):
    """The one autocast rule of the model, training or separating: bf16 runs under bf16 autocast
    (norms, RoPE and STFT opt out inside the model); fp32 runs as it is. outer_off: under fp32, turn
    off an autocast that the caller may be inside (separation, where the model must run in fp32 as
    asked whatever surrounds it); without it fp32 adds no context at all, so the training step and
    its trace on fake tensors dispatch exactly as before. An unknown precision is a ValueError."""
    if precision == "bf16":
        return torch.autocast(device_type=device_type, dtype=torch.bfloat16)
    if precision != "fp32":
        raise ValueError(f"precision: {precision!r} is not one of {', '.join(PRECISIONS)}")
    return torch.autocast(device_type=device_type, enabled=False) if outer_off else contextlib.nullcontext()


def make_optimizer(model: torch.nn.Module, preset: dict, device_type: str) -> torch.optim.AdamW:
    """AdamW as the trainer uses it; foreach (multi-tensor) on CUDA as torch defaults there."""
    t = preset["train"]
    return torch.optim.AdamW(
        model.parameters(), lr=t["lr"], weight_decay=t["weight_decay"], betas=tuple(t["betas"]),
        foreach=(device_type == "cuda"),
    )


def train_step(
    model: torch.nn.Module,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    optimizer: torch.optim.Optimizer,
    micro_batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    preset: dict,
    device_type: str,
    ema=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward/backward every micro-batch (mixture [B, C, S], stems [B, n_src, C, S]), clip, step.

    The loss of each micro-batch is divided by the number of micro-batches, so accumulating
    `grad_accum` micro-batches of size b gives the gradient of one batch of size b*grad_accum; under
    DistributedDataParallel the ranks' gradients are then averaged, which gives that of one batch of
    size b*grad_accum*ranks (each rank's micro-batches the same size).
    `ema` (model/ema.py, train.ema): its update follows the optimizer step, inside the step the
    estimate traces. Returns (mean loss, gradient norm before clipping) as 0-dim tensors.
    """
    micro_batches = list(micro_batches)
    n = len(micro_batches)
    optimizer.zero_grad(set_to_none=True)
    total = None
    for index, (mixture, stems) in enumerate(micro_batches):
        # DistributedDataParallel all-reduces gradients in backward: only the last micro-batch's
        # needs to, the others accumulate locally (no_sync covers its forward and backward)
        sync = model.no_sync() if index < n - 1 and hasattr(model, "no_sync") else contextlib.nullcontext()
        with sync:
            with autocast(preset["train"]["precision"], device_type):
                estimates = model(mixture)
            loss = loss_fn(estimates.float(), stems) / n
            loss.backward()
        # Drop this micro-batch's estimates and autograd graph now, not when the next forward
        # reassigns them: the graph's hundreds of small C++ nodes, made between the activations,
        # fence the heap holes those leave, and on a CPU with glibc's malloc the next micro-batch's
        # activations (posix_memalign asks 96 bytes more than an exact hole) could not reuse them:
        # each accumulating step grew by a micro-batch's heap (issue 21, docs/memory.md). Estimates
        # first, before any op: the trace ends a micro-batch at the first op after backward.
        del estimates
        total = loss.detach() if total is None else total + loss.detach()
        del loss
    params = [p for p in model.parameters() if p.grad is not None]
    clip = preset["train"]["clip"]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"),
                                               foreach=(device_type == "cuda"))
    optimizer.step()
    if ema is not None:
        ema.update()
    return total, grad_norm
