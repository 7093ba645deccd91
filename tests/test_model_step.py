"""The one autocast rule (model/step.py), as the training step and separation use it."""
from __future__ import annotations

import pytest
import torch

from tiersep.model.step import autocast


def _inside(context) -> tuple[bool, torch.dtype]:
    with context:
        return torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")


def test_bf16_runs_under_bf16_autocast_for_training_and_separation():
    for outer_off in (False, True):
        assert _inside(autocast("bf16", "cpu", outer_off=outer_off)) == (True, torch.bfloat16)


def test_fp16_runs_under_float16_autocast():
    for outer_off in (False, True):
        assert _inside(autocast("fp16", "cpu", outer_off=outer_off)) == (True, torch.float16)


def test_fp32_adds_nothing_for_the_training_step():
    assert _inside(autocast("fp32", "cpu"))[0] is False
    with torch.autocast("cpu", dtype=torch.bfloat16):          # a caller's autocast is left as it is
        assert _inside(autocast("fp32", "cpu"))[0] is True


def test_fp32_turns_a_surrounding_autocast_off_for_separation():
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert _inside(autocast("fp32", "cpu", outer_off=True))[0] is False
        assert torch.is_autocast_enabled("cpu")                  # and back on after it


def test_an_unknown_precision_is_refused_by_both():
    for outer_off in (False, True):
        with pytest.raises(ValueError, match=r"precision: 'fp8' is not one of fp32, bf16, fp16"):
            autocast("fp8", "cpu", outer_off=outer_off)
