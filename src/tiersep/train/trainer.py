"""`tiersep train`: train one preset (plan, loop, validate, checkpoint, record); `train` is the entry point.

Exit codes (returned, the CLI exits with them):
  0  done: model.pt and run.json written
  3  refused before anything was allocated on the device (fit gate, or a GPU-sized preset on CPU);
     failure.json kind "refused"
  4  out of memory; failure.json kind "oom" (the attempted allocation beside the estimate)
  5  the run folder is in use by another live tiersep process (tiersep.outputs.exclusive)
  75 stopped by SIGTERM/SIGUSR1 (cluster preemption) after writing checkpoints/last.pt; rerun with
     --resume to continue (EX_TEMPFAIL: "try again later")
  130 interrupted by Ctrl-C (SIGINT) after writing checkpoints/last.pt at the step boundary; a second
     Ctrl-C stops at once
  1  (data-parallel) a rank died: failure.json kind "rank_died" naming it (tiersep.train.launch)
  7  fp16: the loss scale collapsed (too many skipped steps in a row); failure.json kind "scale_collapsed"
Bad input (a folder that is not tiersep's, an untrusted checkpoint) is exit 2 through the CLI, and so
is a tracking section the job cannot carry out (W&B asked for but not installed, online without a
key: tiersep.train.tracking), said in one line before anything is trained.
Outputs that mean "finished" (model.pt, run.json) are written only at the end, atomically.

Here: the job (job.py) is settled once, the run folder held, and the process, the launcher or a
rank sent on its way. What is decided before the loop (resume point, micro-batch, device, gate) is in
plan.py; the run folder is settled in run_folder.py; the loop is loop.py, its setup build.py (model,
optimizer, torch.compile with its eager fallback), its endings and exit codes endings.py; run.json
is assembled in record.py; the curves (TensorBoard, W&B) are tracking.py's. A data-parallel tier
(train.ranks > 1) runs the same loop in every rank
under torchrun (launch.py starts it, distributed.py joins it).
"""
from __future__ import annotations

import gc
import sys
from dataclasses import replace
from pathlib import Path

from tiersep.config import ConfigError
from tiersep.data.tracks import load_manifest
from tiersep.io import write_json
from tiersep.malloc import release_heap
from tiersep.outputs import claim, exclusive, only_names
from tiersep.train import distributed, endings, launch, record
from tiersep.train.endings import (EXIT_INTERRUPTED, EXIT_OK, EXIT_OOM, EXIT_PREEMPTED, EXIT_RANK_DIED,
                                   EXIT_REFUSED, EXIT_SCALE_COLLAPSED)
from tiersep.train.job import TrainJob
from tiersep.train.loop import Training
from tiersep.train.oom import INJECT_OOM_ENV
from tiersep.train.plan import plan_run
from tiersep.train.run_folder import settle_run_folder
from tiersep.train.tracking import TrackingError, tracking_problem

__all__ = ["train", "EXIT_OK", "EXIT_REFUSED", "EXIT_OOM", "EXIT_PREEMPTED", "EXIT_INTERRUPTED", "EXIT_RANK_DIED",
           "EXIT_SCALE_COLLAPSED", "INJECT_OOM_ENV"]


def train(cfg: dict, preset: dict, data_dir, out_dir, resume: bool = False, estimate_path=None,
          attempt: int = 1, outcome_path=None) -> int:
    """Train `preset` on the prepared folder `data_dir` into `out_dir`; returns the exit code.

    out_dir must be tiersep's (new, empty, or a run folder: tiersep.outputs.claim) and is held by
    this process alone for the whole run (exclusive: a second trainer stops at once, exit 5).
    With `outcome_path` (the workflow's train checkpoint), the outcome is written there at the end:
    trained, or refused by the gate; a refusal is then a finished outcome (exit 0) unless
    on_oversize is fail. Without it a refusal exits 3."""
    problem = tracking_problem(cfg)   # at job start, never mid-run
    if problem:
        raise TrackingError(problem)
    load_manifest(data_dir)           # a folder prepare did not write: one line, before the gate's trace
    job = TrainJob(cfg, preset, Path(data_dir), Path(out_dir), resume, estimate_path, attempt, outcome_path)
    try:
        if distributed.is_data_parallel(preset):
            return _train_data_parallel(job)
        claim(job.out_dir, "train", known=only_names(record.RUN_FILES))
        with exclusive(job.out_dir):
            return _train(job)
    finally:
        # The run's model and optimizer are gone: give glibc's free heap pages back, so that the
        # library pages the exit touches take their room (the CPU booking counts them once).
        gc.collect()
        release_heap()


def _train_data_parallel(job: TrainJob) -> int:
    """A data-parallel tier. Not under torchrun: hold the run folder and run the ranks under it
    (launch.py). Under torchrun: join the process group and train as one rank; rank 0 takes the
    lock itself unless the launching tiersep process holds it. Every rank notes its exit code for
    the launcher, and whether it stopped because another rank was gone."""
    problem = distributed.topology_problem(job.preset)
    if problem is None and not distributed.under_torchrun():
        problem = launch.allocation_problem(job.preset)   # several nodes: a SLURM allocation of them
    if problem:
        raise distributed.TopologyError(problem)
    if not distributed.under_torchrun():
        claim(job.out_dir, "train", known=only_names(record.RUN_FILES))
        with exclusive(job.out_dir):
            return launch.run_ranks(job)
    ranks = distributed.start(job.preset)
    notes = {"code": 1, "peer_failure": False, "step": None}
    try:
        if ranks.is_main and not distributed.launcher_holds_lock():
            claim(job.out_dir, "train", known=only_names(record.RUN_FILES))
            with exclusive(job.out_dir):
                notes["code"] = _train(job, ranks=ranks, notes=notes)
        else:
            notes["code"] = _train(job, ranks=ranks, notes=notes)
        return notes["code"]
    except ConfigError as err:
        notes["code"] = getattr(err, "exit_code", 2)
        raise
    except KeyboardInterrupt:
        notes["code"] = EXIT_INTERRUPTED
        raise
    except Exception as err:  # noqa: BLE001 - before the loop (a plan, a broadcast): another rank left
        if not distributed.is_peer_failure(err):
            raise
        notes.update(code=EXIT_RANK_DIED, peer_failure=True)
        print(f"tiersep train: rank {ranks.rank}: another rank left before training began ({err})",
              file=sys.stderr)
        return EXIT_RANK_DIED
    finally:
        distributed.note(ranks, "exit", notes)
        distributed.finish()


def _train(job: TrainJob, ranks=None, notes=None) -> int:
    if ranks is not None and not ranks.is_main:
        return _train_other_rank(job, ranks, notes)
    plan = plan_run(job)
    code = endings.refused(plan, job) if plan.refusal is not None else None
    if ranks is not None:   # the other ranks plan only after this one has settled the run folder
        distributed.from_main({"code": code} if code is not None else
                              {"code": None, "preset": plan.preset, "estimate": plan.estimate})
    if code is not None:
        return code
    history = settle_run_folder(plan, job)
    code = Training(plan, job, history, ranks, notes).run()
    if code == EXIT_OK and job.outcome_path is not None:
        write_json(job.outcome_path, {"preset": job.preset["name"], "status": "trained",
                                      "run": str(job.out_dir / "run.json")})
    return code


def _train_other_rank(job: TrainJob, ranks, notes) -> int:
    """A rank other than 0: it waits for rank 0's verdict (refused, or the preset as planned there:
    after a downshift or an adaptation), then plans the same run without the gate (rank 0's
    verdict stands for every rank) and trains its share."""
    verdict = distributed.from_main(None)
    if verdict["code"] is not None:
        return verdict["code"]
    plan = plan_run(replace(job, preset=verdict["preset"], attempt=1), gated_on_main=True,
                    main_estimate=verdict["estimate"])
    return Training(plan, job, {}, ranks, notes).run()
