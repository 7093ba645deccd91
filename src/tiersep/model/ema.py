"""EMA weights (train.ema): an exponential moving average of the model's parameters, kept beside them.

After every `every`-th optimizer step: ema <- decay * ema + (1 - decay) * weights, as one
torch._foreach_lerp_ over the parameter list (what torch.optim.swa_utils.get_ema_multi_avg_fn runs),
in place, so the update allocates nothing. The copy starts as the initial weights. It is fp32 like
the parameters (bf16 training keeps fp32 weights under autocast) and lives on their device.

Buffers are not averaged: the EMA model runs with the raw model's buffers (torch.func.functional_call
substitutes only the parameters). TF-Locoformer has none today, so an EMA state is its parameters.
On a data-parallel tier each rank averages its unwrapped module (the ranks' weights are identical),
so their EMAs are identical too, and rank 0 saves it.

It lives here, beside the training step, because the memory estimate traces the step with its EMA
update (model/step.py train_step): what the estimate counts is what the trainer runs.
"""
from __future__ import annotations

import torch
from torch.func import functional_call


class Ema:
    """The EMA copy of `model`'s parameters; `update` after each optimizer step. `model` is the
    unwrapped module: its parameters are the ones DDP and torch.compile step too."""

    def __init__(self, model: torch.nn.Module, decay: float, every: int):
        self.decay, self.every = float(decay), int(every)
        self.names = [name for name, _ in model.named_parameters()]
        self.sources = [p for _, p in model.named_parameters()]
        with torch.no_grad():
            self.params = [p.detach().clone() for p in self.sources]
        self.steps = 0   # optimizer steps seen (the update runs when it is a multiple of `every`)

    @classmethod
    def from_preset(cls, model: torch.nn.Module, preset: dict) -> "Ema | None":
        """The preset's EMA of `model`, or None when train.ema is off."""
        spec = preset["train"].get("ema")
        return cls(model, spec["decay"], spec["every"]) if spec else None

    @torch.no_grad()
    def update(self) -> None:
        """Count one optimizer step; average on every `every`-th."""
        self.steps += 1
        if self.steps % self.every:
            return
        torch._foreach_lerp_(self.params, [p.detach() for p in self.sources], 1.0 - self.decay)

    def state_dict(self) -> dict:
        """What a checkpoint carries: the averaged parameters by name, and the step count."""
        return {"params": dict(zip(self.names, self.params)), "steps": self.steps,
                "decay": self.decay, "every": self.every}

    def load_state_dict(self, state: dict) -> None:
        with torch.no_grad():
            for name, param in zip(self.names, self.params):
                param.copy_(state["params"][name])
        self.steps = int(state["steps"])

    def weights(self, model: torch.nn.Module) -> dict:
        """`model`'s state_dict with the averaged parameters in place of its own (what model.pt holds)."""
        return with_averaged(model.state_dict(), dict(zip(self.names, self.params)))

    def module(self, model: torch.nn.Module) -> "EmaModule":
        """A callable that runs `model` with the averaged parameters (validation)."""
        return EmaModule(model, dict(zip(self.names, self.params)))


def with_averaged(state_dict: dict, averaged: dict) -> dict:
    """`state_dict` with the averaged parameters (by name) in place of its own; buffers stay."""
    return {k: averaged.get(k, v) for k, v in state_dict.items()}


class EmaModule:
    """`model` called with the EMA parameters in place of its own (no copy of the model is made);
    train()/eval() switch the model itself, as validate() expects of a module."""

    def __init__(self, model: torch.nn.Module, params: dict):
        self.model, self.params = model, params

    def __call__(self, *args):
        return functional_call(self.model, self.params, args)

    def eval(self):
        self.model.eval()
        return self

    def train(self, mode: bool = True):
        self.model.train(mode)
        return self
