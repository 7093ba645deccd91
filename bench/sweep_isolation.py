"""Are sweep trials isolated from each other? N trials of a tiny CPU preset through the real Snakemake.

Every trial of a sweep is its own train job (its own process), started while other jobs (estimates,
other trials) may run beside it. On the H100, a trial trained while estimate jobs with budget_gib:
auto held CUDA contexts saw 1.05 GiB less free memory than the trials after it
(tests/data/gpu/h100-2026-11-22/README.md, "Sweep"). This bench runs a sweep of N trials
(`sweep: {presets: [test_tiny], grid: {train.seed: [0 .. N-1]}}`, budget_gib: auto) through
`snakemake` in a copy of the workflow, then reads each trial's run.json and prints:

- how many of the N trials finished (run.json written);
- the spread, max - min and relative to the median, of `start_process_bytes` (the train process's
  own footprint when it starts: resident set on CPU, CUDA reserved on a GPU) and of
  `start_free_bytes` (free memory before the job allocated anything: the machine's available RAM
  on CPU, the GPU's free memory on a GPU). Target: N/N and both spreads within 2%.

    python bench/sweep_isolation.py                  # 30 trials, 2 cores, in a temporary folder
    python bench/sweep_isolation.py --trials 4 --workdir /tmp/sweep --keep

On a CPU machine start_free_bytes follows whatever else the machine runs; on a GPU it is the
figure the H100 finding is about.
"""
from __future__ import annotations

import argparse
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
PRESET = "test_tiny"   # tests/configs/presets: 8 kHz, 1 layer x 8, 6 steps
FIELDS = ("start_process_bytes", "start_free_bytes")
TARGET_SPREAD = 0.02


def copy_workflow(dest: Path) -> Path:
    """What a run needs: Snakefile, workflow/, config/, profiles/, envs/, tests/configs."""
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy(ROOT / "Snakefile", dest / "Snakefile")
    for folder in ("workflow", "config", "profiles", "envs"):
        if (ROOT / folder).is_dir():
            shutil.copytree(ROOT / folder, dest / folder)
    shutil.copytree(ROOT / "tests" / "configs", dest / "tests" / "configs")
    return dest


def sweep_config(trials: int) -> dict:
    cfg = yaml.safe_load((ROOT / "tests" / "configs" / "tiny.yaml").read_text())
    cfg.update(tiers=[PRESET], estimate_tiers=[], budget_gib="auto",
               sweep={"presets": [PRESET], "grid": {"train.seed": list(range(trials))}})
    return cfg


def spread(values: list[int]) -> tuple[int, float]:
    """(max - min, (max - min) / median)."""
    width = max(values) - min(values)
    return width, width / statistics.median(values)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=30, help="sweep trials (default 30)")
    parser.add_argument("--cores", type=int, default=2, help="snakemake --cores (default 2)")
    parser.add_argument("--workdir", type=Path, help="where the workflow copy runs (default: a new "
                        "temporary folder)")
    parser.add_argument("--keep", action="store_true", help="keep the workflow copy afterwards")
    args = parser.parse_args(argv)

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="tiersep-sweep-"))
    wf = copy_workflow(workdir / "wf")
    (wf / "sweep.yaml").write_text(yaml.safe_dump(sweep_config(args.trials), sort_keys=False))
    from tiersep import config as C
    from tiersep.train.sweep import trial_names

    names = trial_names(C.load_config(wf / "sweep.yaml"))
    targets = [f"results/train/{name}/outcome.json" for name in names]
    bindir = Path(sys.executable).parent
    env = {**os.environ, "PATH": f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}", "OMP_NUM_THREADS": "1"}
    command = [str(bindir / "snakemake"), *targets, "--cores", str(args.cores), "--resources", "gpu=1",
               "--configfile", "sweep.yaml", "--keep-going"]
    print(f"sweep_isolation: {args.trials} trials of {PRESET} in {wf} (snakemake --cores {args.cores})",
          flush=True)
    began = time.time()
    with open(workdir / "snakemake.log", "w") as log:
        rc = subprocess.run(command, cwd=wf, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    seconds = time.time() - began

    runs = {}
    for name in names:
        path = wf / "results" / "train" / name / "run.json"
        if path.is_file():
            runs[name] = json.loads(path.read_text())
    print(f"snakemake exit {rc} after {seconds:.0f} s; log {workdir / 'snakemake.log'}")
    print(f"trials finished: {len(runs)}/{len(names)}")
    ok = len(runs) == len(names)
    for field in FIELDS:
        values = [run[field] for run in runs.values() if isinstance(run.get(field), int)]
        if not values:
            print(f"{field}: no values")
            ok = False
            continue
        width, relative = spread(values)
        print(f"{field}: min {min(values) / 2**20:.1f} MiB, median {statistics.median(values) / 2**20:.1f} MiB, "
              f"max {max(values) / 2**20:.1f} MiB; spread {width / 2**20:.1f} MiB = {relative:.2%} "
              f"({'within' if relative <= TARGET_SPREAD else 'OVER'} {TARGET_SPREAD:.0%})")
        ok = ok and relative <= TARGET_SPREAD
    device = {run.get("device_type") for run in runs.values()}
    print(f"device: {', '.join(sorted(map(str, device))) or 'none'}")
    if not args.keep and ok:
        shutil.rmtree(workdir)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
