"""One training step's state, built alike for the trace (fake tensors) and for measure (real ones).

The EMA copy of the weights (train.ema) is made where the trainer makes it: right after the model is
on the device, before the optimizer's state. Steady state, not the first step: AdamW's state (exp_avg, exp_avg_sq) exists before the step, as in
every step after the first, and every micro-batch's inputs are resident, as the trainer moves the
whole effective batch to the device before the step.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from tiersep.model import build_loss, build_model
from tiersep.model.ema import Ema
from tiersep.model.step import make_optimizer


@dataclass
class Workload:
    model: torch.nn.Module
    loss_fn: Callable
    optimizer: torch.optim.Optimizer
    params: list
    inputs: list       # [(mixture [B, C, S], stems [B, n_src, C, S])] * grad_accum
    ema: Ema | None = None   # train.ema's copy of the weights, updated by train_step

    def optimizer_state(self) -> list[torch.Tensor]:
        return [v for s in self.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]


def build_workload(preset: dict, device_type: str, make_input: Callable[..., torch.Tensor],
                   model_and_loss: Callable | None = None, move: bool = True) -> Workload:
    """Model, loss and AdamW (with its state) as the trainer makes them for `device_type` (moved
    there unless `move` is False: the trace builds on fake CPU tensors), and `grad_accum`
    micro-batches made by `make_input(*shape)`. Under FakeTensorMode nothing is allocated."""
    a, t = preset["audio"], preset["train"]
    model, loss_fn = (model_and_loss or (lambda p: (build_model(p), build_loss(p))))(preset)
    if move:
        model = model.to(device_type)
        if isinstance(loss_fn, torch.nn.Module):
            loss_fn = loss_fn.to(device_type)
    model.train()
    ema = Ema.from_preset(model, preset)
    optimizer = make_optimizer(model, preset, device_type)
    params = list(model.parameters())
    for p in params:   # AdamW state as after the first step
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    batch, n_src = t["batch_size"], len(preset["model"]["sources"])
    shape = (batch, a["channels"], a["segment_samples"])
    inputs = [(make_input(*shape), make_input(batch, n_src, *shape[1:])) for _ in range(t["grad_accum"])]
    return Workload(model, loss_fn, optimizer, params, inputs, ema)
