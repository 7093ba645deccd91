"""Data-parallel scaling on this machine: samples/s and every rank's peak RSS of `tiersep train`
for 1 and 2 ranks (or --ranks ...), the same per-rank micro-batch, through the real torchrun.

    .venv/bin/python bench/ddp_scaling.py                                   # cpu_tiny, 1 and 2 ranks
    .venv/bin/python bench/ddp_scaling.py --ranks 1 2 --steps 100 --out bench/results/ddp_scaling_cpu.md

A tiny synthetic set (the training tests' workspace) is prepared in a temporary folder first.
Samples/s = steps/s (run.json's, of the fastest of --repeat runs) x effective batch (micro-batch x
ranks). On a CPU the ranks share the cores: each gets cores / ranks threads.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "tests"))

from test_train_support import make_workspace  # noqa: E402


def run_tier(ws: dict, out: Path, preset: str, ranks: int, steps: int) -> dict:
    """Train `preset` on `ranks` ranks for `steps` steps; its run.json, with the wall time."""
    sets = {"train.ranks": ranks, "train.steps": steps, "train.validate_every": 10**6,
            "train.checkpoint_every": 10**6, "train.validate_segments": 1, "train.num_workers": 0}
    cmd = [sys.executable, "-m", "tiersep.cli", "train", "--config", str(ws["config_file"]), "--preset", preset,
           "--data", str(ws["data"]), "--out", str(out)]
    for key, value in sets.items():
        cmd += ["--set", f"{key}={value}"]
    started = time.time()
    done = subprocess.run(cmd, cwd=REPO, text=True, capture_output=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    run = json.loads((out / "run.json").read_text())
    run["bench_wall_seconds"] = time.time() - started
    return run


def table(rows: list[dict]) -> str:
    lines = ["| ranks | torch threads per rank | micro-batch | effective batch | steps/s | samples/s | speed-up "
             "| samples/s, all runs | peak RSS per rank (MiB) | job wall (s) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    base = rows[0]["samples_per_s"]
    for row in rows:
        peaks = ", ".join(f"{p / 2**20:.0f}" for p in row["peaks"])
        lines.append(f"| {row['ranks']} | {row['threads']} | {row['batch_size']} | {row['effective_batch']} | {row['steps_per_s']:.2f} "
                     f"| {row['samples_per_s']:.2f} | {row['samples_per_s'] / base:.2f}x | {row['all']} | {peaks} | {row['wall']:.1f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default=str(REPO / "config" / "presets" / "cpu_tiny.yaml"))
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--repeat", type=int, default=3, help="runs per rank count; the fastest is kept "
                        "(the machine may be shared)")
    parser.add_argument("--out", help="write the Markdown table here")
    args = parser.parse_args(argv)
    import torch

    rows = []
    with tempfile.TemporaryDirectory(prefix="ddp-scaling-") as tmp:
        ws = make_workspace(Path(tmp) / "ws")
        load_before = os.getloadavg()
        for ranks in args.ranks:
            runs = [run_tier(ws, Path(tmp) / f"ranks{ranks}-{i}", args.preset, ranks, args.steps)
                    for i in range(args.repeat)]
            run = max(runs, key=lambda r: r["steps_per_s"])
            peaks = [r["peak_rss_bytes"] for r in run["per_rank"]] if run.get("per_rank") else [run["peak_rss_bytes"]]
            rows.append({"ranks": ranks, "batch_size": run["batch_size"], "effective_batch": run["effective_batch"],
                         "steps_per_s": run["steps_per_s"], "samples_per_s": run["steps_per_s"] * run["effective_batch"],
                         "peaks": peaks, "wall": run["bench_wall_seconds"], "threads": run["torch_threads"],
                         "all": ", ".join(f"{r['steps_per_s'] * r['effective_batch']:.1f}" for r in runs)})
            print(f"{ranks} rank(s): {rows[-1]['samples_per_s']:.2f} samples/s", file=sys.stderr)
        load_after = os.getloadavg()
    cores = len(os.sched_getaffinity(0))
    text = (f"# Data-parallel scaling on CPU (`bench/ddp_scaling.py`)\n\n"
            f"`{' '.join(['bench/ddp_scaling.py', *(argv if argv is not None else sys.argv[1:])])}`, "
            f"preset {Path(args.preset).stem}, {args.steps} steps, gloo through torchrun; the fastest of "
            f"{args.repeat} runs per row.\n"
            f"Machine: {platform.node()}, {platform.processor() or platform.machine()}, {cores} cores; "
            f"torch {torch.__version__}, Python {platform.python_version()}; load average (1 min) "
            f"{load_before[0]:.2f} before, {load_after[0]:.2f} after; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.\n\n"
            + table(rows) + "\n\nPeak RSS per rank: each process's high-water mark (run.json `per_rank`; "
            "`peak_rss_bytes` for one rank). Each rank holds its own interpreter, torch and model, so the "
            "job's memory grows by about one process per rank.\n")
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
