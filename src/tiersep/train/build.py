"""Setting up one training process before its first step, on a Training `run` (tiersep.train.loop):
the model, loss, optimizer and lr schedule (restored from the checkpoint on a resume); the module the
step calls (DistributedDataParallel on a data-parallel tier, torch.compile'd when the plan says so,
with its eager fallback and the gate checked again for the eager step); the data and the logs."""
from __future__ import annotations

import math
import os

from tiersep.malloc import trimmed_heap
from tiersep.train import checkpoint as ckpt
from tiersep.train.schedule import Schedule
from tiersep.model.ema import Ema
from tiersep.model.step import LossScaler, make_optimizer
from tiersep.train.telemetry import MEMORY_FIELDS, METRICS_FIELDS, CsvLog, SegmentTrace
from tiersep.train.tracking import Tracker

COMPILE_BACKEND_ENV = "TIERSEP_COMPILE_BACKEND"


def build(run) -> None:
    """Everything `run` needs for its first step, in an order that keeps the random draws of a
    fresh and a resumed run the same (seeded first, then the model)."""
    from tiersep.data.dataset import SegmentDataset, make_loader, rank_segments, validation_segments
    from tiersep.model import build_loss, build_model, count_parameters

    p, t, state = run.preset, run.t, run.plan.resume
    ckpt.seed_everything(t["seed"])
    run.model = build_model(p).to(run.device)
    run.ema = Ema.from_preset(run.model, p)   # the initial weights, before the optimizer's state
    if (run.plan.malloc or {}).get("trim_heap"):   # booked so (plan.host_malloc)
        run.model.checkpoint_context = trimmed_heap
    run.parameters = count_parameters(run.model)
    run.loss_fn = build_loss(p)
    run.optimizer = make_optimizer(run.model, p, run.device.type)
    run.schedule = Schedule(t)
    run.scaler = LossScaler.from_preset(p, run.device.type)   # fp16 only
    run.best = {"val_si_sdr": -math.inf, "step": None}
    if state is not None:
        _restore(run, state)
    run.step_model = _compiled(run, _data_parallel(run, run.model))
    run.elapsed_before = float(run.run_info.get("train_seconds", 0.0))
    sources, segment = p["model"]["sources"], p["audio"]["segment_samples"]
    run.dataset = SegmentDataset(run.data_dir, "train", sources, segment, t["seed"], t["augment"])
    run.segments = (rank_segments(t["batch_size"], t["grad_accum"], run.ranks.rank, run.ranks.world)
                    if run.ranks else None)
    run.trace = SegmentTrace.from_env(run.ranks.rank if run.ranks else 0)
    run.make_loader = make_loader
    if not run.main:
        return   # rank 0 validates and writes the logs
    run.val_mix, run.val_stems = validation_segments(run.data_dir, sources, segment,
                                                     t["validate_segments"], t["seed"])
    keep = run.step if state is not None else None
    run.metrics = CsvLog(run.out_dir / "metrics.csv", METRICS_FIELDS, keep)
    run.memory = CsvLog(run.out_dir / "memory.csv", MEMORY_FIELDS, keep)
    run.audio_samples = int(run.cfg["tracking"]["audio_seconds"] * p["audio"]["sample_rate"])
    run.tracker = Tracker.open(run.cfg, run.out_dir, p, run.device.type, run.step, run.run_info,
                               run.plan.estimate)


def _restore(run, state: dict) -> None:
    """Continue from the checkpoint `state`: weights, optimizer, schedule, step and best score."""
    ckpt.restore(state, model=run.model, optimizer=run.optimizer, schedule=run.schedule, ema=run.ema,
                 scaler=run.scaler)
    run.step = run.resumed_from = int(state["step"])
    run.best = dict(state["best"])
    # A new best writes last.pt first, then best.pt, so best.pt is never ahead of last.pt;
    # a kill between the two leaves best.pt one best behind: rewrite it from last.pt.
    best_file = ckpt.best_path(run.out_dir)
    best_step = ckpt.load_checkpoint(best_file)["step"] if best_file.is_file() else None
    if run.best.get("step") == run.step and best_step != run.step and run.main:
        ckpt.copy_checkpoint(ckpt.last_path(run.out_dir), best_file)


def _data_parallel(run, model):
    """The module the step runs: the model in DistributedDataParallel on a data-parallel tier
    (it broadcasts rank 0's weights now, and averages gradients in backward), else the model.
    gradient_as_bucket_view: the gradients live in DDP's buckets instead of beside them (one
    gradient-sized copy less per rank, REFERENCE.md)."""
    if run.ranks is None:
        return model
    from torch.nn.parallel import DistributedDataParallel

    ids = [run.device.index] if run.device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=ids, gradient_as_bucket_view=True)


def _compiled(run, model):
    """The model the training step calls: torch.compile'd when the plan says so, with inductor's
    cache shared by the run folders beside this one: every tier of results/train/, every trial of a
    search's trials/ (a study compiles once)."""
    if not run.plan.compile:
        run.compile_info["reason"] = f"train.compile {run.t['compile']} on {run.device.type}"
        return model
    from tiersep.model.compile import compile_model

    # TIERSEP_COMPILE_BACKEND (e.g. aot_eager) bisects a compile problem without inductor
    backend = os.environ.get(COMPILE_BACKEND_ENV, "inductor")
    compiled, info = compile_model(model, run.t["compile_mode"], run.out_dir.parent / ".compile_cache",
                                   backend=backend, before_eager=lambda reason: _regate_eager(run, reason))
    # from now on the same dict the fallback updates, so run.json sees it (with what was set
    # before: requested, and a re-check made when torch.compile itself refused)
    info.update({k: v for k, v in run.compile_info.items() if k not in info})
    run.compile_info = info
    return compiled


def _regate_eager(run, reason: str) -> None:
    """The compile failed and the steps run eagerly from now on: when the gate booked the compiled
    step, check that the eager one fits the budget too (raises DoesNotFit, recorded as a refusal)."""
    if not (run.plan.estimate or {}).get("compiled") or run.plan.budget is None:
        return
    from tiersep.memory import gate

    run.plan.estimate = gate(run.preset, run.device.type, run.plan.budget, run.plan.gate_settings, compiled=False)
    run.compile_info["regated"] = (f"the eager step's estimate, {run.plan.estimate['gate_required_bytes']} "
                                   "bytes, fits the budget")
