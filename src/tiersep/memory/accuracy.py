"""How far a CUDA trace estimate can be trusted: the uncertainty of its class, from GPU evidence.

A class is what changes how the trace can err (issue 31: as fine as the evidence): the attention
kernel (flash, efficient or math), the dtype (fp32, bf16 or fp16), activation checkpointing, the
caching allocator's mode (native or expandable segments), the step (eager or compiled) and the GPU
generation (tiersep.gpu_catalogue: Turing, Ampere, Hopper...). The evidence is the CI accuracy
test's data, real GPU measurements compared with the estimate (tests/test_memory_cuda_accuracy.py);
`python -m tiersep.memory.evidence --write` turns it into accuracy_evidence.json, read here, and into
the table in docs/memory.md.

A class with evidence gets the accuracy target the test holds every configuration to (1.5%), or
its worst OUT-OF-SAMPLE device-use under-estimate when that is larger: each row's error with every
figure fitted on it refitted without it (memory/evidence.py: out_of_sample). A class never measured
on a GPU (every generation but Hopper, today), or measured only on rows a figure was fitted on,
gets NO_EVIDENCE_UNCERTAINTY, and its record says so.
"""
from __future__ import annotations

import functools
import json
import math
from pathlib import Path

EVIDENCE_FILE = Path(__file__).with_name("accuracy_evidence.json")
CLASS_KEYS = ("attention", "dtype", "checkpointing", "allocator", "step", "generation")
# What the accuracy test holds reserved and device use to, for every configuration.
TARGET = 0.015
# A class no GPU has measured: the uncertainty of the analytic closed form (analytic.UNCERTAINTY).
# The trace's rules were each modelled after an H100 showed the gap; before the last ones a math
# step was 9-12% under, so a class never checked is not trusted within 1.5%.
NO_EVIDENCE_UNCERTAINTY = 0.10


def estimate_class(record: dict) -> dict:
    """The class of a CUDA estimate record: its attention_backend (the kernel the trace ran),
    precision, checkpointing, allocator, compiled and gpu (the generation modelled) fields."""
    allocator = record.get("allocator") or {}
    return {"attention": record.get("attention_backend") or "unknown",
            "dtype": record.get("precision") or "fp32",
            "checkpointing": bool(record.get("checkpointing")),
            "allocator": "expandable" if allocator.get("expandable_segments") else "native",
            "step": "compiled" if record.get("compiled") else "eager",
            "generation": (record.get("gpu") or {}).get("generation") or "any sm80+"}


def class_label(cls: dict) -> str:
    """e.g. "flash attention, bf16, checkpointed, native allocator, eager step, Hopper"."""
    return (f"{cls['attention']} attention, {cls['dtype']}, "
            f"{'checkpointed' if cls['checkpointing'] else 'no checkpointing'}, "
            f"{cls['allocator']} allocator, {cls['step']} step, {cls['generation']}")


def class_key(cls: dict) -> tuple:
    return tuple(cls.get(k) for k in CLASS_KEYS)   # a file from before a key was added matches nothing


def uncertainty_of_errors(device_errors: list[float]) -> float:
    """A class's uncertainty from its configurations' device-use errors (rounded up to 0.1%): the
    target, or its worst under-estimate when that is larger. The gate adds it to the estimate, so it
    must cover an estimate below what the GPU used; one above it is already booked by the estimate."""
    worst = max((-e for e in device_errors), default=0.0)
    return max(TARGET, math.ceil(round(worst * 1000, 6)) / 1000)


@functools.lru_cache(maxsize=1)
def load_evidence(path: Path = EVIDENCE_FILE) -> dict:
    """accuracy_evidence.json by class key; {} when it is missing (every class then has none)."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        return {}
    return {class_key(entry["class"]): entry for entry in data["classes"]}


def uncertainty(cls: dict) -> tuple[float, str]:
    """(the uncertainty to book for class `cls`, one line saying what it rests on)."""
    entry = load_evidence().get(class_key(cls))
    if entry is None:
        return NO_EVIDENCE_UNCERTAINTY, (f"no GPU measurement of this class ({class_label(cls)}): booked "
                                         f"conservatively at {NO_EVIDENCE_UNCERTAINTY:.0%}")
    configs = entry["configurations"]
    errors = [c["out_of_sample_error"] for c in configs if c.get("out_of_sample_error") is not None]
    if not errors:
        return entry["uncertainty"], (f"no out-of-sample GPU measurement of this class ({class_label(cls)}; its "
                                      f"{len(configs)} were each fitted on): booked conservatively at "
                                      f"{entry['uncertainty']:.0%}")
    return entry["uncertainty"], (f"{len(errors)} out-of-sample GPU measurement{'s' * (len(errors) != 1)} of this "
                                  f"class ({class_label(cls)}; of {len(configs)}): device use "
                                  f"{min(errors):+.2%}..{max(errors):+.2%} (docs/memory.md, accuracy by class)")


def has_evidence(cls: dict) -> bool:
    return class_key(cls) in load_evidence()


def worst_under(cls: dict) -> float | None:
    """The most negative device-use error of the class's GPU measurements, in or out of sample (an
    estimate below what the GPU used), or None without evidence."""
    entry = load_evidence().get(class_key(cls))
    if not entry:
        return None
    return min(e for c in entry["configurations"] for e in (c["device_error"], c.get("out_of_sample_error"))
               if e is not None)


def trace_checked(cls: dict) -> bool:
    """Measured on a GPU, and never below it by more than the target: what a compiled trace must be
    before the gate books it (memory/estimate.py)."""
    under = worst_under(cls)
    return under is not None and under >= -TARGET
