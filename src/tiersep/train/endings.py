"""How a train job ends, and what each ending leaves: its exit code, and run.json, failure.json or
the workflow's outcome.json.

Before the loop: refused (the plan's gate, or a GPU-sized preset on CPU). From the loop (a
Training `run`, tiersep.train.loop): finished, preempted or interrupted at a step boundary (after a
checkpoint), out of memory, another rank gone, refused after a failed compile, fp16's loss scale
collapsed, or an error (recorded, then re-raised). Rank 0 writes the run folder; another rank only notes what the launcher needs.
"""
from __future__ import annotations

import sys

import torch

from tiersep.io import write_json
from tiersep.outputs import move_aside
from tiersep.train import checkpoint as ckpt
from tiersep.train import distributed, record
from tiersep.train.job import TrainJob
from tiersep.train.oom import is_oom
from tiersep.train.plan import RunPlan
from tiersep.train.signals import StopFlag

EXIT_OK, EXIT_REFUSED, EXIT_OOM, EXIT_PREEMPTED, EXIT_INTERRUPTED = 0, 3, 4, 75, 130
EXIT_RANK_DIED = 1
EXIT_SCALE_COLLAPSED = 7


class ScaleCollapsed(RuntimeError):
    """fp16: the loss scaler skipped MAX_SKIPPED_IN_A_ROW steps in a row (model/step.py LossScaler):
    the gradients stay non-finite whatever the scale, so training on would learn nothing (or NaN)."""

    def __init__(self, step: int, scaler):
        self.step, self.skipped, self.scale = step, scaler.in_a_row, scaler.scale()
        super().__init__(f"the fp16 loss scale collapsed at step {step}: {scaler.in_a_row} steps in a row "
                         f"had inf/NaN gradients and were skipped (scale now {self.scale:.3g})")


def refused(plan: RunPlan, job: TrainJob) -> int:
    """Record the plan's refusal; the exit code (0 when the workflow records it as an outcome)."""
    out_dir, name, on_oversize = job.out_dir, job.preset["name"], job.cfg["on_oversize"]
    # an earlier success must not look current; it is kept, moved aside, never deleted
    move_aside(out_dir, f"refused: {plan.refusal}", names=record.FINISHED)
    record.write_failure(out_dir, "refused", plan.refusal, preset=name, device=plan.device.type,
                         attempt=job.attempt, attempted_allocation_bytes=None,
                         estimate_peak_bytes=(plan.estimate or {}).get("peak_bytes"))
    print(f"tiersep train: refused: {plan.refusal}", file=sys.stderr)
    if job.outcome_path is None or on_oversize == "fail":
        return EXIT_REFUSED
    write_json(job.outcome_path, {"preset": name, "status": "refused", "reason": plan.refusal})
    print(f"tiersep train: recorded the refusal in {job.outcome_path} (on_oversize: {on_oversize}; "
          "`fail` stops the run instead)", file=sys.stderr)
    return EXIT_OK


def failure(run, err: BaseException) -> int | None:
    """The exit code a failure inside the run ends in, or None for an error, which the caller
    re-raises (rank 0 records it in failure.json first)."""
    if run.ranks is not None and distributed.is_peer_failure(err):
        return peer_lost(run, err)
    if is_oom(err):
        return out_of_memory(run, err)
    from tiersep.memory import DoesNotFit

    if isinstance(err, DoesNotFit):   # the eager step after a failed compile does not fit
        return refused_after_compile(run, err)
    if isinstance(err, ScaleCollapsed):
        return scale_collapsed(run, err)
    from tiersep.data.dataset import dead_worker

    if run.main:   # rank 0 writes the run folder; the launcher names another rank
        record.write_failure(run.out_dir, "error", f"{type(err).__name__}: {err}",
                             preset=run.preset["name"], step=run.step, attempt=run.plan.attempt,
                             attempted_allocation_bytes=None,
                             estimate_peak_bytes=(run.plan.estimate or {}).get("peak_bytes"),
                             # a DataLoader worker that died (OOM killer, segfault): {pids, signal, exit_code}
                             worker_signal=dead_worker(err))
    return None


def peer_lost(run, err: BaseException) -> int:
    """Another rank is gone (a collective failed, or timed out): stop. Rank 0 records it as
    rank_died; the launcher, which sees which rank left no exit code, names the rank."""
    run.notes.update(peer_failure=True, step=run.step)
    if run.main:
        message = f"another rank left at step {run.step}: {distributed.one_line(err)}"
        record.write_failure(run.out_dir, "rank_died", message, preset=run.preset["name"], rank=None,
                             step=run.step, attempt=run.plan.attempt, attempted_allocation_bytes=None,
                             estimate_peak_bytes=(run.plan.estimate or {}).get("peak_bytes"))
        print(f"tiersep train: rank 0: {message}", file=sys.stderr)
    return EXIT_RANK_DIED


def refused_after_compile(run, err) -> int:
    """torch.compile failed, and the eager step it falls back to does not fit the budget."""
    message = f"torch.compile failed ({run.compile_info.get('reason')}) and the eager step does not fit: {err}"
    record.write_failure(run.out_dir, "refused", message, preset=run.preset["name"], step=run.step,
                         attempt=run.plan.attempt, attempted_allocation_bytes=None,
                         estimate_peak_bytes=(err.estimate or {}).get("peak_bytes"))
    print(f"tiersep train: refused: {message}", file=sys.stderr)
    return EXIT_REFUSED


def scale_collapsed(run, err: ScaleCollapsed) -> int:
    """fp16's scale collapsed: failure.json kind scale_collapsed, one line, exit 7. The last
    checkpoint is kept (the skipped steps did not move the weights); rerunning it would collapse
    again: the fix is in the data, the lr or the precision (docs/training.md#fp16)."""
    if run.main:
        record.write_failure(run.out_dir, "scale_collapsed", str(err), preset=run.preset["name"], step=err.step,
                             attempt=run.plan.attempt, attempted_allocation_bytes=None,
                             estimate_peak_bytes=(run.plan.estimate or {}).get("peak_bytes"))
        print(f"tiersep train: {err}; wrote {run.out_dir / 'failure.json'} (exit {EXIT_SCALE_COLLAPSED})",
              file=sys.stderr)
    return EXIT_SCALE_COLLAPSED


def preempt(run, flag: StopFlag) -> int:
    """A stop signal at a step boundary: checkpoints/last.pt, then exit 75 (SIGTERM, SIGUSR1) or
    130 (Ctrl-C)."""
    run.checkpoint()
    if not run.main:   # rank 0 writes the checkpoint and says so
        return EXIT_INTERRUPTED if flag.interrupted else EXIT_PREEMPTED
    if flag.interrupted:
        again = "run the same command" + ("" if run.plan.resume_requested else " with --resume")
        print(f"tiersep train: interrupted at step {run.step} (wrote {ckpt.last_path(run.out_dir)}); "
              f"{again} to resume", file=sys.stderr)
        return EXIT_INTERRUPTED
    print(f"tiersep train: {flag.name} at step {run.step}: wrote {ckpt.last_path(run.out_dir)}; "
          f"rerun with --resume to continue (exit {EXIT_PREEMPTED})", file=sys.stderr)
    return EXIT_PREEMPTED


def out_of_memory(run, err: BaseException) -> int:
    """Out of memory in a step: failure.json kind oom beside the estimate (rank 0), or a note for
    the launcher (another rank); the workflow's retry downshifts the micro-batch."""
    memory = run.plan.probe.sample()
    # Drop references to the failed step's tensors before anything else is written.
    if run.optimizer is not None:
        run.optimizer.zero_grad(set_to_none=True)
    if run.device.type == "cuda":
        torch.cuda.empty_cache()
    if not run.main:
        # an OOM of any rank is the tier's: the launcher writes failure.json kind oom from this
        # note, and the retry downshifts every rank's micro-batch
        message = str(err).strip()
        run.notes["oom"] = {"message": message, "step": run.step, "batch_size": run.t["batch_size"],
                            "grad_accum": run.t["grad_accum"], "memory_at_failure": memory}
        print(f"tiersep train: rank {run.ranks.rank}: out of memory at step {run.step}: "
              f"{distributed.one_line(err)}", file=sys.stderr)
        return EXIT_OOM
    message = record.write_oom_failure(run, err, memory)
    print(f"tiersep train: out of memory at step {run.step} (micro-batch {run.t['batch_size']}"
          f" x {run.t['grad_accum']}): {message}; wrote {run.out_dir / 'failure.json'} "
          f"(exit {EXIT_OOM})", file=sys.stderr)
    return EXIT_OOM


def finish(run) -> int:
    """The loop ran all its steps: rank 0 exports model.pt and writes run.json (with every rank's
    memory on a data-parallel tier)."""
    per_rank = distributed.gather(record.rank_memory(run)) if run.ranks is not None else None
    if not run.main:
        return EXIT_OK
    weights_step, held = record.export_model(run)
    written = record.run_record(run, weights_step, held)
    if per_rank is not None:
        written["per_rank"] = per_rank
    record.write_run(run.out_dir, written)
    sps = written["steps_per_s"]
    print(f"tiersep train: {run.preset['name']}: {run.step} steps"
          + (f" ({sps:.2f} steps/s)" if sps else "")
          + f", best val SI-SDR {run.best['val_si_sdr']:.2f} dB at step {run.best['step']}; "
          f"wrote {run.out_dir / 'model.pt'}", file=sys.stderr)
    return EXIT_OK
