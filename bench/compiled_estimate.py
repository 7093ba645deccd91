"""The trace's estimate of a compiled training step against real inductor-compiled CPU steps.

For a few tiny presets (inductor's CPU compile stays in seconds), it prints the trace's eager
estimate, the compiled estimate without fusion (the partitioned graphs alone) and with it (what
`estimate()` records), and the peak live tensor bytes of real eager and compiled steps.

The real peak is read from torch's profiler: with profile_memory=True, c10's CPU allocator reports
every allocation and free, including the buffers of inductor's generated code, which no dispatch
mode sees. Peak = the bytes live before the step (weights, AdamW state, inputs) + the highest
running sum of the step's allocations and frees (tests/memory_reference.py). For the eager step
it agrees with the measure method's StorageTracker count (the first row checks it).

    .venv/bin/python bench/compiled_estimate.py            # the table (a few minutes on 2 cores)
"""
from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path
from unittest import mock

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from memory_reference import profiled_peak, storage_bytes  # noqa: E402
from test_train_support import tiny_preset  # noqa: E402

from tiersep.memory.trace import compiled as compiled_trace  # noqa: E402
from tiersep.memory.measure import measure_step  # noqa: E402
from tiersep.memory.trace import trace_step  # noqa: E402
from tiersep.memory.trace.workload import build_workload  # noqa: E402
from tiersep.model.step import train_step  # noqa: E402

# name -> overrides of tests/test_train_support.py's tiny preset
CASES = {
    "tiny fp32": {},
    "tiny bf16": {"train.precision": "bf16"},
    "2 layers, batch 4": {"model.n_layers": 2, "train.batch_size": 4},
    "2 layers, checkpointed": {"model.n_layers": 2, "model.checkpointing": True},
    "tiny, accumulation 2": {"train.grad_accum": 2},
    "2 layers, batch 2, accumulation 4": {"model.n_layers": 2, "train.batch_size": 2, "train.grad_accum": 4},
}


def measure_peak(preset: dict, compiled: bool) -> tuple[int, float]:
    """(peak live tensor bytes of one real CPU training step, seconds the first step took: the
    compile, when compiled). The first step compiles; the second is measured."""
    torch.manual_seed(preset["train"]["seed"])
    work = build_workload(preset, "cpu", lambda *shape: 0.1 * torch.randn(shape))
    model = torch.compile(work.model, fullgraph=True) if compiled else work.model
    start = time.time()
    train_step(model, work.loss_fn, work.optimizer, work.inputs, preset, "cpu")
    first = time.time() - start
    # no tensor made before profiling may be freed while profiling (the profiler cannot size it)
    work.optimizer.zero_grad(set_to_none=True)
    gc.collect()
    before = storage_bytes(list(work.model.parameters()) + list(work.model.buffers())
                           + work.optimizer_state() + [x for pair in work.inputs for x in pair])
    peak = profiled_peak(lambda: train_step(model, work.loss_fn, work.optimizer, work.inputs, preset, "cpu"))
    return before + peak, first


def estimate_peak(preset: dict, compiled: bool, fuse: bool = True) -> int:
    """The CPU trace's peak live bytes; fuse=False: every node of the partitioned graphs gets a buffer."""
    if fuse:
        return trace_step(preset, "cpu", compiled=compiled).allocated_peak
    everything = lambda graph, device: {n for n in graph.nodes if n.op == "call_function"}  # noqa: E731
    # Dynamo would reuse graphs traced for equal shapes, with the fusion decided when they were made
    torch._dynamo.reset()
    try:
        with mock.patch.object(compiled_trace, "materialised", everything):
            return trace_step(preset, "cpu", compiled=compiled).allocated_peak
    finally:
        torch._dynamo.reset()


def row(name: str, overrides: dict) -> dict:
    preset = tiny_preset(**overrides)
    eager_measured, _ = measure_peak(preset, compiled=False)
    compiled_measured, compile_seconds = measure_peak(preset, compiled=True)
    return {"case": name, "eager_estimate": estimate_peak(preset, False),
            "partitioned_estimate": estimate_peak(preset, True, fuse=False),
            "compiled_estimate": estimate_peak(preset, True), "eager_measured": eager_measured,
            "tracker_measured": measure_step(preset, "cpu").allocated_peak,
            "compiled_measured": compiled_measured, "compile_seconds": compile_seconds}


def table(rows: list[dict]) -> str:
    kib = lambda n: f"{n / 1024:,.0f}"  # noqa: E731
    err = lambda a, b: f"{a / b - 1:+.2%}"  # noqa: E731
    lines = ["| case | eager est. | eager measured (profiler / tracker) | eager est. vs compiled measured "
             "| partitioned est. (no fusion) | compiled est. | compiled measured | compiled est. error "
             "| compiled / eager (measured) | first compiled step, s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {r['case']} | {kib(r['eager_estimate'])} | {kib(r['eager_measured'])} / {kib(r['tracker_measured'])} "
            f"| {err(r['eager_estimate'], r['compiled_measured'])} | {kib(r['partitioned_estimate'])} "
            f"| {kib(r['compiled_estimate'])} | {kib(r['compiled_measured'])} "
            f"| {err(r['compiled_estimate'], r['compiled_measured'])} "
            f"| {r['compiled_measured'] / r['eager_measured']:.3f} | {r['compile_seconds']:.0f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="*", default=list(CASES), help="which of: " + ", ".join(CASES))
    args = parser.parse_args()
    rows = []
    for name in args.cases:
        rows.append(row(name, CASES[name]))
        print(f"done: {name}", file=sys.stderr, flush=True)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; bytes in KiB (1024 B)")
    print(table(rows))


if __name__ == "__main__":
    main()
