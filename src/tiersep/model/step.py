"""One optimisation step and the autocast rule, shared by the trainer, the memory estimator and
separation.

The estimator traces exactly this code on fake tensors, so what it predicts is what the trainer
runs: keep every allocation of a training step here (autocast, accumulation, clipping, AdamW).
Nothing here calls .item() or syncs (except fp16's LossScaler, which reads its inf flag to decide
whether the step happens): callers read the returned tensors when they need numbers.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterable

import torch


PRECISIONS = ("fp32", "bf16", "fp16")
# train.precision may also be `auto`, resolved for the device before anything runs (resolve_precision)
_HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}
# fp16 loss scaling: a run whose every step skipped this many times in a row stops (scale_collapsed).
# From GradScaler's initial 2**16 the scale has then halved to 2**-9: gradients that still overflow
# fp16 there are not a scaling problem but non-finite values in the forward pass or the data.
MAX_SKIPPED_IN_A_ROW = 25


def resolve_precision(precision: str, device_type: str, bf16_native: bool) -> str:
    """train.precision as it will run: `auto` is bf16 on a GPU with native bf16 (sm80+), fp16 with
    the loss scaler on an older one (where bf16 would be emulated, and the fused attention kernels
    refuse it), and fp32 on a CPU (whose autocast is slow in either 16-bit type without AMX)."""
    if precision != "auto":
        return precision
    if device_type != "cuda":
        return "fp32"
    return "bf16" if bf16_native else "fp16"


def autocast_dtype(precision: str) -> torch.dtype | None:
    """The dtype autocast runs the model's matmuls and convolutions in: bf16/fp16, None for fp32."""
    return _HALF.get(precision)


def autocast(precision: str, device_type: str, *, outer_off: bool = False):
    """The one autocast rule of the model, training or separating: bf16 and fp16 run under autocast
    of that dtype (norms, RoPE and STFT opt out inside the model); fp32 runs as it is. outer_off: under
    fp32, turn off an autocast that the caller may be inside (separation, where the model must run in
    fp32 as asked whatever surrounds it); without it fp32 adds no context at all, so the training step
    and its trace on fake tensors dispatch exactly as before. An unknown precision is a ValueError."""
    if precision in _HALF:
        return torch.autocast(device_type=device_type, dtype=_HALF[precision])
    if precision != "fp32":
        raise ValueError(f"precision: {precision!r} is not one of {', '.join(PRECISIONS)}")
    return torch.autocast(device_type=device_type, enabled=False) if outer_off else contextlib.nullcontext()


class LossScaler:
    """fp16's gradient scaler (torch.amp.GradScaler on the step's device type) and the steps it
    skipped: a step whose scaled gradients hold an inf or NaN does not move the weights (nor the
    EMA), and the scale halves. State: the scaler's and the skip counts, for checkpoints."""

    def __init__(self, device_type: str):
        self.scaler = torch.amp.GradScaler(device_type)
        self.skipped = 0          # steps skipped in the whole run
        self.in_a_row = 0         # steps skipped since the last one that stepped

    @classmethod
    def from_preset(cls, preset: dict, device_type: str) -> "LossScaler | None":
        return cls(device_type) if preset["train"]["precision"] == "fp16" else None

    @property
    def collapsed(self) -> bool:
        return self.in_a_row >= MAX_SKIPPED_IN_A_ROW

    def scale(self) -> float:
        return float(self.scaler.get_scale())

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """The optimizer step unless the gradients are not finite; update the scale. Whether it stepped."""
        before = self.scaler.get_scale()
        self.scaler.step(optimizer)
        self.scaler.update()
        stepped = self.scaler.get_scale() >= before    # a skipped step backs the scale off
        self.skipped, self.in_a_row = (self.skipped, 0) if stepped else (self.skipped + 1, self.in_a_row + 1)
        return stepped

    def state_dict(self) -> dict:
        return {"scaler": self.scaler.state_dict(), "skipped": self.skipped, "in_a_row": self.in_a_row}

    def load_state_dict(self, state: dict) -> None:
        self.scaler.load_state_dict(state["scaler"])
        self.skipped, self.in_a_row = int(state["skipped"]), int(state["in_a_row"])


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
    scaler: LossScaler | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward/backward every micro-batch (mixture [B, C, S], stems [B, n_src, C, S]), clip, step.

    The loss of each micro-batch is divided by the number of micro-batches, so accumulating
    `grad_accum` micro-batches of size b gives the gradient of one batch of size b*grad_accum; under
    DistributedDataParallel the ranks' gradients are then averaged, which gives that of one batch of
    size b*grad_accum*ranks (each rank's micro-batches the same size).
    `ema` (model/ema.py, train.ema): its update follows the optimizer step, inside the step the
    estimate traces. `scaler` (train.precision fp16): each micro-batch's loss is scaled before its
    backward, the gradients unscaled before clipping, and a step with non-finite gradients skipped,
    EMA update included (the scaler syncs to decide; the estimate traces the step without it).
    Returns (mean loss, gradient norm before clipping) as 0-dim tensors.
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
            (scaler.scaler.scale(loss) if scaler is not None else loss).backward()
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
    if scaler is not None:
        scaler.scaler.unscale_(optimizer)   # clip (and report) the true gradient norm
    clip = preset["train"]["clip"]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"),
                                               foreach=(device_type == "cuda"))
    if scaler is None:
        optimizer.step()
        stepped = True
    else:
        stepped = scaler.step(optimizer)
    if ema is not None and stepped:
        ema.update()
    return total, grad_norm
