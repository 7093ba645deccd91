"""The train job: what one `tiersep train` was asked to do, settled once in tiersep.train.trainer.train
and passed whole to the plan, the launcher and the loop (instead of eight parameters each)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class TrainJob:
    cfg: dict                           # the resolved config (on_oversize, estimate settings, budget)
    preset: dict                        # the preset as asked; the plan trains a copy (downshifted, adapted)
    data_dir: Path                      # the prepared data folder
    out_dir: Path                       # the run folder
    resume: bool = False                # --resume: continue from checkpoints/last.pt when it is this run's
    estimate_path: Path | None = None   # the workflow's estimate record, reused when made for this run
    attempt: int = 1                    # the workflow's attempt: after an OOM, a smaller micro-batch
    outcome_path: Path | None = None    # the workflow's outcome.json: a refusal is then an outcome
    wall_start: float = field(default_factory=time.time)   # when the job started (run.json wall_seconds)
