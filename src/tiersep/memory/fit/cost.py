"""What a fit lever costs besides memory: the extra compute of per-block checkpointing.

Checkpointing keeps each block's input and runs the block's forward again inside backward, so a
step computes the blocks' forward twice. Its cost is counted, not guessed: the FLOPs of one
block's forward and of the rest of the model (encoder, decoder) at the variant's segment, by
torch.utils.flop_counter on fake tensors (no memory, about 0.2 s). Backward is taken as twice
the forward, as torch's FLOP formulas count matmuls and convolutions, so

    extra = L * block / (3 * (rest + L * block))

which is about 1/3 for these models (the blocks are >99% of the FLOPs). Matmuls, convolutions and
attention are counted; elementwise ops, norms and FFTs are not (they are memory-bound).
"""
from __future__ import annotations

import copy
import functools
import json


def recompute_fraction(preset: dict) -> float:
    """Extra compute of `preset` with per-block checkpointing, as a fraction of a step without it.
    Depends on the model and the segment, not on the micro-batch or the precision."""
    key = {"audio": preset["audio"], "model": {k: v for k, v in preset["model"].items() if k != "checkpointing"}}
    return _recompute_fraction(json.dumps(key, sort_keys=True, default=str))


@functools.lru_cache(maxsize=256)
def _recompute_fraction(key: str) -> float:
    block, rest = _forward_flops(json.loads(key))
    layers = json.loads(key)["model"]["n_layers"]
    total = rest + layers * block
    return layers * block / (3 * total) if total else 0.0


def _forward_flops(preset: dict) -> tuple[int, int]:
    """(FLOPs of one block's forward, FLOPs of the rest of the forward) of micro-batch 1."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode

    from tiersep.model import build_model

    one = copy.deepcopy(preset)
    one["model"].update(n_layers=1, checkpointing=False)
    with FakeTensorMode():
        model = build_model(one)
        model.train()
        mixture = torch.empty(1, one["audio"]["channels"], one["audio"]["segment_samples"])
        with FlopCounterMode(display=False) as counter:
            model(mixture)
    per_module = counter.get_flop_counts()
    block = sum(sum(ops.values()) for name, ops in per_module.items() if name.endswith(".blocks.0"))
    return block, counter.get_total_flops() - block
