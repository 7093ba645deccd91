"""Learning-rate schedules driven by the optimisation step: linear warm-up, then cosine decay to
`min_lr_ratio`, a plateau rule fed by validation loss, or a constant rate.

The schedule returns a *factor* of the preset's base lr; the trainer writes `base_lr * factor` into
the optimizer before every step. Its whole state is a small dict, saved in every checkpoint, so a
resumed run continues with the exact same rates.
"""
from __future__ import annotations

import math


class Schedule:
    """lr factor as a function of the number of completed steps (plus plateau state)."""

    def __init__(self, train: dict):
        self.kind = train["schedule"]
        self.total = int(train["steps"])
        self.warmup = int(train["warmup_steps"])
        self.min_ratio = float(train["min_lr_ratio"])
        self.patience = int(train["plateau_patience"])
        self.decay = float(train["plateau_factor"])
        # Plateau state: the current factor, the best validation loss seen, validations without gain.
        self.plateau_scale = 1.0
        self.best = math.inf
        self.bad = 0

    def factor(self, step: int) -> float:
        """Factor for the optimisation step that follows `step` completed steps (0-based)."""
        if self.warmup and step < self.warmup:
            # Linear ramp that reaches 1 at the end of warm-up (never exactly 0: step 0 still learns).
            return (step + 1) / (self.warmup + 1)
        if self.kind == "cosine":
            span = max(1, self.total - self.warmup)
            progress = min(1.0, (step - self.warmup) / span)
            return self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
        if self.kind == "plateau":
            return self.plateau_scale
        return 1.0

    def observe(self, val_loss: float) -> None:
        """Plateau rule: after `patience` validations without a 0.1 % lower loss, scale the lr."""
        if self.kind != "plateau" or not math.isfinite(val_loss):
            return
        if val_loss < self.best * (1 - 1e-3):
            self.best, self.bad = val_loss, 0
            return
        self.bad += 1
        if self.bad >= self.patience:
            self.plateau_scale = max(self.min_ratio, self.plateau_scale * self.decay)
            self.bad = 0

    def state_dict(self) -> dict:
        return {"kind": self.kind, "plateau_scale": self.plateau_scale, "best": self.best, "bad": self.bad}

    def load_state_dict(self, state: dict) -> None:
        self.plateau_scale = float(state["plateau_scale"])
        self.best = float(state["best"])
        self.bad = int(state["bad"])
