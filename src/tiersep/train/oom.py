"""Out of memory: recognising it, rehearsing it (test hook), and the downshifted retry."""
from __future__ import annotations

import re

import torch

INJECT_OOM_ENV = "TIERSEP_INJECT_OOM"

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
    """TIERSEP_INJECT_OOM="step=3,max_batch=2[,preset=NAME][,rank=R]" -> {"step": 3, "max_batch": 2,
    "preset": NAME or None, "rank": R or None} (test hook: raise at step 3 while the micro-batch is
    above 2; with rank, only in that data-parallel rank)."""
    if not text:
        return None
    spec = dict(part.split("=", 1) for part in text.split(",") if part)
    return {"step": int(spec.get("step", 0)), "max_batch": int(spec.get("max_batch", 0)),
            "preset": spec.get("preset"), "rank": int(spec["rank"]) if spec.get("rank") else None}


def maybe_inject_oom(injection: dict | None, step: int, batch_size: int, preset_name: str, rank: int = 0) -> None:
    """Raise the error a GPU raises when it runs out (a GPU OOM cannot happen on a CPU machine;
    this lets tests and users rehearse the failure path and the Snakemake retry)."""
    if not injection or injection["preset"] not in (None, preset_name):
        return
    if injection.get("rank") is not None and injection["rank"] != rank:
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
    # (on the same number of ranks: another world size starts from the preset's micro-batch)
    if (resumed and resumed.get("ranks", 1) == t["ranks"]
            and resumed.get("batch_size", 0) * resumed.get("grad_accum", 0) == effective):
        batch, accum = resumed["batch_size"], resumed["grad_accum"]
    if attempt >= 2 and failure and failure.get("kind") == "oom":
        failed = (failure.get("batch_size", batch), failure.get("grad_accum", accum))
        if failed[0] * failed[1] == effective:
            new = downshift(*failed)
            if new != failed:
                return new[0], new[1], {"batch_size": failed[0], "grad_accum": failed[1]}
    return batch, accum, None
