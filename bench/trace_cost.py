"""Where a fit matrix's time goes: the cost of one trace, by tier, by lever and by depth.

    python bench/trace_cost.py [--presets xlarge large] [--layers 1 2 4 8 12] [--rows] [--traces TIER] [--profile TIER]

Prints Markdown tables (each trace run after a warm-up trace of the same preset, in this
process, one torch thread as the matrix's workers use):
1. per tier: the preset as written and its most frugal variant (checkpointing, micro-batch 1,
   the 16-bit lever): the events a step records and the seconds of record_step (the step on fake
   tensors) and of summarize (the allocator model's replay);
2. the same frugal variant with model.n_layers set to each --layers value: how a trace's events and
   time grow with depth (issue 31: a deep tier's checkpointed traces are the matrix's critical path);
3. with --rows: each tier's row of `tiersep fit --gpus catalogue` (memory/fit/matrix.row) timed
   alone, its traces and seconds. The matrix runs tiers in --jobs worker processes, so its wall
   time is at least its slowest row's.
4. with --traces TIER: every trace of TIER's catalogue row, in order: the GPU whose cell asked for
   it, the variant, and its seconds of record_step and summarize; then what the row spent besides.
   Whether a faster matrix could run fewer traces, or must run cheaper ones.
5. with --diff TIER: how the timeline of TIER (checkpointed, or not with --diff-unchecked;
   micro-batch 1, a 1 s segment) with 3 blocks differs from the one with 2, event by event
   ((alloc|free, op, bytes, phase) compared with difflib): what a trace of few blocks would have to
   insert to stand for a deeper one; and which of the deeper one's frees the alignment explains.
6. with --profile TIER: where TIER's catalogue row spends its CPU, by cProfile's cumulative time of the
   parts a faster trace would have to shrink (they overlap).
"""
from __future__ import annotations

import argparse
import copy
import difflib
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

SEEDS = ["ultra_safe", "small", "memory_optimized", "large", "xlarge"]


def timed_trace(preset: dict) -> tuple[int, float, float]:
    """(events recorded, record_step seconds, summarize seconds) of one cuda trace of `preset`."""
    from tiersep.memory.trace import record_step, summarize

    start = time.perf_counter()
    rec = record_step(preset, "cuda")
    recorded = time.perf_counter()
    summarize(rec, "cuda")
    return len(rec.timeline.events), recorded - start, time.perf_counter() - recorded


def frugal(preset: dict) -> dict:
    """Checkpointing, micro-batch 1 (the effective batch kept), bf16: the shape most fit traces take."""
    v = copy.deepcopy(preset)
    t = v["train"]
    t["grad_accum"], t["batch_size"] = t["batch_size"] * t["grad_accum"], 1
    v["model"]["checkpointing"] = True
    t["precision"] = "bf16"
    return v


def block_diff(preset: dict, blocks: int = 2) -> list[str]:
    """Table rows: each run of events the trace of `blocks` + 1 blocks has that the trace of `blocks`
    lacks or has otherwise (difflib's opcodes other than equal); then, for each free of the deeper
    trace, whether the alignment explains which allocation it frees (`key_roles`)."""
    from tiersep.memory.trace import record_step

    def timeline(n: int):
        variant = copy.deepcopy(preset)
        variant["model"]["n_layers"] = n
        return record_step(variant, "cuda").timeline

    def tokens(tl) -> list[tuple]:
        return [(sign, tl.allocations[key].op, tl.allocations[key].nbytes, tl.allocations[key].phase)
                for key, sign in tl.events]

    tl_fewer, tl_more = timeline(blocks), timeline(blocks + 1)
    fewer, more = tokens(tl_fewer), tokens(tl_more)
    opcodes = difflib.SequenceMatcher(None, fewer, more, autojunk=False).get_opcodes()
    rows = [f"{len(fewer)} and {len(more)} events\n", "| change | at event | events | first event (alloc/free, op, bytes, phase) |",
            "|---|---:|---:|---|"]
    for tag, i1, i2, j1, j2 in opcodes:
        if tag != "equal":
            sign, op, nbytes, phase = more[j1] if j1 < len(more) else fewer[i1]
            rows.append(f"| {tag} | {i1} | {max(j2 - j1, i2 - i1)} | {'alloc' if sign > 0 else 'free'}, {op}, {nbytes}, {phase} |")
    return rows + ["", *key_roles(tl_fewer, tl_more, opcodes)]


def key_roles(fewer, more, opcodes) -> list[str]:
    """Table rows: the deeper trace's frees by what the alignment says of them. A matched free is
    explained when it frees the allocation matched to the one its counterpart frees; an inserted
    one (the new block's) frees an allocation of an inserted run, or of the matched events (then
    the extension must decide whose: its own block's neighbour, or something every block shares)."""
    import collections

    matched, run_of = {}, {}
    for tag, i1, i2, j1, j2 in opcodes:
        if tag == "equal":
            matched.update(zip(range(j1, j2), range(i1, i2)))
        else:
            run_of.update((j, j1) for j in range(j1, j2))
    pairs = {fewer.events[i][0]: more.events[j][0] for j, i in matched.items() if more.events[j][1] > 0}
    born = {k: j for j, (k, s) in enumerate(more.events) if s > 0}
    counts = collections.Counter()
    for j, (key, sign) in enumerate(more.events):
        if sign > 0:
            continue
        made = born.get(key)
        where = "before the step" if made is None else "an inserted run" if made in run_of else "a matched event"
        if j in matched:
            explained = pairs.get(fewer.events[matched[j]][0]) == key
            counts[("matched", "explained" if explained else "not explained", where)] += 1
        else:
            counts[("inserted", "", where)] += 1
    rows = ["| free | by the alignment | of an allocation made at | frees |", "|---|---|---|---:|"]
    return rows + [f"| {a} | {b} | {c} | {n} |" for (a, b, c), n in sorted(counts.items())]


def catalogue_budgets() -> list:
    """Every GPU of the catalogue as a budget, as `tiersep fit --gpus catalogue` makes them."""
    from tiersep import gpu_catalogue
    from tiersep.memory.fit import matrix

    return matrix.parse_budgets(list(gpu_catalogue.by_name()), "--gpus")


def row_traces(preset: dict, cfg: dict) -> list[str]:
    """Table rows: each trace `memory/fit/matrix.row` runs for `preset` against the catalogue (the
    cell that asked for it, the variant, record_step and summarize seconds), then the row's total."""
    import importlib

    from tiersep.memory.fit import matrix
    from tiersep.memory.fit.settings import GateSettings
    from tiersep.memory.trace import step

    search = importlib.import_module("tiersep.memory.fit.search")   # the package exports a fit() of that name
    seconds, asking, rows, traced = {}, {}, [], []
    originals = step.record_step, step.summarize, search.estimate, matrix.settings_for

    def timed(name, fn):
        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - start
        return run

    def estimate(variant, *args, **kwargs):
        seconds.clear()
        record = originals[2](variant, *args, **kwargs)
        a, t = variant["audio"], variant["train"]
        traced.append(seconds.get("record", 0) + seconds.get("summarize", 0))
        rows.append(f"| {len(rows) + 1} | {asking['gpu']} | {a['segment_samples'] / a['sample_rate']:.2f} s, "
                    f"{t['precision']}, {'ckpt' if variant['model']['checkpointing'] else 'no ckpt'}, "
                    f"{t['batch_size']}x{t['grad_accum']} | {record['peak_bytes'] / 2**30:.2f} | "
                    f"{seconds.get('record', 0):.2f} | {seconds.get('summarize', 0):.2f} |")
        return record

    def settings_for(budget, settings):   # row() asks it first for each budget, before that budget's traces
        asking["gpu"] = budget.label
        return originals[3](budget, settings)

    step.record_step, step.summarize = timed("record", step.record_step), timed("summarize", step.summarize)
    search.estimate, matrix.settings_for = estimate, settings_for
    try:
        budgets = catalogue_budgets()
        start = time.perf_counter()
        matrix.row(preset["name"], preset, budgets, GateSettings.from_config(cfg))
        total = time.perf_counter() - start
    finally:
        step.record_step, step.summarize, search.estimate, matrix.settings_for = originals
    return (["| trace | asked by | variant | peak GiB | record_step s | summarize s |", "|---:|---|---|---:|---:|---:|"]
            + rows + [f"\n{len(rows)} traces, {total:.1f} s: record_step and summarize {sum(traced):.1f} s, "
                      f"the rest {total - sum(traced):.1f} s."])


# (label, file suffix, function) whose cumulative time --profile reports; they overlap (the cache key and
# AdamW are inside record_step, record_step and summarize inside the row)
PROFILED = [
    ("the row (matrix.row)", "memory/fit/matrix.py", "row"),
    ("record_step: the step on fake tensors", "memory/trace/step.py", "record_step"),
    ("  building the workload: model, weights, AdamW's setup step", "memory/trace/workload.py", "build_workload"),
    ("  AdamW's steps (the setup's and the step's)", "torch/optim/adam.py", "step"),
    ("  the backward", "torch/autograd/graph.py", "_engine_run_backward"),
    ("  FakeTensor's dispatch-cache key (every op)", "torch/_subclasses/fake_tensor.py", "_cache_key"),
    ("  FakeTensor's dispatch on a cache miss", "torch/_subclasses/fake_tensor.py", "_dispatch_impl"),
    ("summarize: three steps replayed", "memory/trace/step.py", "summarize"),
    ("  the allocator model's replay", "memory/trace/allocator.py", "replay"),
]


def profile_row(preset: dict, cfg: dict) -> list[str]:
    """Table rows: where the CPU of TIER's catalogue row goes (cProfile's cumulative seconds of the
    functions in PROFILED, and their share of the row's)."""
    import cProfile
    import pstats

    from tiersep.memory.fit import matrix
    from tiersep.memory.fit.settings import GateSettings

    profiler = cProfile.Profile()
    profiler.runcall(matrix.row, preset["name"], preset, catalogue_budgets(), GateSettings.from_config(cfg))
    stats = pstats.Stats(profiler).stats    # (file, line, function) -> (primitive calls, calls, tottime, cumtime, callers)
    found = []                              # (label, calls, cumulative seconds)
    for label, suffix, name in PROFILED:
        hits = [v for (path, _, fn), v in stats.items() if path.endswith(suffix) and fn == name]
        found.append((label, sum(v[1] for v in hits), sum(v[3] for v in hits)))
    whole = found[0][2]
    return (["| where | calls | seconds (cumulative, profiled) | share of the row |", "|---|---:|---:|---:|"]
            + [f"| {label} | {calls} | {seconds:.1f} | {seconds / whole:.0%} |" for label, calls, seconds in found])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="*", default=SEEDS, help="table 1's tiers (none: no table 1)")
    parser.add_argument("--layers", nargs="*", type=int, default=[1, 2, 4, 8, 12], help="table 2's depths (none: no table 2)")
    parser.add_argument("--depth-of", default="xlarge", help="the tier whose depth is varied (table 2)")
    parser.add_argument("--rows", action="store_true", help="time each tier's catalogue row (minutes)")
    parser.add_argument("--diff", metavar="TIER", help="diff TIER's 2- and 3-block timelines (table 5)")
    parser.add_argument("--diff-unchecked", action="store_true", help="--diff without checkpointing")
    parser.add_argument("--traces", metavar="TIER", help="each trace of TIER's catalogue row (table 4)")
    parser.add_argument("--profile", metavar="TIER", help="where TIER's catalogue row spends its CPU (table 6)")
    args = parser.parse_args()
    import torch

    from tiersep import config as C

    torch.set_num_threads(1)
    cfg = C.load_config(ROOT / "config" / "config.yaml")
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    print("# What one trace costs (bench/trace_cost.py)\n")
    print(f"{time.strftime('%Y-%m-%d')}: {cpu}, torch {torch.__version__}, Python {platform.python_version()}, "
          "one torch thread.\n")
    if args.presets:
        print("| tier | layers | variant | events | record_step s | summarize s |")
        print("|---|---:|---|---:|---:|---:|")
    for name in args.presets:
        preset = C.load_preset(name, cfg)
        timed_trace(preset)   # warm-up: imports, first-call caches
        for label, variant in (("as written", preset), ("frugal (ckpt, b1, bf16)", frugal(preset))):
            events, rec_s, sum_s = timed_trace(variant)
            print(f"| {name} | {preset['model']['n_layers']} | {label} | {events} | {rec_s:.2f} | {sum_s:.2f} |")

    if args.layers:
        print(f"\n{args.depth_of}, frugal, with model.n_layers set:\n")
        print("| n_layers | events | events added per layer | record_step s | summarize s |")
        print("|---:|---:|---:|---:|---:|")
    base, last = frugal(C.load_preset(args.depth_of, cfg)), None
    for layers in args.layers:
        variant = copy.deepcopy(base)
        variant["model"]["n_layers"] = layers
        events, rec_s, sum_s = timed_trace(variant)
        per = f"{(events - last[1]) / (layers - last[0]):.0f}" if last else ""
        print(f"| {layers} | {events} | {per} | {rec_s:.2f} | {sum_s:.2f} |")
        last = (layers, events)

    if args.diff:
        preset = frugal(C.load_preset(args.diff, cfg))
        preset["train"]["grad_accum"] = 1
        preset["audio"]["segment_samples"] = preset["audio"]["sample_rate"]
        preset["model"]["checkpointing"] = not args.diff_unchecked
        print(f"\n{args.diff} ({'not ' if args.diff_unchecked else ''}checkpointed, micro-batch 1, 1 s), "
              "3 blocks against 2:\n")
        print("\n".join(block_diff(preset)))

    if args.traces:
        print(f"\nEvery trace of {args.traces}'s row against the whole catalogue, in order:\n")
        print("\n".join(row_traces(C.load_preset(args.traces, cfg), cfg)))

    if args.profile:
        print(f"\nWhere {args.profile}'s row against the whole catalogue spends its CPU (cProfile; "
              "profiling slows it):\n")
        print("\n".join(profile_row(C.load_preset(args.profile, cfg), cfg)))

    if args.rows:
        from tiersep.memory.fit import matrix
        from tiersep.memory.fit.settings import GateSettings

        budgets = catalogue_budgets()
        settings = GateSettings.from_config(cfg)
        print("\nEach tier's row against the whole catalogue, alone in this process:\n")
        print("| tier | traces | seconds | seconds per trace |")
        print("|---|---:|---:|---:|")
        for name in args.presets:
            start = time.perf_counter()
            _row, _presets, traces = matrix.row(name, C.load_preset(name, cfg), budgets, settings)
            seconds = time.perf_counter() - start
            print(f"| {name} | {traces} | {seconds:.1f} | {seconds / max(traces, 1):.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
