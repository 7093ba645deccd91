"""What fits which GPU, timed and checked: `tiersep fit --gpus` over the default config's five seed
tiers and the default 8 budgets (issue 22's target: under 60 s on 2 CPUs), against one single
`tiersep fit --preset P --budget B` per cell (same levers, peak within 0.1%).

    python bench/fit_matrix.py [--presets ...] [--gpus 8,12,16,24,40,48,80,96] [--jobs 2 1] [--singles 2]
    python bench/fit_matrix.py --gpus catalogue --singles 0     # issue 31: every GPU of the catalogue
    python bench/fit_matrix.py --gpus catalogue --jobs 2 --per-tier 2 --singles 0   # and one call per tier

Prints Markdown: the machine (CPU, cores, load average before and after: on a shared machine the
first thing to read), torch, the wall time of each matrix run (process start included; one per
--jobs value) and its CPU time (what an idle machine's wall time would be, divided by the processes
that overlap), its traces, the matrix, and the agreement of every cell with its single `fit` (run
--singles processes at a time; 0: not checked, and the output says so). With --per-tier J, also one
`tiersep fit --preset P --gpus ... --jobs J` per tier, in a row (the other way issue 31 times): their
summed wall and CPU time, and whether each call's row is the matrix's, cell for cell. Exit 1 when a
cell disagrees.
A GPU of the catalogue is checked against `tiersep fit --gpu NAME` (its kernels and precision).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
TIERSEP = str(Path(sys.executable).parent / "tiersep")
SEEDS = ["ultra_safe", "small", "memory_optimized", "large", "xlarge"]
GPUS = "8,12,16,24,40,48,80,96"
GIB = 2**30
COMMON = ["--config", "config/config.yaml", "--device", "cuda"]


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def cpu_seconds() -> float:
    """CPU time (user + system) of this process's finished children, worker processes included."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_matrix(presets: list[str], gpus: str, jobs: int, out: Path) -> tuple[float, float, dict]:
    """(wall seconds, CPU seconds, the record) of one `tiersep fit --gpus` process."""
    argv = [TIERSEP, "fit", *COMMON, *[a for p in presets for a in ("--preset", p)], "--gpus", gpus,
            "--jobs", str(jobs), "--json", str(out / "fit_matrix.json"), "--out", str(out / "presets")]
    start, cpu = time.time(), cpu_seconds()
    subprocess.run(argv, cwd=ROOT, check=True, capture_output=True, text=True)
    return time.time() - start, cpu_seconds() - cpu, json.loads((out / "fit_matrix.json").read_text())


def per_tier_calls(presets: list[str], gpus: str, jobs: int, tmp: Path, record: dict) -> bool:
    """One `tiersep fit --preset P --gpus` per tier, in a row: prints their summed times as a row of
    the table; whether every call's row is the matrix's (`record`), cell for cell."""
    seconds = cpu = traces = 0.0
    differ = []
    for tier, matrix_row in zip(presets, record["tiers"]):
        wall, used, result = run_matrix([tier], gpus, jobs, tmp / f"tier_{tier}")
        seconds, cpu, traces = seconds + wall, cpu + used, traces + result["traces"]
        if result["tiers"][0]["cells"] != matrix_row["cells"]:
            differ.append(tier)
    print(f"| {jobs} in each of {len(presets)} per-tier calls, in a row | {seconds:.1f} | {cpu:.1f} | {traces:.0f} | "
          f"{os.getloadavg()[0]:.1f} |")
    print("\nThe per-tier calls' rows are the matrix's, cell for cell." if not differ else
          f"\n**The per-tier calls' rows differ from the matrix's: {', '.join(differ)}.**")
    return not differ


def single(tier: str, budget: dict, out: Path) -> dict:
    """One `tiersep fit --budget` of a cell: its exit code, the preset it wrote and its printed peak."""
    path = out / f"{tier}_{budget['bytes']}.yaml"
    argv = [TIERSEP, "fit", *COMMON, "--preset", tier, "--out", str(path)]
    argv += ["--gpu", budget["gpu"]] if budget.get("gpu") else ["--budget", repr(budget["bytes"] / GIB)]
    start = time.time()
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
    found = re.search(r"\(trace estimate (\d+\.\d+) GiB ±", proc.stdout)
    return {"code": proc.returncode, "seconds": time.time() - start, "stderr": proc.stderr.strip()[-300:],
            "preset": yaml.safe_load(path.read_text()) if proc.returncode == 0 else None,
            "peak_gib": float(found.group(1)) if found else None}


def agreement(cell: dict, matrix_preset: dict | None, one: dict) -> tuple[bool, str]:
    """(agrees, what differs): the same levers to the sample and the peak within 0.1%, or both say
    nothing fits."""
    if cell["status"] == "no":
        return one["code"] == 3, "" if one["code"] == 3 else f"single fit exit {one['code']}"
    if one["code"] != 0:
        return False, f"single fit exit {one['code']}: {one['stderr']}"
    same = all(matrix_preset[s] == one["preset"][s] for s in ("audio", "model", "train"))
    peak = abs(cell["peak_bytes"] / GIB / one["peak_gib"] - 1)
    return same and peak <= 0.001, f"{'same levers' if same else 'OTHER LEVERS'}, peak {peak:.3%} apart"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=SEEDS)
    parser.add_argument("--gpus", default=GPUS)
    parser.add_argument("--jobs", nargs="+", type=int, default=[2, 1], help="matrix runs, one per value")
    parser.add_argument("--singles", type=int, default=2, help="single fit processes at a time")
    parser.add_argument("--per-tier", type=int, metavar="J", help="also one call per tier, with --jobs J")
    args = parser.parse_args()
    import torch

    if args.gpus == "catalogue":
        sys.path.insert(0, str(ROOT / "src"))
        from tiersep import gpu_catalogue

        args.gpus = ",".join(gpu_catalogue.by_name())

    load_before = os.getloadavg()[0]
    print(f"# `tiersep fit --gpus`: {len(args.presets)} tiers x {len(args.gpus.split(','))} budgets\n")
    print(f"Generated by `python bench/fit_matrix.py` on {time.strftime('%Y-%m-%d')}: {cpu_model()}, "
          f"{os.cpu_count()} cores (shared with other jobs), torch {torch.__version__}, Python "
          f"{platform.python_version()}. Load average {load_before:.1f} before.\n")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        print("| --jobs | wall s (process start included) | CPU s (all its processes) | traces | load average after |")
        print("|---:|---:|---:|---:|---:|")
        record = first_out = None
        for jobs in args.jobs:
            out = tmp / f"jobs{jobs}"
            seconds, cpu, result = run_matrix(args.presets, args.gpus, jobs, out)
            if record is None:   # the cells checked below: the first run's
                record, first_out = result, out
            print(f"| {jobs} | {seconds:.1f} | {cpu:.1f} | {result['traces']} | {os.getloadavg()[0]:.1f} |")
        if args.per_tier:
            same = per_tier_calls(args.presets, args.gpus, args.per_tier, tmp, record)
            if not same:
                return 1
        sys.path.insert(0, str(ROOT / "src"))
        from tiersep.memory.fit.matrix import table_lines

        print("\n```\n" + "\n".join(table_lines(record)) + "\n```\n")
        if args.singles == 0:
            print("The cells were not checked against single `tiersep fit` calls (--singles 0).")
            return 0
        cells = [(row["tier"], budget, cell) for row in record["tiers"]
                 for budget, cell in zip(record["budgets"], row["cells"])]
        singles_dir = tmp / "singles"
        singles_dir.mkdir()
        started = time.time()
        with ThreadPoolExecutor(args.singles) as pool:
            ones = list(pool.map(lambda c: single(c[0], c[1], singles_dir), cells))
        single_wall = time.time() - started
        print("| tier | budget | matrix | single `fit` s | agrees |")
        print("|---|---|---|---:|---|")
        agreed, worst = 0, 0.0
        for (tier, budget, cell), one in zip(cells, ones):
            mine = (yaml.safe_load((first_out / "presets" / f"{cell['preset']}.yaml").read_text())
                    if cell["status"] != "no" else None)
            ok, why = agreement(cell, mine, one)
            agreed += ok
            if cell["status"] != "no" and one["peak_gib"]:
                worst = max(worst, abs(cell["peak_bytes"] / GIB / one["peak_gib"] - 1))
            print(f"| {tier} | {budget['label']} | {cell['short']} | {one['seconds']:.1f} | "
                  f"{'yes' if ok else 'NO'}{': ' + why if why else ''} |")
    print(f"\n{agreed} of {len(cells)} cells agree with their single `tiersep fit` (same levers; peak within "
          f"0.1%, largest difference {worst:.3%} at the 3 decimals of GiB fit prints); the {len(cells)} single "
          f"calls took {single_wall:.0f} s ({args.singles} at a time). Load average {os.getloadavg()[0]:.1f} after.")
    return 0 if agreed == len(cells) else 1


if __name__ == "__main__":
    sys.exit(main())
