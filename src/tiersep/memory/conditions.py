"""What an estimate models, decided once per estimate and passed on: the device, the precision, the
attention kernel, the CUDA allocator mode, the compiled or eager step and the ranks.

Each of these used to be asked again wherever it mattered (the attention kernel in estimate.py,
analytic.py, fit/search.py and inference.py; the allocator mode four times in one estimate); a
`Conditions` is made at the start of an estimate (`decide`) and every part reads it from there, so
all parts of one record describe the same run. A fit search decides once per variant it weighs.
"""
from __future__ import annotations

from dataclasses import dataclass

from tiersep.device import planned_allocator
from tiersep.model.compile import compiles

from .trace import modelled_backend


@dataclass(frozen=True)
class Conditions:
    device: str                 # cuda | cpu: what the estimate models (no GPU is needed for cuda)
    precision: str              # fp32 | bf16 | fp16: train.precision, the autocast dtype (model.step.autocast)
    attention: str              # the SDPA kernel assumed: flash | efficient | math (trace/attention.py)
    expandable_segments: bool   # the CUDA caching allocator's mode (device.planned_allocator); False on cpu
    compiled: bool              # the torch.compile'd step (model.compile.compiles) or the eager one
    ranks: int                  # data-parallel ranks (train.ranks): >1, the figures are a rank's

    @property
    def data_parallel(self) -> bool:
        return self.ranks > 1

    def allocator_record(self) -> dict | None:
        """The record's `allocator` field: the mode modelled on cuda, None on cpu."""
        return {"expandable_segments": self.expandable_segments} if self.device == "cuda" else None


def decide(preset: dict, device: str, compiled: bool | None = None) -> Conditions:
    """The conditions an estimate of `preset` on `device` models. `compiled` None: as the preset
    will run (model.compile.compiles). A CUDA kernel the preset cannot run is a ConfigError here."""
    t = preset["train"]
    return Conditions(
        device=device,
        precision=t["precision"],
        attention=modelled_backend(preset, device),
        expandable_segments=bool(planned_allocator(preset)["expandable_segments"]) if device == "cuda" else False,
        compiled=compiles(preset, device) if compiled is None else bool(compiled),
        ranks=int(t.get("ranks", 1)),
    )
