"""Does the trace allocate what a real CUDA run allocates, in the same order?

Compares the trace's allocation sequence (tiersep.memory.trace: setup and training steps on fake
tensors) with a caching-allocator event log recorded on a GPU (`*.events.json.gz`, see
tests/data/gpu/h100-2026-11-22/README.md): model creation, AdamW state and two training steps of
memory/measure.py's workload, for the log's preset and `set` fields.

Both sequences become tokens (+size for an allocation, -size for a free, sizes rounded up to 512 B
as the allocator books them) aligned with difflib. Recorded events are labelled with the phase of
the trace event they align with. Reported per phase (setup/forward/backward/update): allocation
counts and bytes, the sizes only one side has (what the trace misses or invents, with the trace's
op around them), and the share of events in matching order; then both sequences replayed through
the allocator model.

    python bench/trace_vs_events.py                       # the three shared logs
    python bench/trace_vs_events.py LOG.events.json.gz --blocks 40   # the largest differing blocks

Writes bench/results/trace_vs_events.md (or --out); the last line printed is a JSON summary.
"""
from __future__ import annotations

import argparse
import collections
import difflib
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOGS = sorted((ROOT / "tests" / "data" / "gpu" / "h100-2026-11-22" / "events").glob("*.events.json.gz"))
LOGS_COMMIT = "e74010960b93"    # the shared logs' commit (their README.md)
MIB = 2**20
STEPS_IN_LOGS = 2     # the shared logs cover two training steps


def preset_of(log) -> dict:
    from tiersep import config as C

    cfg = log.config
    if "preset" not in cfg:
        raise SystemExit(f"{log.path}: config.preset: missing (which preset the log ran)")
    preset = C.load_preset(cfg["preset"], {"presets_dir": str(ROOT / "config" / "presets")})
    for key, value in (cfg.get("set") or {}).items():
        preset = C.set_field(preset, key, value)
    return C.validate(preset, "preset.schema.yaml", f"{log.path}: config")


def model_at(rev: str):
    """model_and_loss building tiersep's model and loss as they were at git revision `rev` (the
    logs record the model of their commit; the working tree's may have changed since)."""
    from tiersep.model.at_revision import model_and_loss_at

    try:
        return model_and_loss_at(rev, ROOT)
    except LookupError as err:
        raise SystemExit(f"--model-at {rev}: {err}") from None


def trace_tokens(preset: dict, workspace_bytes: int, model_and_loss=None) -> tuple[list, object]:
    """[(sign, bytes, phase, op)] of the trace's setup and two steps, without the main thread's
    cuBLAS workspace (the logs begin after a GEMM that created it)."""
    from tiersep.memory.trace import record_step, repeat_steps

    rec = record_step(preset, "cuda", model_and_loss, workspace_bytes=workspace_bytes)
    timeline, _ = repeat_steps(rec, STEPS_IN_LOGS)
    skip = rec.host | {k for k in rec.persistent if "main thread" in timeline.allocations[k].op}
    tokens = [(s, timeline.allocations[k].nbytes, phase, timeline.allocations[k].op)
              for (k, s), phase in zip(timeline.events, timeline.phases) if k not in skip]
    return tokens, rec


def log_tokens(log) -> list:
    """[(sign, bytes)] of the log's allocs and completed frees, sizes as the allocator books them."""
    from tiersep.memory.trace.allocator import round_size

    live, out = {}, []
    for action, addr, size in log.events:
        if action == "alloc":
            live[addr] = round_size(size)
            out.append((+1, live[addr]))
        elif action == "free_completed":
            out.append((-1, live.pop(addr)))
    return out


def compare(log_path: Path, blocks: int, model_and_loss=None) -> dict:
    from tiersep.memory.trace.allocator import load_event_log, replay_events
    from tiersep.memory.calibration import resolve

    log = load_event_log(log_path)
    preset = preset_of(log)
    cal = resolve("NVIDIA H100 80GB HBM3")
    start = time.process_time()
    trace, rec = trace_tokens(preset, cal["cublas_workspace_bytes"], model_and_loss)
    seconds = time.process_time() - start
    real = log_tokens(log)
    matcher = difflib.SequenceMatcher(None, [t[:2] for t in real], [t[:2] for t in trace], autojunk=False)
    ops = matcher.get_opcodes()

    # phase of each recorded event: that of the aligned trace event, else of the last one aligned
    phase_of_real, phase = [], trace[0][2]
    for tag, i1, i2, j1, j2 in ops:
        for n in range(i2 - i1):
            if tag in ("equal", "replace") and j1 + n < j2:
                phase = trace[j1 + n][2]
            phase_of_real.append(phase)
    phases = ["setup", "forward", "backward", "update"]
    table = {}
    for name in phases:
        r = [s for (sign, s), p in zip(real, phase_of_real) if sign > 0 and p == name]
        t = [s for sign, s, p, _ in trace if sign > 0 and p == name]
        table[name] = {"recorded_allocs": len(r), "trace_allocs": len(t),
                       "recorded_bytes": sum(r), "trace_bytes": sum(t)}

    missing, invented = collections.Counter(), collections.Counter()
    context: dict = {}
    diff_blocks = []
    for tag, i1, i2, j1, j2 in ops:
        if tag == "equal":
            continue
        r_alloc = [s for sign, s in real[i1:i2] if sign > 0]
        t_alloc = [(s, op) for sign, s, _, op in trace[j1:j2] if sign > 0]
        near = trace[max(j1 - 1, 0)][3]
        for s, c in (collections.Counter(r_alloc) - collections.Counter(s for s, _ in t_alloc)).items():
            missing[s] += c
            context.setdefault(("missing", s), near)
        for s, c in (collections.Counter(s for s, _ in t_alloc) - collections.Counter(r_alloc)).items():
            invented[s] += c
            context.setdefault(("invented", s), next(op for size, op in t_alloc if size == s))
        weight = sum(r_alloc) + sum(s for s, _ in t_alloc)
        diff_blocks.append((weight, tag, i1, i2, j1, j2))
    matched = sum(i2 - i1 for tag, i1, i2, _, _ in ops if tag == "equal")
    unmatched = {"recorded": [n for tag, i1, i2, _, _ in ops if tag != "equal" for _, n in real[i1:i2]],
                 "trace": [t[1] for tag, _, _, j1, j2 in ops if tag != "equal" for t in trace[j1:j2]]}
    small = {side: sum(n < 64 * 1024 for n in sizes) for side, sizes in unmatched.items()}

    # both sequences through the allocator model (synthetic segment addresses for both)
    from tiersep.memory.trace import allocator

    recorded = replay_events(log, recorded_addresses=False)
    traced_timeline, _ = __import__("tiersep.memory.trace", fromlist=["repeat_steps"]).repeat_steps(rec, STEPS_IN_LOGS)
    traced = allocator.replay(traced_timeline, exclude=rec.host)
    detail = []
    for weight, tag, i1, i2, j1, j2 in sorted(diff_blocks, reverse=True)[:blocks]:
        detail.append({"tag": tag, "recorded": [f"{'+' if s > 0 else '-'}{n}" for s, n in real[i1:i2]][:12],
                       "trace": [f"{'+' if s > 0 else '-'}{n} {op} ({p})" for s, n, p, op in trace[j1:j2]][:12],
                       "at_recorded_event": i1, "at_trace_event": j1})
    return {
        "log": str(log_path.relative_to(ROOT)) if log_path.is_relative_to(ROOT) else str(log_path),
        "name": log.name, "config": log.config, "trace_cpu_seconds": round(seconds, 1),
        "events": {"recorded": len(real), "trace": len(trace)},
        "in_order": matched / max(len(real), len(trace)),
        "out_of_order": {side: {"events": len(sizes), "under_64_kib": small[side]} for side, sizes in unmatched.items()},
        "phases": table,
        "missing": [{"bytes": s, "count": c, "after_trace_op": context[("missing", s)]}
                    for s, c in sorted(missing.items(), key=lambda kv: -kv[0] * kv[1])],
        "invented": [{"bytes": s, "count": c, "op": context[("invented", s)]}
                     for s, c in sorted(invented.items(), key=lambda kv: -kv[0] * kv[1])],
        "allocator": {"recorded_reserved": recorded.reserved_peak, "trace_reserved": traced.peak_reserved,
                      "recorded_allocated": recorded.allocated_peak, "trace_allocated": traced.peak_allocated},
        "blocks": detail,
    }


def markdown(results: list[dict], top: int) -> str:
    lines = ["# Trace vs recorded allocator events", "",
             f"Generated by bench/trace_vs_events.py on {time.strftime('%Y-%m-%d')}. Sizes rounded to 512 B; "
             "'in order' is the share of events difflib aligns as equal.", ""]
    for r in results:
        a = r["allocator"]
        lines += [f"## {r['name']} ({json.dumps(r['config'].get('set') or {})})", "",
                  f"{r['events']['recorded']} recorded events, {r['events']['trace']} traced "
                  f"({r['trace_cpu_seconds']} s CPU); in order: {r['in_order']:.1%}. Not aligned: "
                  f"{r['out_of_order']['recorded']['events']} recorded events "
                  f"({r['out_of_order']['recorded']['under_64_kib']} under 64 KiB: reduction scratch, RNG "
                  f"state, scalars) and {r['out_of_order']['trace']['events']} traced "
                  f"({r['out_of_order']['trace']['under_64_kib']} under 64 KiB).", "",
                  "| phase | recorded allocs | trace allocs | recorded MiB | trace MiB |",
                  "|---|---:|---:|---:|---:|"]
        for name, p in r["phases"].items():
            lines.append(f"| {name} | {p['recorded_allocs']} | {p['trace_allocs']} | "
                         f"{p['recorded_bytes'] / MIB:.1f} | {p['trace_bytes'] / MIB:.1f} |")
        lines += ["", "Allocator model, both sequences with synthetic addresses: reserved peak "
                  f"{a['trace_reserved'] / MIB:.0f} MiB traced vs {a['recorded_reserved'] / MIB:.0f} MiB recorded "
                  f"({a['trace_reserved'] / a['recorded_reserved'] - 1:+.2%}); allocated peak "
                  f"{a['trace_allocated'] / MIB:.0f} vs {a['recorded_allocated'] / MIB:.0f} MiB "
                  f"({a['trace_allocated'] / a['recorded_allocated'] - 1:+.2%}).", ""]
        for kind in ("missing", "invented"):
            rows = [x for x in r[kind] if x["bytes"] * x["count"] >= MIB][:top]
            lines.append(f"{'Recorded, not traced' if kind == 'missing' else 'Traced, not recorded'} "
                         f"(allocations of >= 1 MiB in all): " + ("none." if not rows else ""))
            for x in rows:
                where = x.get("after_trace_op") or x.get("op")
                lines.append(f"- {x['count']} x {x['bytes']} B ({x['bytes'] * x['count'] / MIB:.1f} MiB), "
                             f"{'after' if kind == 'missing' else 'op'} {where}")
            lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("logs", nargs="*", type=Path, default=LOGS)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "trace_vs_events.md")
    parser.add_argument("--blocks", type=int, default=0, help="print the N largest differing blocks")
    parser.add_argument("--top", type=int, default=12, help="sizes listed per kind in the table")
    parser.add_argument("--model-at", metavar="REV",
                        help="trace tiersep's model as it was at this git revision (e.g. the logs' "
                             "e74010960b93) instead of the working tree's")
    args = parser.parse_args(argv)
    from tiersep.memory.trace.allocator import EventLogError

    model_and_loss = model_at(args.model_at) if args.model_at else None
    if not args.model_at and any(p.resolve() in LOGS for p in args.logs):
        import subprocess

        changed = subprocess.run(["git", "diff", "--quiet", LOGS_COMMIT, "--", "src/tiersep/model"], cwd=ROOT)
        if changed.returncode != 0:
            print(f"warning: src/tiersep/model differs from {LOGS_COMMIT}, where the shared logs were recorded; "
                  f"differences may be the model's (--model-at {LOGS_COMMIT} traces that model)", file=sys.stderr)
    results = []
    for path in args.logs:
        try:
            results.append(compare(path, args.blocks, model_and_loss))
        except EventLogError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    text = markdown(results, args.top)
    print(text)
    for r in results:
        for b in r["blocks"]:
            print(f"-- {r['name']}: {b['tag']} at recorded {b['at_recorded_event']} / trace {b['at_trace_event']}")
            print("   recorded:", " ".join(b["recorded"]))
            for t in b["trace"]:
                print("   trace:   ", t)
    from tiersep.io import write_text

    write_text(args.out, text + "\n")
    print(json.dumps([{k: r[k] for k in ("name", "in_order", "events", "allocator")} for r in results]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
