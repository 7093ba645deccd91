"""Are a search's trials isolated from each other? N trials of a tiny CPU preset in a row, through
the real `tiersep search` (the post-mortem behind issue 30: trials in one agent process inherited
each other's GPU memory until 29 of 30 ran out of it).

Every trial of a search is its own `tiersep train` process, started by the orchestrator after the
one before it has ended. On the H100, a trial trained while estimate jobs with budget_gib: auto held
CUDA contexts saw 1.05 GiB less free memory than the trials after it
(tests/data/gpu/h100-2026-11-22/README.md, "Sweep"). This bench runs a grid search of N trials
(`search: {preset: test_tiny, space: {train.seed: {low: 0, high: N-1}}, sampler: grid}`, one at a
time, no pruner) in a temporary folder, then reads each trial's run.json and prints:

- how many of the N trials ended COMPLETE (none may FAIL; trials.csv gives each state);
- whether every trial had a process of its own (N different pids, none the orchestrator's);
- the spread, max - min and relative to the median, of `start_process_bytes` (the train process's
  own footprint when it starts: resident set on CPU, CUDA reserved on a GPU) and of
  `start_free_bytes` (free memory before the trial allocated anything: the machine's available RAM
  on CPU, the GPU's free memory on a GPU). Target: N/N and both spreads within 2%.

    python bench/search_isolation.py                  # 30 trials, in a temporary folder
    python bench/search_isolation.py --trials 4 --workdir /tmp/isolation --keep

On a CPU machine start_free_bytes follows whatever else the machine runs; on a GPU it is the
figure the H100 finding is about.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
PRESET = ROOT / "tests" / "configs" / "presets" / "test_tiny.yaml"   # 8 kHz, 1 layer x 8, 6 steps
STUDY = "isolation"
FIELDS = ("start_process_bytes", "start_free_bytes")
TARGET_SPREAD = 0.02


def search_config(trials: int, workdir: Path) -> dict:
    cfg = yaml.safe_load((ROOT / "tests" / "configs" / "tiny.yaml").read_text())
    cfg.update(presets_dir=str(ROOT / "tests" / "configs" / "presets"), tiers=[PRESET.stem], estimate_tiers=[],
               results_dir=str(workdir / "results"), budget_gib="auto")
    cfg["data"]["prepared_dir"] = str(workdir / "prepared")
    cfg["search"] = {"preset": str(PRESET), "study": STUDY, "sampler": "grid", "pruner": "none",
                     "trials": trials, "evaluate": False, "space": {"train.seed": {"low": 0, "high": trials - 1}}}
    return cfg


def spread(values: list[int]) -> tuple[int, float]:
    """(max - min, (max - min) / median)."""
    width = max(values) - min(values)
    return width, width / statistics.median(values)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=30, help="trials in the study (default 30)")
    parser.add_argument("--workdir", type=Path, help="where the search runs, kept afterwards (default: a new temporary folder, removed when all is well)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary work folder afterwards")
    args = parser.parse_args(argv)

    workdir = (args.workdir or Path(tempfile.mkdtemp(prefix="tiersep-isolation-"))).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    config = workdir / "search.yaml"
    config.write_text(yaml.safe_dump(search_config(args.trials, workdir), sort_keys=False))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    print(f"search_isolation: {args.trials} trials of {PRESET.stem} in a row in {workdir}", flush=True)
    began = time.time()
    with open(workdir / "search.log", "w") as log:
        search = subprocess.Popen([sys.executable, "-m", "tiersep.cli", "search", "--config", str(config)],
                                  cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        rc = search.wait()
    seconds = time.time() - began

    folder = workdir / "results" / "search" / STUDY
    rows = list(csv.DictReader(open(folder / "trials.csv", newline=""))) if (folder / "trials.csv").is_file() else []
    states = [row["state"] for row in rows]
    runs = [json.loads(path.read_text()) for row in rows
            if (path := folder / "trials" / row["number"] / "run.json").is_file()]
    print(f"tiersep search exit {rc} after {seconds:.0f} s; log {workdir / 'search.log'}")
    print(f"trials: {len(rows)}/{args.trials}; " + ", ".join(f"{s} {states.count(s)}" for s in sorted(set(states))))
    pids = {run["pid"] for run in runs}
    print(f"processes: {len(pids)} different pids for {len(runs)} runs (orchestrator {search.pid} "
          f"{'among them' if search.pid in pids else 'not among them'})")
    ok = rc == 0 and states == ["COMPLETE"] * args.trials and len(pids) == args.trials and search.pid not in pids
    for field in FIELDS:
        values = [run[field] for run in runs if isinstance(run.get(field), int)]
        if not values:
            print(f"{field}: no values")
            ok = False
            continue
        width, relative = spread(values)
        print(f"{field}: min {min(values) / 2**20:.1f} MiB, median {statistics.median(values) / 2**20:.1f} MiB, "
              f"max {max(values) / 2**20:.1f} MiB; spread {width / 2**20:.1f} MiB = {relative:.2%} "
              f"({'within' if relative <= TARGET_SPREAD else 'OVER'} {TARGET_SPREAD:.0%})")
        ok = ok and relative <= TARGET_SPREAD
    device = {run.get("device_type") for run in runs}
    print(f"device: {', '.join(sorted(map(str, device))) or 'none'}")
    if not args.keep and ok and args.workdir is None:    # only the temporary folder it made itself
        shutil.rmtree(workdir)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
