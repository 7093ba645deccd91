"""A deep tier's trace from a trace of five of its blocks, against the trace of all of them (issue 31).

    python bench/depth_extension.py [--presets xlarge large memory_optimized] [--variants ...] [--segment N]

record_step traces a preset deeper than memory/trace/depth.TRACED_BLOCKS with that many blocks and
extends the timeline to the preset's depth (memory/trace/depth.py). This bench runs, for each tier
and variant, that record_step and the trace of every block (record_step given the model builder,
which it never extends), and prints: the events, the seconds of each, whether the two timelines are
identical event for event (keys compared up to renaming; bytes, op, phase, shape and dtype as they
are) and whether summarize gives the same TraceResult. Exit 1 when one differs.

Variants: `written` (the preset as it is), `frugal` (checkpointing, micro-batch 1, bf16),
`frugal-fp16` (the same in fp16 with the efficient kernel, as on a card without bf16) and
`unchecked` (micro-batch 1, bf16, no checkpointing).
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

VARIANTS = ["written", "frugal", "frugal-fp16", "unchecked"]


def variant(preset: dict, name: str) -> dict:
    v = copy.deepcopy(preset)
    t, m = v["train"], v["model"]
    if name != "written":
        t["grad_accum"], t["batch_size"] = t["batch_size"] * t["grad_accum"], 1
        m["checkpointing"] = name != "unchecked"
        t["precision"] = "fp16" if name == "frugal-fp16" else "bf16"
        if name == "frugal-fp16":
            m["attention_backend"] = "efficient"
    return v


def canonical(timeline) -> list[tuple]:
    """The events with keys renamed in order of first appearance, and what each allocation is."""
    names: dict = {}
    out = []
    for key, sign in timeline.events:
        a = timeline.allocations[key]
        out.append((names.setdefault(key, len(names)), sign, a.nbytes, a.op, a.phase, a.shape, a.dtype))
    return out


def compare(preset: dict) -> tuple[str, bool]:
    from tiersep.memory.trace import record_step, summarize
    from tiersep.model import build_loss, build_model

    start = time.perf_counter()
    extended = record_step(preset, "cuda")
    middle = time.perf_counter()
    full = record_step(preset, "cuda", model_and_loss=lambda p: (build_model(p), build_loss(p)))
    end = time.perf_counter()
    a, b = canonical(extended.timeline), canonical(full.timeline)
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))
    same_result = (dataclasses.asdict(summarize(extended, "cuda")) == dataclasses.asdict(summarize(full, "cuda")))
    timeline = "identical" if first is None else f"differ from event {first}: {a[first:first + 1]} vs {b[first:first + 1]}"
    ok = first is None and same_result
    return (f"{len(b)} | {middle - start:.2f} | {end - middle:.2f} | {timeline} | "
            f"{'identical' if same_result else 'DIFFERENT'} |"), ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--presets", nargs="*", default=["xlarge", "large", "memory_optimized"])
    parser.add_argument("--variants", nargs="*", default=VARIANTS, choices=VARIANTS)
    parser.add_argument("--segment", type=int, default=None, help="audio.segment_samples (default: the preset's)")
    args = parser.parse_args()
    import torch

    from fit_matrix import cpu_model     # this folder's
    from tiersep import config as C
    from tiersep.memory.trace.depth import TRACED_BLOCKS

    torch.set_num_threads(1)
    cfg = C.load_config(ROOT / "config" / "config.yaml")
    print(f"{time.strftime('%Y-%m-%d')}: {cpu_model()}, torch {torch.__version__}, "
          f"Python {platform.python_version()}, one torch thread; traced blocks: {TRACED_BLOCKS}\n")
    print("| tier | blocks | variant | events | extended s | full depth s | timelines | TraceResult |")
    print("|---|---:|---|---:|---:|---:|---|---|")
    failed = False
    for name in args.presets:
        preset = C.load_preset(name, cfg)
        if args.segment:
            preset["audio"]["segment_samples"] = args.segment
        for label in args.variants:
            row, ok = compare(variant(preset, label))
            failed |= not ok
            print(f"| {name} | {preset['model']['n_layers']} | {label} | {row}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
