"""Train one preset in this process: plan, loop, validate, checkpoint, record.

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
Bad input (a folder that is not tiersep's, an untrusted checkpoint) is exit 2 through the CLI.
Outputs that mean "finished" (model.pt, run.json) are written only at the end, atomically.
What is decided before the loop (resume point, micro-batch, device, gate) is in plan.py; the loop
and its endings are here; run.json is assembled in record.py. A data-parallel tier (train.ranks > 1)
runs this same loop in every rank under torchrun (launch.py starts it, distributed.py joins it).
"""
from __future__ import annotations

import gc
import math
import os
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from tiersep.config import ConfigError
from tiersep.io import write_json
from tiersep.malloc import release_heap, trimmed_heap
from tiersep.model.step import make_optimizer, train_step
from tiersep.outputs import claim, exclusive, move_aside, only_names
from tiersep.train import checkpoint as ckpt
from tiersep.train import distributed, launch, record
from tiersep.train.oom import INJECT_OOM_ENV, is_oom, maybe_inject_oom, parse_injection
from tiersep.train.plan import RunPlan, plan_run
from tiersep.train.resume import extension
from tiersep.train.schedule import Schedule
from tiersep.train.signals import StopFlag, stop_on_signals
from tiersep.train.telemetry import MEMORY_FIELDS, METRICS_FIELDS, CsvLog, SegmentTrace
from tiersep.train.validation import validate

EXIT_OK, EXIT_REFUSED, EXIT_OOM, EXIT_PREEMPTED, EXIT_INTERRUPTED = 0, 3, 4, 75, 130
EXIT_RANK_DIED = launch.EXIT_RANK_DIED
COMPILE_BACKEND_ENV = "TIERSEP_COMPILE_BACKEND"
__all__ = ["train", "EXIT_OK", "EXIT_REFUSED", "EXIT_OOM", "EXIT_PREEMPTED", "EXIT_INTERRUPTED", "INJECT_OOM_ENV"]


def train(cfg: dict, preset: dict, data_dir, out_dir, resume: bool = False, estimate_path=None,
          attempt: int = 1, outcome_path=None) -> int:
    """Train `preset` on the prepared folder `data_dir` into `out_dir`; returns the exit code.

    out_dir must be tiersep's (new, empty, or a run folder: tiersep.outputs.claim) and is held by
    this process alone for the whole run (exclusive: a second trainer stops at once, exit 5).
    With `outcome_path` (the workflow's train checkpoint), the outcome is written there at the end:
    trained, or refused by the gate; a refusal is then a finished outcome (exit 0) unless
    on_oversize is fail. Without it a refusal exits 3."""
    wall_start = time.time()
    data_dir, out_dir = Path(data_dir), Path(out_dir)
    args = (cfg, preset, data_dir, out_dir, resume, estimate_path, attempt, outcome_path)
    try:
        if distributed.is_data_parallel(preset):
            return _train_data_parallel(*args, wall_start)
        claim(out_dir, "train", known=only_names(record.RUN_FILES))
        with exclusive(out_dir):
            return _train(*args, wall_start)
    finally:
        # The run's model and optimizer are gone: give glibc's free heap pages back, so that the
        # library pages the exit touches take their room (the CPU booking counts them once).
        gc.collect()
        release_heap()


def _train_data_parallel(cfg, preset, data_dir, out_dir, resume, estimate_path, attempt, outcome_path,
                         wall_start) -> int:
    """A data-parallel tier. Not under torchrun: hold the run folder and run the ranks under it
    (launch.py). Under torchrun: join the process group and train as one rank; rank 0 takes the
    lock itself unless the launching tiersep process holds it. Every rank notes its exit code for
    the launcher, and whether it stopped because another rank was gone."""
    problem = distributed.topology_problem(preset)
    if problem is None and not distributed.under_torchrun():
        problem = launch.allocation_problem(preset)   # several nodes: a SLURM allocation of them
    if problem:
        raise distributed.TopologyError(problem)
    args = (cfg, preset, data_dir, out_dir, resume, estimate_path, attempt, outcome_path)
    if not distributed.under_torchrun():
        claim(out_dir, "train", known=only_names(record.RUN_FILES))
        with exclusive(out_dir):
            return launch.run_ranks(*args)
    ranks = distributed.start(preset)
    notes = {"code": 1, "peer_failure": False, "step": None}
    try:
        if ranks.is_main and not distributed.launcher_holds_lock():
            claim(out_dir, "train", known=only_names(record.RUN_FILES))
            with exclusive(out_dir):
                notes["code"] = _train(*args, wall_start, ranks=ranks, notes=notes)
        else:
            notes["code"] = _train(*args, wall_start, ranks=ranks, notes=notes)
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


def _train(cfg, preset, data_dir, out_dir, resume, estimate_path, attempt, outcome_path, wall_start,
           ranks=None, notes=None) -> int:
    if ranks is not None and not ranks.is_main:
        return _train_other_rank(cfg, data_dir, out_dir, resume, estimate_path, wall_start, ranks, notes)
    plan = plan_run(cfg, preset, out_dir, resume, estimate_path, attempt)
    code = _refused(plan, cfg, preset, out_dir, attempt, outcome_path) if plan.refusal is not None else None
    if ranks is not None:   # the other ranks plan only after this one has settled the run folder
        distributed.from_main({"code": code} if code is not None else
                              {"code": None, "preset": plan.preset, "estimate": plan.estimate})
    if code is not None:
        return code
    history = _settle_run_folder(plan, preset, out_dir)
    code = Training(plan, data_dir, out_dir, wall_start, history, ranks, notes).run()
    if code == EXIT_OK and outcome_path is not None:
        write_json(outcome_path, {"preset": preset["name"], "status": "trained", "run": str(out_dir / "run.json")})
    return code


def _train_other_rank(cfg, data_dir, out_dir, resume, estimate_path, wall_start, ranks, notes) -> int:
    """A rank other than 0: it waits for rank 0's verdict (refused, or the preset as planned there:
    after a downshift or an adaptation), then plans the same run without the gate (rank 0's
    verdict stands for every rank) and trains its share."""
    verdict = distributed.from_main(None)
    if verdict["code"] is not None:
        return verdict["code"]
    plan = plan_run(cfg, verdict["preset"], out_dir, resume, estimate_path, attempt=1,
                     gated_on_main=True, main_estimate=verdict["estimate"])
    return Training(plan, data_dir, out_dir, wall_start, {}, ranks, notes).run()


def _refused(plan, cfg, preset, out_dir, attempt, outcome_path) -> int:
    """Record the plan's refusal; the exit code (0 when the workflow records it as an outcome)."""
    # an earlier success must not look current; it is kept, moved aside, never deleted
    move_aside(out_dir, f"refused: {plan.refusal}", names=record.FINISHED)
    record.write_failure(out_dir, "refused", plan.refusal, preset=preset["name"], device=plan.device.type,
                         attempt=attempt, attempted_allocation_bytes=None,
                         estimate_peak_bytes=(plan.estimate or {}).get("peak_bytes"))
    print(f"tiersep train: refused: {plan.refusal}", file=sys.stderr)
    if outcome_path is None or cfg["on_oversize"] == "fail":
        return EXIT_REFUSED
    write_json(outcome_path, {"preset": preset["name"], "status": "refused", "reason": plan.refusal})
    print(f"tiersep train: recorded the refusal in {outcome_path} (on_oversize: {cfg['on_oversize']}; "
          "`fail` stops the run instead)", file=sys.stderr)
    return EXIT_OK


def _settle_run_folder(plan, preset, out_dir) -> dict:
    """Before training: a new run moves the old one aside, a longer one keeps the finished model,
    a resumed one says so. Returns the history run.json records."""
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
            kept = _keep_finished(out_dir, f"train.steps grew from {grown['steps']} to {plan.preset['train']['steps']}")
            print(f"tiersep train: training longer: {preset['name']} continues from step {grown['step']} "
                  f"(train.steps {grown['steps']} -> {plan.preset['train']['steps']}; the lr schedule follows "
                  "the new step count from here)" + (f"; the finished model is kept in {kept}" if kept else ""),
                  file=sys.stderr)
            history["extended_from"] = list(plan.resume["run"].get("extended_from") or []) + [grown]
        else:
            print(f"tiersep train: resuming {preset['name']} from step {plan.resume['step']} "
                  f"({out_dir / 'checkpoints'})", file=sys.stderr)
    (out_dir / "failure.json").unlink(missing_ok=True)   # superseded: this attempt trains (run.json keeps an OOM)
    return history


def _keep_finished(out_dir: Path, reason: str) -> Path | None:
    """Before a finished run trains longer: its model.pt and run.json, hard-linked (no copy) into
    previous/<time>/, so the shorter run's model survives the longer one's export."""
    return move_aside(out_dir, reason, names=record.FINISHED, link=True)


class Training:
    """One training process carrying out a RunPlan; its state is what the endings report."""

    def __init__(self, plan: RunPlan, data_dir: Path, out_dir: Path, wall_start: float, history: dict,
                 ranks: distributed.Ranks | None = None, notes: dict | None = None):
        self.plan, self.data_dir, self.out_dir, self.wall_start = plan, data_dir, out_dir, wall_start
        self.preset, self.device, self.t = plan.preset, plan.device, plan.preset["train"]
        # data-parallel: this rank's place; only rank 0 (main) writes the run folder
        self.ranks, self.notes = ranks, notes if notes is not None else {}
        self.main = ranks is None or ranks.is_main
        # bookkeeping carried by every checkpoint of this run (run.json reads it at the end)
        self.run_info = {**(dict(plan.resume["run"]) if plan.resume else {}), **history}
        self.step = self.steps_this_process = 0
        self.resumed_from = None
        self.loop_start = None
        self.model = self.optimizer = self.metrics = self.memory = None
        self.compile_info = {"requested": plan.preset["train"]["compile"], "compiled": False, "reason": None}

    # -- setup -------------------------------------------------------------------------------
    def _build(self) -> None:
        from tiersep.data.dataset import SegmentDataset, make_loader, rank_segments, validation_segments
        from tiersep.model import build_loss, build_model, count_parameters

        p, t, state = self.preset, self.t, self.plan.resume
        ckpt.seed_everything(t["seed"])
        self.model = build_model(p).to(self.device)
        if (self.plan.malloc or {}).get("trim_heap"):   # booked so (plan.host_malloc)
            self.model.checkpoint_context = trimmed_heap
        self.parameters = count_parameters(self.model)
        self.loss_fn = build_loss(p)
        self.optimizer = make_optimizer(self.model, p, self.device.type)
        self.schedule = Schedule(t)
        self.best = {"val_si_sdr": -math.inf, "step": None}
        if state is not None:
            ckpt.restore(state, model=self.model, optimizer=self.optimizer, schedule=self.schedule)
            self.step = self.resumed_from = int(state["step"])
            self.best = dict(state["best"])
            # A new best writes last.pt first, then best.pt, so best.pt is never ahead of last.pt;
            # a kill between the two leaves best.pt one best behind: rewrite it from last.pt.
            best_file = ckpt.best_path(self.out_dir)
            best_step = ckpt.load_checkpoint(best_file)["step"] if best_file.is_file() else None
            if self.best.get("step") == self.step and best_step != self.step and self.main:
                ckpt.copy_checkpoint(ckpt.last_path(self.out_dir), best_file)
        self.step_model = self._compiled(self._data_parallel(self.model))
        self.elapsed_before = float(self.run_info.get("train_seconds", 0.0))
        sources, segment = p["model"]["sources"], p["audio"]["segment_samples"]
        self.dataset = SegmentDataset(self.data_dir, "train", sources, segment, t["seed"], t["augment"])
        self.segments = (rank_segments(t["batch_size"], t["grad_accum"], self.ranks.rank, self.ranks.world)
                         if self.ranks else None)
        self.trace = SegmentTrace.from_env(self.ranks.rank if self.ranks else 0)
        self.make_loader = make_loader
        if not self.main:
            return   # rank 0 validates and writes the logs
        self.val_mix, self.val_stems = validation_segments(self.data_dir, sources, segment,
                                                           t["validate_segments"], t["seed"])
        keep = self.step if state is not None else None
        self.metrics = CsvLog(self.out_dir / "metrics.csv", METRICS_FIELDS, keep)
        self.memory = CsvLog(self.out_dir / "memory.csv", MEMORY_FIELDS, keep)

    def _data_parallel(self, model):
        """The module the step runs: the model in DistributedDataParallel on a data-parallel tier
        (it broadcasts rank 0's weights now, and averages gradients in backward), else the model.
        gradient_as_bucket_view: the gradients live in DDP's buckets instead of beside them (one
        gradient-sized copy less per rank, REFERENCE.md)."""
        if self.ranks is None:
            return model
        from torch.nn.parallel import DistributedDataParallel

        ids = [self.device.index] if self.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids, gradient_as_bucket_view=True)

    def _compiled(self, model):
        """The model the training step calls: torch.compile'd when the plan says so, with inductor's
        cache shared by every tier and trial of this results tree (a sweep compiles once)."""
        if not self.plan.compile:
            self.compile_info["reason"] = f"train.compile {self.t['compile']} on {self.device.type}"
            return model
        from tiersep.model.compile import compile_model

        # TIERSEP_COMPILE_BACKEND (e.g. aot_eager) bisects a compile problem without inductor
        backend = os.environ.get(COMPILE_BACKEND_ENV, "inductor")
        compiled, info = compile_model(model, self.t["compile_mode"], self.out_dir.parent / ".compile_cache",
                                       backend=backend, before_eager=self._regate_eager)
        # from now on the same dict the fallback updates, so run.json sees it (with what was set
        # before: requested, and a re-check made when torch.compile itself refused)
        info.update({k: v for k, v in self.compile_info.items() if k not in info})
        self.compile_info = info
        return compiled

    def _regate_eager(self, reason: str) -> None:
        """The compile failed and the steps run eagerly from now on: when the gate booked the compiled
        step, check that the eager one fits the budget too (raises DoesNotFit, recorded as a refusal)."""
        if not (self.plan.estimate or {}).get("compiled") or self.plan.budget is None:
            return
        from tiersep.memory import gate

        self.plan.estimate = gate(self.preset, self.device.type, self.plan.budget, self.plan.safety_margin,
                                  calibration_spec=self.plan.calibration_spec, compiled=False)
        self.compile_info["regated"] = (f"the eager step's estimate, {self.plan.estimate['gate_required_bytes']} "
                                        "bytes, fits the budget")

    def _checkpoint(self) -> None:
        if not self.main:
            return
        self.run_info.update({
            "batch_size": self.t["batch_size"], "grad_accum": self.t["grad_accum"], "ranks": self.t["ranks"],
            "attempt": self.plan.attempt, "train_seconds": self.train_seconds(),
            "recovered_from": self.plan.recovered_from, "downshifted_from": self.plan.downshifted_from})
        ckpt.save_checkpoint(ckpt.last_path(self.out_dir), model=self.model, optimizer=self.optimizer,
                             schedule=self.schedule, step=self.step, best=self.best, preset=self.preset,
                             run=self.run_info)

    def train_seconds(self) -> float:
        return self.elapsed_before + (time.time() - self.loop_start if self.loop_start else 0.0)

    # -- the loop ------------------------------------------------------------------------------
    def run(self) -> int:
        flag = StopFlag()
        with stop_on_signals(flag):
            try:
                self._build()
                return self._loop(flag)
            except Exception as err:  # noqa: BLE001 - every failure is recorded, then re-raised or mapped
                if self.ranks is not None and distributed.is_peer_failure(err):
                    return self._peer_lost(err)
                if is_oom(err):
                    return self._out_of_memory(err)
                from tiersep.memory import DoesNotFit

                if isinstance(err, DoesNotFit):   # the eager step after a failed compile does not fit
                    return self._refused_after_compile(err)
                from tiersep.data.dataset import dead_worker

                if not self.main:   # rank 0 writes the run folder; the launcher names this rank
                    raise
                record.write_failure(self.out_dir, "error", f"{type(err).__name__}: {err}",
                                     preset=self.preset["name"], step=self.step, attempt=self.plan.attempt,
                                     attempted_allocation_bytes=None,
                                     estimate_peak_bytes=(self.plan.estimate or {}).get("peak_bytes"),
                                     # a DataLoader worker that died (OOM killer, segfault): {pids, signal, exit_code}
                                     worker_signal=dead_worker(err))
                raise
            finally:
                for log in (self.metrics, self.memory):
                    if log is not None:
                        log.close()

    def _peer_lost(self, err: BaseException) -> int:
        """Another rank is gone (a collective failed, or timed out): stop. Rank 0 records it as
        rank_died; the launcher, which sees which rank left no exit code, names the rank."""
        self.notes.update(peer_failure=True, step=self.step)
        if self.main:
            message = f"another rank left at step {self.step}: {distributed.one_line(err)}"
            record.write_failure(self.out_dir, "rank_died", message, preset=self.preset["name"], rank=None,
                                 step=self.step, attempt=self.plan.attempt, attempted_allocation_bytes=None,
                                 estimate_peak_bytes=(self.plan.estimate or {}).get("peak_bytes"))
            print(f"tiersep train: rank 0: {message}", file=sys.stderr)
        return EXIT_RANK_DIED

    def _refused_after_compile(self, err) -> int:
        message = f"torch.compile failed ({self.compile_info.get('reason')}) and the eager step does not fit: {err}"
        record.write_failure(self.out_dir, "refused", message, preset=self.preset["name"], step=self.step,
                             attempt=self.plan.attempt, attempted_allocation_bytes=None,
                             estimate_peak_bytes=(err.estimate or {}).get("peak_bytes"))
        print(f"tiersep train: refused: {message}", file=sys.stderr)
        return EXIT_REFUSED

    def _loop(self, flag: StopFlag) -> int:
        t, steps, micro = self.t, self.t["steps"], self.t["batch_size"]
        injection = parse_injection(os.environ.get(INJECT_OOM_ENV))
        self._start_random_streams()
        self.model.train()
        self.loop_start = time.time()
        recent: list[float] = []
        bar = tqdm(total=steps, initial=self.step, desc=self.preset["name"], unit="step",
                   dynamic_ncols=True, mininterval=0.5, file=sys.stderr, disable=not self.main)
        # The loader may draw from the global generators (DataLoader seeds its workers from torch's):
        # keep it invisible to them, so dropout draws the same numbers whether the loader was
        # created at step 0 or at a resumed step.
        with ckpt.preserved_rng():
            loader = (self.make_loader(self.dataset, micro * t["grad_accum"], t["num_workers"], self.step,
                                       stop_step=steps, indices=self.segments) if self.step < steps else iter(()))
            batches = iter(loader)
        stop = False
        try:
            while self.step < steps and not (stop := self._stopping(flag)):
                tick = time.time()
                with ckpt.preserved_rng():
                    data_step, mixture, stems = next(batches)
                assert data_step == self.step, f"loader at step {data_step}, expected {self.step}"
                self.trace.write(data_step, self.segments, mixture)
                maybe_inject_oom(injection, data_step, micro, self.preset["name"], self.ranks.rank if self.ranks else 0)
                row = self._step(data_step, mixture, stems)
                elapsed = time.time() - tick
                if self.steps_this_process == 1 and self.compile_info["compiled"]:
                    # the first compiled step compiles: logged apart, kept out of the step rate
                    self.compile_info["first_step_seconds"] = round(elapsed, 3)
                    tqdm.write(f"{self.preset['name']}: torch.compile and the first step took "
                               f"{elapsed:.1f} s", file=sys.stderr)
                else:
                    recent = (recent + [elapsed])[-20:]
                row["steps_per_s"] = len(recent) / sum(recent) if recent else None
                if self.step % t["validate_every"] == 0 or self.step == steps:
                    row.update(self._validate())
                memory = self.plan.probe.sample()
                if self.main:
                    self.metrics.append(row)
                    self.memory.append({"step": self.step, **memory})
                if self.step % t["checkpoint_every"] == 0 or self.step == steps:
                    self._checkpoint()
                rate = f"{row['steps_per_s']:.2f} st/s " if row["steps_per_s"] else ""
                bar.set_postfix_str(f"loss {row['loss']:.4f} lr {row['lr']:.2e} {rate}{self.plan.probe.postfix()}",
                                    refresh=False)
                bar.update(1)
        finally:
            bar.close()
            close = getattr(loader, "close", None)
            if close:
                close()
        if stop:
            return self._preempt(flag)
        return self._finish()

    def _start_random_streams(self) -> None:
        """The generators dropout draws from, as the loop starts: a resumed run's from its checkpoint
        (last, so nothing in setup consumes them). Dropout masks differ between ranks: rank 0
        continues the checkpoint's generator, the others draw from (seed, rank, step)."""
        if self.plan.resume is not None:
            ckpt.set_rng_state(self.plan.resume["rng"])
            self.plan.resume = None
        if self.ranks is not None and not self.ranks.is_main:
            torch.manual_seed(hash((self.t["seed"], self.ranks.rank, self.step)) % 2**62)

    def _stopping(self, flag: StopFlag) -> bool:
        """Whether to stop at this step boundary: a stop signal here, or on any rank (all ranks
        stop at the same step, so rank 0's checkpoint is every rank's)."""
        return distributed.any_rank(bool(flag), self.device) if self.ranks is not None else bool(flag)

    def _step(self, data_step: int, mixture: torch.Tensor, stems: torch.Tensor) -> dict:
        """One optimisation step on the effective batch; returns its metrics row."""
        t, micro = self.t, self.t["batch_size"]
        factor = self.schedule.factor(data_step)
        for group in self.optimizer.param_groups:
            group["lr"] = t["lr"] * factor
        # The effective batch [micro*accum, ...] split into `accum` micro-batches [micro, ...]: the same
        # samples whatever the split, so a downshifted retry sees the same data.
        chunks = [(m.to(self.device, non_blocking=True), s.to(self.device, non_blocking=True))
                  for m, s in zip(mixture.split(micro), stems.split(micro))]
        loss, grad_norm = train_step(self.step_model, self.loss_fn, self.optimizer, chunks, self.preset,
                                     self.device.type)
        loss, grad_norm = float(loss), float(grad_norm)
        if self.ranks is not None:   # each rank's loss is over its share; the step's is their mean
            loss = distributed.mean_over_ranks(loss, self.device)
        if not math.isfinite(loss):
            raise FloatingPointError(f"loss is {loss} at step {data_step + 1}")
        self.step = data_step + 1
        self.steps_this_process += 1
        return {"step": self.step, "time_s": round(self.train_seconds(), 3), "loss": loss,
                "lr": t["lr"] * factor, "grad_norm": grad_norm}

    def _validate(self) -> dict:
        """Validation on rank 0 (the only one with the validation segments); the other ranks wait
        for its scores, which their plateau schedule and best-score bookkeeping need too."""
        scores = (validate(self.model, self.loss_fn, self.val_mix, self.val_stems,
                           self.t["batch_size"], self.preset, self.device) if self.main else None)
        if self.ranks is not None:
            scores = distributed.from_main(scores)
        self.schedule.observe(scores["val_loss"])
        if math.isfinite(scores["val_si_sdr"]) and scores["val_si_sdr"] > self.best["val_si_sdr"]:
            self.best = {"val_si_sdr": scores["val_si_sdr"], "step": self.step,
                         "val_sdr": scores["val_sdr"], "val_loss": scores["val_loss"]}
            # last.pt first: a resumed run then always finds its best weights (see _build).
            self._checkpoint()
            if self.main:
                ckpt.copy_checkpoint(ckpt.last_path(self.out_dir), ckpt.best_path(self.out_dir))
        if not self.main:
            return scores
        tqdm.write(f"{self.preset['name']} step {self.step}: val loss {scores['val_loss']:.4f}, "
                   f"SDR {scores['val_sdr']:.2f} dB, SI-SDR {scores['val_si_sdr']:.2f} dB",
                   file=sys.stderr)
        return scores

    # -- endings -------------------------------------------------------------------------------
    def _preempt(self, flag: StopFlag) -> int:
        self._checkpoint()
        if not self.main:   # rank 0 writes the checkpoint and says so
            return EXIT_INTERRUPTED if flag.interrupted else EXIT_PREEMPTED
        if flag.interrupted:
            again = "run the same command" + ("" if self.plan.resume_requested else " with --resume")
            print(f"tiersep train: interrupted at step {self.step} (wrote {ckpt.last_path(self.out_dir)}); "
                  f"{again} to resume", file=sys.stderr)
            return EXIT_INTERRUPTED
        print(f"tiersep train: {flag.name} at step {self.step}: wrote {ckpt.last_path(self.out_dir)}; "
              f"rerun with --resume to continue (exit {EXIT_PREEMPTED})", file=sys.stderr)
        return EXIT_PREEMPTED

    def _out_of_memory(self, err: BaseException) -> int:
        memory = self.plan.probe.sample()
        # Drop references to the failed step's tensors before anything else is written.
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        if not self.main:
            # an OOM of any rank is the tier's: the launcher writes failure.json kind oom from this
            # note, and the retry downshifts every rank's micro-batch
            message = str(err).strip()
            self.notes["oom"] = {"message": message, "step": self.step, "batch_size": self.t["batch_size"],
                                 "grad_accum": self.t["grad_accum"], "memory_at_failure": memory}
            print(f"tiersep train: rank {self.ranks.rank}: out of memory at step {self.step}: "
                  f"{distributed.one_line(err)}", file=sys.stderr)
            return EXIT_OOM
        message = record.write_oom_failure(self, err, memory)
        print(f"tiersep train: out of memory at step {self.step} (micro-batch {self.t['batch_size']}"
              f" x {self.t['grad_accum']}): {message}; wrote {self.out_dir / 'failure.json'} "
              f"(exit {EXIT_OOM})", file=sys.stderr)
        return EXIT_OOM

    def _finish(self) -> int:
        per_rank = distributed.gather(record.rank_memory(self)) if self.ranks is not None else None
        if not self.main:
            return EXIT_OK
        weights_step = record.export_model(self)
        run = record.run_record(self, weights_step)
        if per_rank is not None:
            run["per_rank"] = per_rank
        record.write_run(self.out_dir, run)
        sps = run["steps_per_s"]
        print(f"tiersep train: {self.preset['name']}: {self.step} steps"
              + (f" ({sps:.2f} steps/s)" if sps else "")
              + f", best val SI-SDR {self.best['val_si_sdr']:.2f} dB at step {self.best['step']}; "
              f"wrote {self.out_dir / 'model.pt'}", file=sys.stderr)
        return EXIT_OK
