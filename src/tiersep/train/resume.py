"""Resuming a run: which checkpoint continues it, and whether it was written for the same preset.

A checkpoint continues the run when its preset is the same (up to RESUMABLE_DIFFERENCES), or when
only `train.steps` grew: then the run trains longer, from the checkpoint to the new step count
(`extension`). Any other difference starts a new run, and the trainer moves the old one aside
(tiersep.outputs.move_aside); nothing is deleted."""
from __future__ import annotations

import sys
from pathlib import Path

from tiersep.train import checkpoint as ckpt

# Preset fields that may differ between a checkpoint and the run resuming it: they change how a
# step is computed or logged, not what it computes.
RESUMABLE_DIFFERENCES = {("name",), ("description",), ("train", "batch_size"), ("train", "grad_accum"),
                         ("train", "num_workers"), ("train", "checkpoint_every"),
                         ("train", "validate_every"), ("train", "allow_cpu"), ("train", "device"),
                         ("train", "compile"), ("train", "compile_mode"),
                         ("train", "cuda_expandable_segments"), ("train", "ranks"), ("train", "nodes")}


def resume_state(out_dir: Path, preset: dict, resume: bool,
                 warnings: list[str] | None = None) -> tuple[dict | None, str | None]:
    """(the checkpoint to continue from, None), or (None, why not) when --resume finds no
    checkpoint written for this same preset. The caller says why once the preset is final.

    A damaged last.pt (checkpoint.load_resume_checkpoint): the previous checkpoint continues the
    run (said here), or the run starts over (the warning is the reason); either way the warning
    is appended to `warnings`, for run.json's resume_warning."""
    last = ckpt.last_path(out_dir)
    if not resume:
        return None, None
    state, warning = ckpt.load_resume_checkpoint(out_dir)
    if warning and warnings is not None:
        warnings.append(warning)
    if state is None:
        return None, warning or f"no checkpoint at {last}"
    if warning:
        print(f"tiersep train: warning: {warning}", file=sys.stderr)
    differ = preset_differences(state["preset"], preset)
    before, now = state["preset"]["train"], preset["train"]
    if before.get("ranks", 1) != now["ranks"] and effective_batch(before) != effective_batch(now):
        # another world size continues the run only with the same effective batch
        return None, (f"{last} was trained with an effective batch of {effective_batch(before)} "
                      f"(ranks x batch_size x grad_accum); this {preset['name']} has {effective_batch(now)}")
    if extension(state, preset) is not None:
        return state, None
    if differ:
        return None, (f"{last} was written for a different {preset['name']} preset (differs in "
                      f"{', '.join(differ)})")
    return state, None


def effective_batch(train: dict) -> int:
    """Segments per optimisation step: ranks x micro-batch x accumulation."""
    return train.get("ranks", 1) * train["batch_size"] * train["grad_accum"]


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


def extension(state: dict, preset: dict) -> dict | None:
    """{"steps": the checkpoint's train.steps, "step": its step} when `preset` differs from the
    checkpoint's only in a larger train.steps (train longer), else None."""
    before = state["preset"]["train"]["steps"]
    if preset_differences(state["preset"], preset) == ["train.steps"] and preset["train"]["steps"] > before:
        return {"steps": int(before), "step": int(state["step"])}
    return None
