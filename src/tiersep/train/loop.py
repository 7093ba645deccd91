"""The training loop: one process carrying out a RunPlan step by step (on every rank of a
data-parallel tier), validating and checkpointing on the preset's schedule, and stopping at a step
boundary on a signal. Setting up is in build.py, every way it ends in endings.py; a Training's
state is what the endings and run.json (record.py) report."""
from __future__ import annotations

import math
import os
import sys
import time

import torch
from tqdm import tqdm

from tiersep.train import checkpoint as ckpt
from tiersep.train import distributed, endings
from tiersep.train.build import build
from tiersep.train.job import TrainJob
from tiersep.train.oom import INJECT_OOM_ENV, maybe_inject_oom, parse_injection
from tiersep.train.plan import RunPlan
from tiersep.train.signals import StopFlag, stop_on_signals
from tiersep.model.step import train_step
from tiersep.train.validation import validate

# Test hook: "A" or "A-B", the data steps (0-based, as the OOM hook's) whose mixture is made inf:
# a real non-finite forward and backward, for the fp16 scaler's skip and collapse (tests/test_train_fp16.py);
# "A@R": in data-parallel rank R only (tests/test_ddp.py: one rank's overflow skips the step on all).
INJECT_INF_ENV = "TIERSEP_INJECT_INF"


def inf_steps(text: str | None, rank: int = 0) -> range:
    """The data steps whose mixture this rank makes inf (INJECT_INF_ENV)."""
    if not text:
        return range(0)
    steps, _, only = text.partition("@")
    if only and int(only) != rank:
        return range(0)
    first, _, last = steps.partition("-")
    return range(int(first), int(last or first) + 1)


class Training:
    """One training process carrying out a RunPlan; its state is what the endings report."""

    def __init__(self, plan: RunPlan, job: TrainJob, history: dict, ranks: distributed.Ranks | None = None,
                 notes: dict | None = None):
        self.plan, self.data_dir, self.out_dir, self.wall_start = plan, job.data_dir, job.out_dir, job.wall_start
        self.cfg = job.cfg
        self.preset, self.device, self.t = plan.preset, plan.device, plan.preset["train"]
        # data-parallel: this rank's place; only rank 0 (main) writes the run folder
        self.ranks, self.notes = ranks, notes if notes is not None else {}
        self.main = ranks is None or ranks.is_main
        # bookkeeping carried by every checkpoint of this run (run.json reads it at the end)
        self.run_info = {**(dict(plan.resume["run"]) if plan.resume else {}), **history}
        self.step = self.steps_this_process = 0
        self.resumed_from = None
        self.loop_start = None
        # set by build(): model, parameters, loss_fn, optimizer, schedule, best, step_model, dataset,
        # segments, trace, make_loader, ema (train.ema), scaler (fp16); on rank 0 val_mix, val_stems,
        # the logs metrics and memory, and the tracker (TensorBoard, W&B: tracking.py) fed the same rows
        self.model = self.optimizer = self.metrics = self.memory = self.tracker = self.ema = None
        self.scaler = None
        self.compile_info = {"requested": plan.preset["train"]["compile"], "compiled": False, "reason": None}

    def checkpoint(self) -> None:
        """checkpoints/last.pt with this run's bookkeeping (rank 0; the other ranks hold the same state)."""
        if not self.main:
            return
        self.run_info.update({
            "batch_size": self.t["batch_size"], "grad_accum": self.t["grad_accum"], "ranks": self.t["ranks"],
            "attempt": self.plan.attempt, "train_seconds": self.train_seconds(),
            "recovered_from": self.plan.recovered_from, "downshifted_from": self.plan.downshifted_from})
        ckpt.save_checkpoint(ckpt.last_path(self.out_dir), model=self.model, optimizer=self.optimizer,
                             schedule=self.schedule, step=self.step, best=self.best, preset=self.preset,
                             run=self.run_info, ema=self.ema, scaler=self.scaler)

    def train_seconds(self) -> float:
        return self.elapsed_before + (time.time() - self.loop_start if self.loop_start else 0.0)

    # -- the loop ------------------------------------------------------------------------------
    def run(self) -> int:
        flag = StopFlag()
        with stop_on_signals(flag):
            try:
                build(self)
                return self._loop(flag)
            except Exception as err:  # noqa: BLE001 - every failure is recorded, then re-raised or mapped
                code = endings.failure(self, err)
                if code is None:
                    raise
                return code
            finally:
                for log in (self.metrics, self.memory, self.tracker):
                    if log is not None:
                        log.close()

    def _loop(self, flag: StopFlag) -> int:
        t, steps, micro = self.t, self.t["steps"], self.t["batch_size"]
        rank, injection, poisoned = self._test_hooks()
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
                mixture = torch.full_like(mixture, math.inf) if data_step in poisoned else mixture
                self.trace.write(data_step, self.segments, mixture)
                maybe_inject_oom(injection, data_step, micro, self.preset["name"], rank)
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
                # for the curves only (metrics.csv keeps its columns): this step's time, and the
                # samples per second of all ranks at the recent step rate
                row["step_time_s"] = elapsed
                row["samples_per_s"] = (row["steps_per_s"] * micro * t["grad_accum"] * t["ranks"]
                                        if row["steps_per_s"] else None)
                audio = None
                if self.step % t["validate_every"] == 0 or self.step == steps:
                    scores, audio = self._validate()
                    row.update(scores)
                self._log(row, audio)
                if self.step % t["checkpoint_every"] == 0 or self.step == steps:
                    self.checkpoint()
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
            return endings.preempt(self, flag)
        return endings.finish(self)

    def _test_hooks(self) -> tuple[int, dict | None, range]:
        """(this rank, the OOM injection, the data steps made inf) of the test hooks' variables."""
        rank = self.ranks.rank if self.ranks else 0
        return rank, parse_injection(os.environ.get(INJECT_OOM_ENV)), inf_steps(os.environ.get(INJECT_INF_ENV), rank)

    def _log(self, row: dict, audio: dict | None) -> None:
        """The step's rows in metrics.csv and memory.csv, and the same rows to the tracker's
        curves (with the validation's audio), on rank 0; every rank samples its memory (run.json's peaks)."""
        memory = self.plan.probe.sample()
        if not self.main:
            return
        self.metrics.append(row)
        self.memory.append({"step": self.step, **memory})
        self.tracker.log_step(self.step, row, memory)
        if audio is not None:
            self.tracker.log_validation(self.step, row, audio)
        self.tracker.flush()

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
                                     self.device.type, ema=self.ema, scaler=self.scaler)
        loss, grad_norm = float(loss), float(grad_norm)
        if self.ranks is not None:   # each rank's loss is over its share; the step's is their mean
            loss = distributed.mean_over_ranks(loss, self.device)
        # fp16: a non-finite loss gives non-finite gradients, and the scaler skipped that step (the
        # weights did not move); only a run of such steps stops it (ScaleCollapsed)
        if not math.isfinite(loss) and self.scaler is None:
            raise FloatingPointError(f"loss is {loss} at step {data_step + 1}")
        if self.scaler is not None and self.scaler.collapsed:
            raise endings.ScaleCollapsed(data_step + 1, self.scaler)
        self.step = data_step + 1
        self.steps_this_process += 1
        row = {"step": self.step, "time_s": round(self.train_seconds(), 3), "loss": loss,
               "lr": t["lr"] * factor, "grad_norm": grad_norm}
        if self.scaler is not None:
            row.update(scale=self.scaler.scale(), skipped=self.scaler.skipped)
        return row

    def _validate(self) -> tuple[dict, dict]:
        """Validation on rank 0 (the only one with the validation segments); the other ranks wait
        for its scores, which their plateau schedule and best-score bookkeeping need too. With
        train.ema the EMA weights are scored too (the *_ema columns): the plateau schedule follows
        the EMA's loss, and best.pt keeps whichever of raw and EMA has the higher SI-SDR.
        Returns (scores, audio for the curves: empty on the other ranks)."""
        scores, audio = self._scores() if self.main else (None, {})
        if self.ranks is not None:
            scores = distributed.from_main(scores)
        held = "ema" if self.ema is not None else "raw"
        self.schedule.observe(scores["val_loss_ema" if held == "ema" else "val_loss"])
        if self.ema is not None and not scores["val_si_sdr_ema"] >= scores["val_si_sdr"]:
            held = "raw"   # the raw weights scored higher (or the EMA's score is not finite)
        suffix = "_ema" if held == "ema" else ""
        chosen = {k: scores[k + suffix] for k in ("val_si_sdr", "val_sdr", "val_loss")}
        if math.isfinite(chosen["val_si_sdr"]) and chosen["val_si_sdr"] > self.best["val_si_sdr"]:
            self.best = {"val_si_sdr": chosen["val_si_sdr"], "step": self.step,
                         "val_sdr": chosen["val_sdr"], "val_loss": chosen["val_loss"],
                         **({"weights": held} if self.ema is not None else {})}
            # last.pt first: a resumed run then always finds its best weights (see build._restore).
            self.checkpoint()
            if self.main:
                ckpt.copy_checkpoint(ckpt.last_path(self.out_dir), ckpt.best_path(self.out_dir))
        if not self.main:
            return scores, audio
        ema = f" (EMA {scores['val_si_sdr_ema']:.2f} dB)" if self.ema is not None else ""
        tqdm.write(f"{self.preset['name']} step {self.step}: val loss {scores['val_loss']:.4f}, "
                   f"SDR {scores['val_sdr']:.2f} dB, SI-SDR {scores['val_si_sdr']:.2f} dB{ema}",
                   file=sys.stderr)
        return scores, audio

    def _scores(self) -> tuple[dict, dict]:
        """(the raw weights' validation scores, and the EMA weights' as *_ema (train.ema); the raw
        weights' audio clips for the curves)."""
        args = (self.loss_fn, self.val_mix, self.val_stems, self.t["batch_size"], self.preset, self.device)
        scores, audio = validate(self.model, *args, self.audio_samples)
        if self.ema is not None:
            ema_scores, _ = validate(self.ema.module(self.model), *args)
            scores.update({f"{k}_ema": v for k, v in ema_scores.items()})
        return scores, audio

