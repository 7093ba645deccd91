"""Train one preset in this process: gate, loop, validate, checkpoint, record.

Exit codes (returned, the CLI exits with them):
  0  done: model.pt and run.json written
  3  refused before anything was allocated on the device (fit gate, or a GPU-sized preset on CPU);
     failure.json kind "refused"
  4  out of memory; failure.json kind "oom" (the attempted allocation beside the estimate)
  75 stopped by SIGTERM/SIGUSR1 (cluster preemption) after writing checkpoints/last.pt; rerun with
     --resume to continue (EX_TEMPFAIL: "try again later")
Outputs that mean "finished" (model.pt, run.json) are written only at the end, atomically.
"""
from __future__ import annotations

import copy
import math
import os
import re
import signal
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from tqdm import tqdm

from tiersep import config as C
from tiersep.io import read_json, torch_save, write_json
from tiersep.train import checkpoint as ckpt
from tiersep.train.schedule import Schedule
from tiersep.train.step import autocast, make_optimizer, train_step
from tiersep.train.telemetry import (MEMORY_FIELDS, METRICS_FIELDS, CsvLog, MemoryProbe,
                                     column_max, describe_device, host_info, versions)

EXIT_OK, EXIT_REFUSED, EXIT_OOM, EXIT_PREEMPTED = 0, 3, 4, 75
INJECT_OOM_ENV = "TIERSEP_INJECT_OOM"

# A CPU run is refused ("GPU-sized") when one optimisation step would process more than this many
# TF-bin x layer x channel units (batch x accumulation x frames x freq bins x layers x emb_dim).
# Measured on one core: cpu_tiny is 2.6e5 units (0.15 s per step), cpu_small 7.8e5 (0.45 s), so
# the limit is about 6 s per step; the seeds' `small` (2.5e7) takes minutes per step and 10-30 GB
# on a CPU (REFERENCE.md), ultra_safe 4e8.
CPU_MAX_STEP_UNITS = 1.0e7

# Preset fields that may differ between a checkpoint and the run resuming it: they change how a
# step is computed or logged, not what it computes.
RESUMABLE_DIFFERENCES = {("name",), ("description",), ("train", "batch_size"), ("train", "grad_accum"),
                         ("train", "num_workers"), ("train", "checkpoint_every"),
                         ("train", "validate_every"), ("train", "allow_cpu"), ("train", "device")}


class Preempted(Exception):
    """SIGTERM/SIGUSR1 arrived; the loop stops at the next step boundary."""


# ---------------------------------------------------------------------------------------------
# Device, refusal and the fit gate
# ---------------------------------------------------------------------------------------------
def choose_device(preset: dict) -> torch.device:
    wanted = preset["train"]["device"]
    if wanted == "cuda" and not torch.cuda.is_available():
        raise C.ConfigError(f"preset {preset['name']}: train.device: cuda, but no CUDA device is visible")
    if wanted == "cuda" or (wanted == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def step_units(preset: dict) -> float:
    """Work of one optimisation step: samples x frames x freq bins x layers x channels."""
    a, m, t = preset["audio"], preset["model"], preset["train"]
    frames = a["segment_samples"] // a["hop"] + 1
    bins = a["n_fft"] // 2 + 1
    return float(t["batch_size"] * t["grad_accum"] * frames * bins * m["n_layers"]
                 * max(m["emb_dim"], m["attention_dim"]))


def cpu_refusal(preset: dict) -> str | None:
    """The message refusing a GPU-sized preset on CPU, or None when it may run here."""
    units = step_units(preset)
    if preset["train"]["allow_cpu"] or units <= CPU_MAX_STEP_UNITS:
        return None
    return (f"preset {preset['name']} is GPU-sized: one step processes {units:.2e} TF-bin x layer x "
            f"channel units, {units / CPU_MAX_STEP_UNITS:.1f}x the CPU limit of {CPU_MAX_STEP_UNITS:.0e} "
            "(about 6 s per step on one core). Train it on a GPU, or force the CPU with "
            "`--set train.allow_cpu=true`.")


def gate_budget(cfg: dict, device: torch.device, start_free: int) -> int | None:
    """The budget the fit gate checks: the configured GiB capped by what is free now (GPU), or the
    machine's available RAM (CPU)."""
    if device.type != "cuda":
        return start_free
    configured = C.budget_bytes(cfg)
    return start_free if configured is None else min(configured, start_free)


def run_gate(cfg, preset, device, budget, estimate_path):
    """tiersep.memory.gate with the estimate file when it was made for this device and micro-batch."""
    from tiersep.memory import gate

    estimate = None
    if estimate_path is not None and Path(estimate_path).is_file():
        record = read_json(estimate_path)
        same_device = record.get("device") == device.type
        if same_device and record.get("preset") in (None, preset["name"]) and not preset.get("_downshifted"):
            estimate = record
    clean = {k: v for k, v in preset.items() if not k.startswith("_")}
    return gate(clean, device.type, budget, cfg["estimate"]["safety_margin"], estimate=estimate)


# ---------------------------------------------------------------------------------------------
# OOM: parsing, injection (test hook), downshift on retry
# ---------------------------------------------------------------------------------------------
_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40,
          "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}


def attempted_allocation(message: str) -> int | None:
    """Bytes from torch's 'Tried to allocate 2.00 GiB' (None when the message has no such part)."""
    match = re.search(r"Tried to allocate ([\d.]+) ?(B|[KMGT]i?B)", message)
    return int(float(match.group(1)) * _UNITS[match.group(2)]) if match else None


def is_oom(err: BaseException) -> bool:
    return isinstance(err, torch.OutOfMemoryError) or (
        isinstance(err, RuntimeError) and "out of memory" in str(err).lower())


def parse_injection(text: str | None) -> dict | None:
    """TIERSEP_INJECT_OOM="step=3,max_batch=2[,preset=NAME]" -> {"step": 3, "max_batch": 2,
    "preset": NAME or None} (test hook: raise at step 3 while the micro-batch is above 2)."""
    if not text:
        return None
    spec = dict(part.split("=", 1) for part in text.split(",") if part)
    return {"step": int(spec.get("step", 0)), "max_batch": int(spec.get("max_batch", 0)),
            "preset": spec.get("preset")}


def maybe_inject_oom(injection: dict | None, step: int, batch_size: int, preset_name: str) -> None:
    """Raise the error a GPU raises when it runs out (a GPU OOM cannot happen on a CPU machine;
    this lets tests and users rehearse the failure path and the Snakemake retry)."""
    if not injection or injection["preset"] not in (None, preset_name):
        return
    if step == injection["step"] and batch_size > injection["max_batch"]:
        raise torch.OutOfMemoryError(
            "CUDA out of memory. Tried to allocate 2.00 GiB (injected by "
            f"{INJECT_OOM_ENV}: step {step}, micro-batch {batch_size} > {injection['max_batch']})")


def downshift(batch_size: int, grad_accum: int) -> tuple[int, int]:
    """Smaller micro-batch, more accumulation, the same effective batch: halve when even, otherwise
    divide by the smallest prime factor (1 stays 1)."""
    for factor in range(2, batch_size + 1):
        if batch_size % factor == 0:
            return batch_size // factor, grad_accum * factor
    return batch_size, grad_accum


def plan_micro_batch(preset: dict, attempt: int, failure: dict | None, resumed: dict | None):
    """(batch_size, grad_accum, downshifted_from) for this attempt.

    A resumed run keeps the micro-batch of its checkpoint (an earlier downshift stays in force);
    attempt >= 2 after an OOM shrinks the micro-batch that ran out.
    """
    t = preset["train"]
    batch, accum = t["batch_size"], t["grad_accum"]
    effective = batch * accum
    if resumed and resumed.get("batch_size", 0) * resumed.get("grad_accum", 0) == effective:
        batch, accum = resumed["batch_size"], resumed["grad_accum"]
    if attempt >= 2 and failure and failure.get("kind") == "oom":
        failed = (failure.get("batch_size", batch), failure.get("grad_accum", accum))
        if failed[0] * failed[1] == effective:
            new = downshift(*failed)
            if new != failed:
                return new[0], new[1], {"batch_size": failed[0], "grad_accum": failed[1]}
    return batch, accum, None


# ---------------------------------------------------------------------------------------------
# Signals
# ---------------------------------------------------------------------------------------------
class StopFlag:
    """Set by SIGTERM/SIGUSR1; the handler only records the signal (safe at any point)."""

    def __init__(self):
        self.signal: int | None = None

    def __bool__(self) -> bool:
        return self.signal is not None


@contextmanager
def stop_on_signals(flag: StopFlag):
    def handler(signum, _frame):
        flag.signal = signum

    previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        yield flag
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


# ---------------------------------------------------------------------------------------------
# Resume compatibility
# ---------------------------------------------------------------------------------------------
def resume_state(out_dir: Path, preset: dict, resume: bool) -> tuple[dict | None, str | None]:
    """(the checkpoint to continue from, None), or (None, why not) when --resume finds no
    checkpoint written for this same preset. The caller says why once the preset is final."""
    last = ckpt.last_path(out_dir)
    if not resume:
        return None, None
    if not last.is_file():
        return None, f"no checkpoint at {last}"
    state = ckpt.load_checkpoint(last)
    differ = preset_differences(state["preset"], preset)
    if differ:
        return None, (f"{last} was written for a different {preset['name']} preset (differs in "
                      f"{', '.join(differ)})")
    return state, None


def adapt_to_budget(cfg: dict, preset: dict, device: torch.device, budget: int, refused) -> tuple:
    """on_oversize: adapt. Train the nearest variant that fits (the one the gate's refusal names,
    from tiersep.memory.fit), gated again. Returns (preset, estimate, None) or, when no variant
    fits, (preset, None, the refusal message)."""
    from tiersep.memory import DoesNotFit, gate

    if not refused.fitted:
        return preset, None, f"{refused}; on_oversize is adapt, but no variant fits"
    fitted = copy.deepcopy(refused.fitted)
    fitted["name"] = preset["name"]  # the tier keeps its name; run.json records what changed
    try:
        estimate = gate(fitted, device.type, budget, cfg["estimate"]["safety_margin"])
    except DoesNotFit as err:
        return preset, None, f"{refused}; on_oversize is adapt, but the variant still does not fit: {err}"
    fitted["_adapted"] = {"reason": str(refused), "changes": list(refused.suggestion)}
    print(f"tiersep train: adapted {preset['name']} to the budget: {'; '.join(refused.suggestion)}",
          file=sys.stderr)
    return fitted, estimate, None


def preset_differences(a: dict, b: dict, prefix: tuple = ()) -> list[str]:
    """Dotted names of fields that differ between two presets, ignoring RESUMABLE_DIFFERENCES."""
    out = []
    for key in sorted(set(a) | set(b)):
        path = prefix + (key,)
        if path in RESUMABLE_DIFFERENCES or str(key).startswith("_"):
            continue
        va, vb = a.get(key), b.get(key)
        if isinstance(va, dict) and isinstance(vb, dict):
            out += preset_differences(va, vb, path)
        elif va != vb:
            out.append(".".join(map(str, path)))
    return out


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------
def validate(model, loss_fn, mixtures, stems, batch_size, preset, device) -> dict:
    """Mean loss, SDR and SI-SDR (dB, mean over segments and stems) on the fixed valid segments."""
    from tiersep.evaluate.metrics import sdr_torch, si_sdr_torch

    model.eval()
    losses, sdrs, si_sdrs = [], [], []
    with torch.no_grad():
        for start in range(0, mixtures.shape[0], batch_size):
            mix = mixtures[start:start + batch_size].to(device)      # [b, C, S]
            ref = stems[start:start + batch_size].to(device)         # [b, n, C, S]
            with autocast(preset, device.type):
                est = model(mix)
            est = est.float()                                         # [b, n, C, S]
            losses.append(loss_fn(est, ref).float() * mix.shape[0])
            sdrs.append(sdr_torch(est, ref).float().reshape(-1))
            si_sdrs.append(si_sdr_torch(est, ref).float().reshape(-1))
    model.train()
    sdr, si_sdr = torch.cat(sdrs), torch.cat(si_sdrs)
    return {"val_loss": float(torch.stack(losses).sum()) / mixtures.shape[0],
            "val_sdr": float(sdr[torch.isfinite(sdr)].mean()) if torch.isfinite(sdr).any() else math.nan,
            "val_si_sdr": (float(si_sdr[torch.isfinite(si_sdr)].mean())
                           if torch.isfinite(si_sdr).any() else math.nan)}


# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------
def _write_failure(out_dir: Path, kind: str, message: str, **extra) -> None:
    write_json(out_dir / "failure.json", {"kind": kind, "message": message, **extra,
                                          **host_info(), "time": time.strftime("%Y-%m-%dT%H:%M:%S")})


def _clear_finished_outputs(out_dir: Path) -> None:
    """A run that starts (not resumes) must not leave an older model.pt/run.json looking current,
    nor older checkpoints that a later --resume would pick up."""
    for path in (out_dir / "model.pt", out_dir / "run.json", ckpt.last_path(out_dir),
                 ckpt.best_path(out_dir)):
        path.unlink(missing_ok=True)


def train(cfg: dict, preset: dict, data_dir, out_dir, resume: bool = False, estimate_path=None,
          attempt: int = 1) -> int:
    """Train `preset` on the prepared folder `data_dir` into `out_dir`; returns the exit code."""
    wall_start = time.time()
    data_dir, out_dir = Path(data_dir), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    preset = copy.deepcopy(preset)
    name = preset["name"]

    failure_path = out_dir / "failure.json"
    previous_failure = read_json(failure_path) if failure_path.is_file() else None
    state, not_resumed = resume_state(out_dir, preset, resume)

    # Micro-batch plan (downshift after an OOM on a Snakemake retry).
    batch, accum, downshifted_from = plan_micro_batch(
        preset, attempt, previous_failure, state["run"] if state else None)
    if (batch, accum) != (preset["train"]["batch_size"], preset["train"]["grad_accum"]):
        preset["train"]["batch_size"], preset["train"]["grad_accum"] = batch, accum
        preset["_downshifted"] = True
    if downshifted_from:
        print(f"tiersep train: attempt {attempt} after an out-of-memory failure: micro-batch "
              f"{downshifted_from['batch_size']} x {downshifted_from['grad_accum']} -> {batch} x {accum} "
              "(same effective batch)", file=sys.stderr)

    # Before anything is allocated on the device: the baseline, then the refusals.
    device = choose_device(preset)
    probe = MemoryProbe(device)
    start_free = probe.start_free_bytes()
    start_process = probe.process_bytes()
    refusal = cpu_refusal(preset) if device.type == "cpu" else None
    estimate = None
    if refusal is None:
        from tiersep.memory import DoesNotFit

        budget = gate_budget(cfg, device, start_free)
        try:
            estimate = run_gate(cfg, preset, device, budget, estimate_path)
        except DoesNotFit as err:
            refusal, estimate = str(err), getattr(err, "estimate", None)
            if cfg["on_oversize"] == "adapt" and budget is not None:
                preset, adapted_estimate, refusal = adapt_to_budget(cfg, preset, device, budget, err)
                if refusal is None:  # an earlier run of this adapted variant may have left a checkpoint
                    estimate = adapted_estimate
                    state, not_resumed = resume_state(out_dir, preset, resume)
    if refusal is not None:
        _write_failure(out_dir, "refused", refusal, preset=name, device=device.type, attempt=attempt,
                       attempted_allocation_bytes=None,
                       estimate_peak_bytes=estimate.get("peak_bytes") if estimate else None)
        print(f"tiersep train: refused: {refusal}", file=sys.stderr)
        return EXIT_REFUSED
    if previous_failure and previous_failure.get("kind") != "oom":
        previous_failure = None  # only an OOM is "recovered from" by this run
    failure_path.unlink(missing_ok=True)
    if not_resumed:
        print(f"tiersep train: {not_resumed}; starting from scratch", file=sys.stderr)
    if state is None:
        _clear_finished_outputs(out_dir)

    runner = _Run(cfg, preset, data_dir, out_dir, device, probe, estimate, budget, state, attempt,
                  downshifted_from, previous_failure, start_free, start_process, wall_start)
    return runner.run()


class _Run:
    """State of one training process (kept together so the OOM/preemption paths can report it)."""

    def __init__(self, cfg, preset, data_dir, out_dir, device, probe, estimate, budget, state, attempt,
                 downshifted_from, previous_failure, start_free, start_process, wall_start):
        self.cfg, self.preset, self.data_dir, self.out_dir = cfg, preset, data_dir, out_dir
        self.device, self.probe, self.estimate, self.state = device, probe, estimate, state
        self.budget = budget
        self.attempt, self.downshifted_from = attempt, downshifted_from
        self.start_free, self.start_process, self.wall_start = start_free, start_process, wall_start
        self.t = preset["train"]
        self.clean_preset = {k: v for k, v in preset.items() if not k.startswith("_")}
        self.run_info = dict(state["run"]) if state else {}
        self.recovered_from = previous_failure or self.run_info.get("recovered_from")
        self.step = 0
        self.steps_this_process = 0

    # -- setup -------------------------------------------------------------------------------
    def _build(self):
        from tiersep.data.dataset import SegmentDataset, make_loader, validation_segments
        from tiersep.model import build_loss, build_model, count_parameters

        p, t = self.preset, self.t
        sources, segment = p["model"]["sources"], p["audio"]["segment_samples"]
        ckpt.seed_everything(t["seed"])
        self.model = build_model(self.clean_preset).to(self.device)
        self.parameters = count_parameters(self.model)
        self.loss_fn = build_loss(self.clean_preset)
        self.optimizer = make_optimizer(self.model, self.clean_preset, self.device.type)
        self.schedule = Schedule(t)
        self.best = {"val_si_sdr": -math.inf, "step": None}
        self.resumed_from = None
        if self.state is not None:
            ckpt.restore(self.state, model=self.model, optimizer=self.optimizer, schedule=self.schedule)
            self.step = self.resumed_from = int(self.state["step"])
            self.best = dict(self.state["best"])
            # A new best writes last.pt first, then best.pt, so best.pt is never ahead of last.pt;
            # a kill between the two leaves best.pt one best behind: rewrite it from last.pt.
            best_file = ckpt.best_path(self.out_dir)
            best_step = ckpt.load_checkpoint(best_file)["step"] if best_file.is_file() else None
            if self.best.get("step") == self.step and best_step != self.step:
                ckpt.copy_checkpoint(ckpt.last_path(self.out_dir), best_file)
        self.elapsed_before = float(self.run_info.get("train_seconds", 0.0))
        self.dataset = SegmentDataset(self.data_dir, "train", sources, segment, t["seed"], t["augment"])
        self.val_mix, self.val_stems = validation_segments(self.data_dir, sources, segment,
                                                           t["validate_segments"], t["seed"])
        self.make_loader = make_loader
        keep = self.step if self.state is not None else None
        self.metrics = CsvLog(self.out_dir / "metrics.csv", METRICS_FIELDS, keep)
        self.memory = CsvLog(self.out_dir / "memory.csv", MEMORY_FIELDS, keep)

    def _checkpoint(self, path=None):
        self.run_info.update({
            "batch_size": self.t["batch_size"], "grad_accum": self.t["grad_accum"],
            "attempt": self.attempt, "train_seconds": self._train_seconds(),
            "recovered_from": self.recovered_from, "downshifted_from": self.downshifted_from})
        ckpt.save_checkpoint(path or ckpt.last_path(self.out_dir), model=self.model,
                             optimizer=self.optimizer, schedule=self.schedule, step=self.step,
                             best=self.best, preset=self.clean_preset, run=self.run_info)

    def _train_seconds(self) -> float:
        return self.elapsed_before + (time.time() - self.loop_start if hasattr(self, "loop_start") else 0.0)

    # -- loop --------------------------------------------------------------------------------
    def run(self) -> int:
        flag = StopFlag()
        with stop_on_signals(flag):
            try:
                self._build()
                return self._loop(flag)
            except Exception as err:  # noqa: BLE001 - every failure is recorded, then re-raised or mapped
                if is_oom(err):
                    return self._out_of_memory(err)
                _write_failure(self.out_dir, "error", f"{type(err).__name__}: {err}",
                               preset=self.preset["name"], step=self.step, attempt=self.attempt,
                               attempted_allocation_bytes=None,
                               estimate_peak_bytes=(self.estimate or {}).get("peak_bytes"))
                raise
            finally:
                for log in ("metrics", "memory"):
                    if hasattr(self, log):
                        getattr(self, log).close()

    def _loop(self, flag: StopFlag) -> int:
        t, steps = self.t, self.t["steps"]
        micro, accum = t["batch_size"], t["grad_accum"]
        injection = parse_injection(os.environ.get(INJECT_OOM_ENV))
        base_lrs = [t["lr"] for _ in self.optimizer.param_groups]
        if self.state is not None:
            ckpt.set_rng_state(self.state["rng"])  # last, so nothing in setup consumes it
            self.state = None
        self.model.train()
        self.loop_start = time.time()
        recent: list[float] = []
        bar = tqdm(total=steps, initial=self.step, desc=self.preset["name"], unit="step",
                   dynamic_ncols=True, mininterval=0.5, file=sys.stderr)
        with ckpt.preserved_rng():
            loader = self.make_loader(self.dataset, micro * accum, t["num_workers"], self.step, stop_step=steps) \
                if self.step < steps else iter(())
            batches = iter(loader)
        try:
            if flag:
                return self._preempt(flag, bar)
            while self.step < steps:
                # The loader may draw from the global generators (DataLoader seeds its workers from
                # torch's): keep it invisible to them, so dropout draws the same numbers whether the
                # loader was created at step 0 or at a resumed step.
                tick = time.time()
                with ckpt.preserved_rng():
                    data_step, mixture, stems = next(batches)
                assert data_step == self.step, f"loader at step {data_step}, expected {self.step}"
                maybe_inject_oom(injection, data_step, micro, self.preset["name"])
                factor = self.schedule.factor(data_step)
                for group, base in zip(self.optimizer.param_groups, base_lrs):
                    group["lr"] = base * factor
                # The effective batch [micro*accum, ...] split into `accum` micro-batches [micro, ...]:
                # the same samples whatever the split, so a downshifted retry sees the same data.
                chunks = [(m.to(self.device, non_blocking=True), s.to(self.device, non_blocking=True))
                          for m, s in zip(mixture.split(micro), stems.split(micro))]
                loss, grad_norm = train_step(self.model, self.loss_fn, self.optimizer, chunks,
                                             self.clean_preset, self.device.type)
                loss, grad_norm = float(loss), float(grad_norm)
                if not math.isfinite(loss):
                    raise FloatingPointError(f"loss is {loss} at step {data_step + 1}")
                self.step = data_step + 1
                self.steps_this_process += 1
                recent = (recent + [time.time() - tick])[-20:]
                steps_per_s = len(recent) / sum(recent)
                row = {"step": self.step, "time_s": round(self._train_seconds(), 3), "loss": loss,
                       "lr": t["lr"] * factor, "grad_norm": grad_norm, "steps_per_s": steps_per_s}
                if self.step % t["validate_every"] == 0 or self.step == steps:
                    row.update(self._validate())
                self.metrics.append(row)
                self.memory.append({"step": self.step, **self.probe.sample()})
                if self.step % t["checkpoint_every"] == 0 or self.step == steps:
                    self._checkpoint()
                bar.set_postfix_str(f"loss {loss:.4f} lr {row['lr']:.2e} {steps_per_s:.2f} st/s "
                                    f"{self.probe.postfix()}", refresh=False)
                bar.update(1)
                if flag and self.step < steps:
                    return self._preempt(flag, bar)
        finally:
            bar.close()
            close = getattr(loader, "close", None)
            if close:
                close()
        return self._finish()

    def _validate(self) -> dict:
        scores = validate(self.model, self.loss_fn, self.val_mix, self.val_stems,
                          self.t["batch_size"], self.preset, self.device)
        self.schedule.observe(scores["val_loss"])
        if math.isfinite(scores["val_si_sdr"]) and scores["val_si_sdr"] > self.best["val_si_sdr"]:
            self.best = {"val_si_sdr": scores["val_si_sdr"], "step": self.step,
                         "val_sdr": scores["val_sdr"], "val_loss": scores["val_loss"]}
            # last.pt first: a resumed run then always finds its best weights (see _build).
            self._checkpoint()
            ckpt.copy_checkpoint(ckpt.last_path(self.out_dir), ckpt.best_path(self.out_dir))
        tqdm.write(f"{self.preset['name']} step {self.step}: val loss {scores['val_loss']:.4f}, "
                   f"SDR {scores['val_sdr']:.2f} dB, SI-SDR {scores['val_si_sdr']:.2f} dB",
                   file=sys.stderr)
        return scores

    # -- endings -----------------------------------------------------------------------------
    def _preempt(self, flag: StopFlag, bar) -> int:
        self._checkpoint()
        bar.close()
        print(f"tiersep train: {signal.Signals(flag.signal).name} at step {self.step}: wrote "
              f"{ckpt.last_path(self.out_dir)}; rerun with --resume to continue (exit "
              f"{EXIT_PREEMPTED})", file=sys.stderr)
        return EXIT_PREEMPTED

    def _out_of_memory(self, err: BaseException) -> int:
        message = str(err).strip()
        memory = self.probe.sample()
        est = self.estimate or {}
        # Drop references to the failed step's tensors before anything else is written.
        self.optimizer.zero_grad(set_to_none=True) if hasattr(self, "optimizer") else None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        _write_failure(
            self.out_dir, "oom", message.splitlines()[0] if message else "out of memory",
            full_message=message, preset=self.preset["name"], step=self.step, attempt=self.attempt,
            device=describe_device(self.device), batch_size=self.t["batch_size"],
            grad_accum=self.t["grad_accum"], precision=self.t["precision"],
            attempted_allocation_bytes=attempted_allocation(message),
            estimate_peak_bytes=est.get("peak_bytes"),
            estimate_largest_allocation_bytes=est.get("largest_allocation_bytes"),
            estimate_method=est.get("method"), budget_bytes=self.budget,
            memory_at_failure=memory, start_free_bytes=self.start_free,
            next_attempt=("halves the micro-batch and doubles accumulation"
                          if self.t["batch_size"] > 1 else "nothing left to halve (micro-batch 1)"))
        print(f"tiersep train: out of memory at step {self.step} (micro-batch {self.t['batch_size']}"
              f" x {self.t['grad_accum']}): {message.splitlines()[0] if message else ''}; wrote "
              f"{self.out_dir / 'failure.json'} (exit {EXIT_OOM})", file=sys.stderr)
        return EXIT_OOM

    def _finish(self) -> int:
        t = self.t
        export = t["export"]
        best_file = ckpt.best_path(self.out_dir)
        weights, weights_step = self.model.state_dict(), self.step
        if export == "best" and best_file.is_file() and self.best.get("step") is not None:
            best_state = ckpt.load_checkpoint(best_file)
            if best_state["step"] == self.best["step"]:
                weights, weights_step = best_state["model"], self.best["step"]
            else:
                print(f"tiersep train: {best_file} holds step {best_state['step']}, not the best step "
                      f"{self.best['step']}; exporting the last weights", file=sys.stderr)
        weights = {k: v.detach().cpu() for k, v in weights.items()}
        torch_save({"model": weights, "preset": self.clean_preset, "step": int(weights_step),
                    "final_step": self.step, "export": export}, self.out_dir / "model.pt")
        peak_alloc, peak_reserved = self.probe.peaks()
        # Peaks over every process that worked on this run (a resumed run has several).
        peak_alloc = max(peak_alloc, column_max(self.out_dir / "memory.csv", "peak"))
        peak_reserved = max(peak_reserved, column_max(self.out_dir / "memory.csv", "reserved"))
        loop_seconds = time.time() - self.loop_start
        est = self.estimate or {}
        record = {
            "preset": self.preset["name"], **host_info(), "device": describe_device(self.device),
            "device_type": self.device.type, "start_free_bytes": self.start_free,
            "start_process_bytes": self.start_process,
            "peak_allocated_bytes": peak_alloc, "peak_reserved_bytes": peak_reserved,
            "wall_seconds": round(time.time() - self.wall_start, 3),
            "train_seconds": round(self._train_seconds(), 3),
            "steps": self.step, "steps_this_process": self.steps_this_process,
            "steps_per_s": (self.steps_this_process / loop_seconds) if loop_seconds > 0 else None,
            "parameters": self.parameters,
            "attention_backend": est.get("attention_backend", self.preset["model"]["attention_backend"]),
            "precision": t["precision"], "batch_size": t["batch_size"], "grad_accum": t["grad_accum"],
            "effective_batch": t["batch_size"] * t["grad_accum"], "lr": t["lr"], "seed": t["seed"],
            "attempt": self.attempt, "downshifted_from": self.downshifted_from,
            "recovered_from": self.recovered_from, "resumed_from": self.resumed_from,
            "best": {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                     for k, v in self.best.items()},
            "exported": {"weights": export, "step": int(weights_step)},
            "versions": versions(), "torch_threads": torch.get_num_threads(),
            "estimate": ({k: est.get(k) for k in ("peak_bytes", "largest_allocation_bytes", "method",
                                                   "device", "budget_bytes", "fits", "uncertainty",
                                                   "attention_backend")} if est else None),
            "gate_budget_bytes": self.budget,
            "adapted": self.preset.get("_adapted"),
        }
        write_json(self.out_dir / "run.json", record)
        sps = record["steps_per_s"]
        print(f"tiersep train: {self.preset['name']}: {self.step} steps"
              + (f" ({sps:.2f} steps/s)" if sps else "")
              + f", best val SI-SDR {self.best['val_si_sdr']:.2f} dB at step {self.best['step']}; "
              f"wrote {self.out_dir / 'model.pt'}", file=sys.stderr)
        return EXIT_OK
