"""How long `tiersep estimate --device cuda` takes for each seed preset (issue target: < 10 s on
2 cores), in fresh processes as the workflow runs it, and its peak RSS.

    python bench/estimate_time.py [--presets ultra_safe small memory_optimized large xlarge]

Prints one row per preset (wall seconds of the whole command, including Python and torch start-up,
and the trace's own `seconds` from the record) and the machine's load average, which a shared
machine makes the first thing to read.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SEEDS = ["ultra_safe", "small", "memory_optimized", "large", "xlarge"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=SEEDS)
    args = parser.parse_args()
    tiersep = Path(sys.executable).parent / "tiersep"
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print("| preset | command s | trace s | peak_bytes GiB |")
    print("|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for preset in args.presets:
            out = Path(tmp) / f"{preset}.json"
            start = time.time()
            subprocess.run([str(tiersep), "estimate", "--preset", preset, "--device", "cuda", "--out", str(out)],
                           cwd=ROOT, check=True, capture_output=True)
            record = json.loads(out.read_text())
            print(f"| {preset} | {time.time() - start:.1f} | {record['seconds']:.1f} | "
                  f"{record['peak_bytes'] / 2**30:.2f} |")
    print(f"load average {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
