"""What packing trials onto an 80 GB H100 by their bookings buys: trials per GPU-hour, packed
against one trial per GPU, simulated from the shared H100 measurements (no GPU runs here).

    python bench/search_packing.py [--trials 300] [--steps 1000] [--seed 0] [--out bench/results/search_packing.md]

Every per-configuration figure comes from tests/data/gpu/h100-2026-11-22 (NVIDIA H100 80GB HBM3):
- device use: `device_used_bytes` of measurements.jsonl (what nvidia-smi shows for the process);
- step time: the README's table of step times (native allocator, 5 steps after 2 warm-ups), which
  is measured for three configurations only, so the space is those three; the bench checks that
  the README still gives them. speed.jsonl's rows are left out: other dims (mono) and a `peak_gib`
  the README does not define as device use;
- the GPU's memory: `device_total_bytes`, nothing else on it (the README: 0 MiB used before each
  process), so its baseline is 0.
Each trial's booking is what `tiersep search` books for it today: the fit gate's CUDA trace
estimate of the configuration with the native allocator (the measurements' mode), x (1 + its
class's uncertainty), with its share of the 8% safety margin (tiersep.search.packing.booking_bytes).

Assumptions, stated because no measurement here gives them:
- co-location slowdown x: a trial sharing its GPU with k - 1 others runs 1 + (x - 1)(k - 1) times
  slower than alone (x = 1: no interference, x = 2: two trials time-slice the GPU, no gain). The
  result is shown over x = 1.0 to 2.0;
- every trial runs the same number of steps (no pruning), drawn uniformly from the space, and is
  placed first come, first placed, as search/packing.py places them (a trial waits while the
  one before it waits).
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import socket
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
DATA = ROOT / "tests" / "data" / "gpu" / "h100-2026-11-22"
# (measurements.jsonl name, the README's step time as printed there, seconds)
SPACE = [("small as shipped", "85.1 ms", 0.0851),
         ("small bf16 b4", "296 ms", 0.296),
         ("ultra_safe fp32 ckpt b2", "2.630 s", 2.630)]
SLOWDOWNS = (1.0, 1.25, 1.5, 1.75, 2.0)
GB, GIB = 1e9, 2**30


def configurations() -> list[dict]:
    """The space: each configuration's measured device use and step time, and today's booking."""
    from tiersep import config as C
    from tiersep.memory import GateSettings, gate
    from tiersep.search.packing import booking_bytes

    rows = {r["name"]: r for r in map(json.loads, (DATA / "measurements.jsonl").read_text().splitlines())}
    readme = (DATA / "README.md").read_text()
    out = []
    for name, printed, seconds in SPACE:
        if printed not in readme:
            sys.exit(f"search_packing: {DATA / 'README.md'} no longer gives the step time {printed} of {name}")
        row = rows[name]
        preset = C.load_preset(row["preset"], {"presets_dir": str(ROOT / "config" / "presets")})
        for key, value in row["set"].items():
            preset = C.set_field(preset, key, value)
        # measured with the native allocator: book the same mode (a search could run them expandable, smaller)
        preset = C.set_field(preset, "train.cuda_expandable_segments", False)
        preset = C.validate(preset, "preset.schema.yaml", name)
        estimate = gate(preset, "cuda", row["device_total_bytes"], GateSettings(0.08, "auto"))
        out.append({"name": name, "device_used": row["device_used_bytes"], "total": row["device_total_bytes"],
                    "step_s": seconds, "estimate": estimate["peak_bytes"],
                    "required": estimate["gate_required_bytes"], "booking": booking_bytes(estimate)})
    return out


def simulate(trials: list[dict], capacity: int, slowdown: float, steps: int) -> dict:
    """Event-driven: FIFO placement by booking; each running trial advances at 1 / (1 + (x-1)(k-1))
    of its solo speed while k trials share the GPU. Returns the makespan and the peaks seen."""
    queue = list(trials)
    running: list[list] = []          # [trial, solo seconds left]
    now, peak_booked, peak_used, peak_k = 0.0, 0, 0, 0
    while queue or running:
        while queue and sum(t["booking"] for t, _ in running) + queue[0]["booking"] <= capacity:
            t = queue.pop(0)
            running.append([t, steps * t["step_s"]])
        k = len(running)
        peak_k = max(peak_k, k)
        peak_booked = max(peak_booked, sum(t["booking"] for t, _ in running))
        peak_used = max(peak_used, sum(t["device_used"] for t, _ in running))
        rate = 1.0 / (1.0 + (slowdown - 1.0) * (k - 1))
        first = min(running, key=lambda r: r[1])
        dt = first[1] / rate
        now += dt
        for r in running:
            r[1] -= dt * rate
        running = [r for r in running if r[1] > 1e-9 and r is not first]
    return {"hours": now / 3600, "peak_booked": peak_booked, "peak_used": peak_used, "peak_k": peak_k}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=300)
    parser.add_argument("--steps", type=int, default=1000, help="steps per trial (the same for every trial)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="also write the Markdown here")
    args = parser.parse_args(argv)
    began = time.time()
    space = configurations()
    capacity = space[0]["total"]          # baseline 0: nothing else on the GPU
    rng = random.Random(args.seed)
    trials = [rng.choice(space) for _ in range(args.trials)]
    alone_hours = sum(args.steps * t["step_s"] for t in trials) / 3600
    lines = [f"# Packing trials on one H100 80GB by their bookings (simulated)", "",
             f"Command: `python bench/search_packing.py --trials {args.trials} --steps {args.steps} --seed {args.seed}"
             f"{' --out ' + str(args.out) if args.out else ''}`  ",
             f"Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; machine: {socket.gethostname()} "
             f"({platform.machine()}, {platform.python_version()}), a CPU machine: no GPU ran, the figures per "
             f"configuration are the H100's of {DATA.relative_to(ROOT)}.", "",
             "## The space (every figure measured, except the booking: today's fit gate on the same preset)", "",
             "| configuration | device use (measured) | step time (measured) | estimate | booking | booking / measured |",
             "|---|---:|---:|---:|---:|---:|"]
    for c in space:
        lines.append(f"| {c['name']} | {c['device_used'] / GB:.2f} GB | {c['step_s'] * 1000:.1f} ms | "
                     f"{c['estimate'] / GB:.2f} GB | {c['booking'] / GB:.2f} GB | {c['booking'] / c['device_used']:.2f} |")
    under = [c for c in space if c["booking"] < c["device_used"]]
    if under:
        lines += ["", "Booked below its measured use: " + ", ".join(
            f"{c['name']} ({c['booking'] / GB:.2f} against {c['device_used'] / GB:.2f} GB)" for c in under)
            + ". The trace estimate is under the measurement most with checkpointing and fp32 (the data's README); "
            "trials packed next to it rely on the others' bookings being above their use."]
    lines += ["", f"GPU: {capacity / GB:.2f} GB ({capacity / GIB:.2f} GiB), baseline 0. {args.trials} trials drawn "
              f"uniformly from the space (seed {args.seed}), {args.steps} steps each, placed first come first placed. "
              f"One trial per GPU: {alone_hours:.2f} GPU-hours, {args.trials / alone_hours:.1f} trials per GPU-hour.", "",
              "## Trials per GPU-hour against the co-location slowdown (an assumption: see the bench's docstring)", "",
              "| slowdown x (2 trials sharing) | packed: GPU-hours | packed: trials per GPU-hour | one per GPU | gain | "
              "most trials at once | peak booked | peak measured use |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for x in SLOWDOWNS:
        r = simulate(trials, capacity, x, args.steps)
        lines.append(f"| {x:.2f} | {r['hours']:.2f} | {args.trials / r['hours']:.1f} | {args.trials / alone_hours:.1f} | "
                     f"{alone_hours / r['hours']:.2f}x | {r['peak_k']} | {r['peak_booked'] / GB:.2f} GB | "
                     f"{r['peak_used'] / GB:.2f} GB |")
        if r["peak_booked"] > capacity or r["peak_used"] > capacity:
            sys.exit(f"search_packing: x={x}: the bookings or the measured use exceeded the GPU")
    lines += ["", "The peak measured use is the sum of the co-located trials' measured device use: below the GPU's "
              "memory at every moment, so no placement here would have run out of memory. At x = 2 packing gains "
              "nothing by construction; the gain at x = 1 is the most it can give. Which x holds on an H100 is what "
              "bench/gpu_evidence.py's co-location job measures (not yet run on a GPU).",
              "", f"({time.time() - began:.0f} s on this machine, mostly the fit gate's traces.)"]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
