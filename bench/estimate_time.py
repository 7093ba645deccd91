"""How long `tiersep estimate --device cuda` takes per preset, process start included: one process
per preset (as the workflow ran it before issue 24), against one process for all of them
(`--preset A --preset B ... --out DIR/{preset}.json`, the workflow's estimate job now), and whether
both give the same figures (every field but `seconds`). Issue 24's target: under 5 s per preset.

    python bench/estimate_time.py [--presets ultra_safe small memory_optimized large xlarge] [--repeat 3]

Prints one row per preset (wall seconds of its own process, and the trace's `seconds`), the
per-preset time of the single process, the ratio, and the load average before and after (on a
shared machine, the first thing to read). Medians over --repeat rounds.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SEEDS = ["ultra_safe", "small", "memory_optimized", "large", "xlarge"]


def run(tiersep: Path, presets: list[str], out: str) -> float:
    argv = [str(tiersep), "estimate", "--device", "cuda", "--out", out]
    for preset in presets:
        argv += ["--preset", preset]
    start = time.time()
    subprocess.run(argv, cwd=ROOT, check=True, capture_output=True)
    return time.time() - start


def figures(path: Path) -> dict:
    record = json.loads(path.read_text())
    record.pop("seconds")
    return record


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=SEEDS)
    parser.add_argument("--repeat", type=int, default=3, help="rounds (median)")
    args = parser.parse_args()
    tiersep = Path(sys.executable).parent / "tiersep"
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    own, together = {p: [] for p in args.presets}, []
    with tempfile.TemporaryDirectory() as tmp:
        alone, shared = Path(tmp) / "alone", Path(tmp) / "shared"
        for _ in range(args.repeat):
            for preset in args.presets:
                own[preset].append(run(tiersep, [preset], str(alone / f"{preset}.json")))
            together.append(run(tiersep, args.presets, str(shared / "{preset}.json")))
        print("| preset | own process s (before) | trace s | peak_bytes GiB | same figures in one process |")
        print("|---|---:|---:|---:|---|")
        same = True
        for preset in args.presets:
            a, b = figures(alone / f"{preset}.json"), figures(shared / f"{preset}.json")
            same &= a == b
            record = json.loads((alone / f"{preset}.json").read_text())
            print(f"| {preset} | {statistics.median(own[preset]):.1f} | {record['seconds']:.1f} | "
                  f"{record['peak_bytes'] / 2**30:.2f} | {'yes' if a == b else 'NO: ' + str(sorted(k for k in a if a[k] != b.get(k)))} |")
    before = statistics.mean(statistics.median(v) for v in own.values())
    after = statistics.median(together) / len(args.presets)
    print(f"\nper preset: {before:.1f} s in its own process (before), {after:.1f} s in one process for all "
          f"{len(args.presets)} (after): {before / after:.2f}x; figures identical: {'yes' if same else 'NO'}")
    print(f"load average {os.getloadavg()[0]:.1f}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
