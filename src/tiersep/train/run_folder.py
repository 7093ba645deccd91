"""The run folder before a run trains: a new run moves the earlier one aside, a longer one keeps the
finished model, a resumed one says so (nothing is deleted; tiersep.outputs.move_aside)."""
from __future__ import annotations

import sys
from pathlib import Path

from tiersep.outputs import move_aside
from tiersep.train import record
from tiersep.train.job import TrainJob
from tiersep.train.plan import RunPlan
from tiersep.train.resume import extension


def settle_run_folder(plan: RunPlan, job: TrainJob) -> dict:
    """Before training: a new run moves the old one aside, a longer one keeps the finished model,
    a resumed one says so. Returns the history run.json records."""
    out_dir, name = job.out_dir, job.preset["name"]
    history = {}
    if plan.resume is None:
        why = plan.not_resumed or "a new run was asked for (train without --resume)"
        moved = move_aside(out_dir, why) if record.has_results(out_dir) else None
        if moved or plan.not_resumed:
            print(f"tiersep train: {why}; " + (f"the earlier run is kept in {moved}; " if moved else "")
                  + "starting a new run", file=sys.stderr)
        history["moved_aside"] = {"to": str(moved), "reason": why} if moved else None
    else:
        grown = extension(plan.resume, plan.preset)
        if grown is not None:
            kept = keep_finished(out_dir, f"train.steps grew from {grown['steps']} to {plan.preset['train']['steps']}")
            print(f"tiersep train: training longer: {name} continues from step {grown['step']} "
                  f"(train.steps {grown['steps']} -> {plan.preset['train']['steps']}; the lr schedule follows "
                  "the new step count from here)" + (f"; the finished model is kept in {kept}" if kept else ""),
                  file=sys.stderr)
            history["extended_from"] = list(plan.resume["run"].get("extended_from") or []) + [grown]
        else:
            print(f"tiersep train: resuming {name} from step {plan.resume['step']} "
                  f"({out_dir / 'checkpoints'})", file=sys.stderr)
    (out_dir / "failure.json").unlink(missing_ok=True)   # superseded: this attempt trains (run.json keeps an OOM)
    return history


def keep_finished(out_dir: Path, reason: str) -> Path | None:
    """Before a finished run trains longer: its model.pt and run.json, hard-linked (no copy) into
    previous/<time>/, so the shorter run's model survives the longer one's export."""
    return move_aside(out_dir, reason, names=record.FINISHED, link=True)

