"""The search on a real GPU (issue 30): two questions no CPU test can answer.

    python bench/gpu_search_check.py --out DIR               # on a GPU (../shared/gpu/OFFLINE-GPU.md)
    python bench/gpu_search_check.py --out DIR --dry-run     # the same plan on a CPU, cpu_tiny

1. cuda_init.json: does estimating a trial for `cuda` (the fit gate's trace, what the search's
   orchestrator runs for every trial before launch) start CUDA in the estimating process? A CUDA
   context there is device memory that no booking counts, and gpu_lease refuses a lease after it.
   Written: whether it did, and the first stack that did it.
2. search/: a real `tiersep search` of short `small` variants on the GPU, 2 at once under a budget
   that fits two: the study's trials.csv and log, and NVML's device use per process every 0.1 s
   (nvml.jsonl), to set against each trial's booking.
On an offline GPU machine (../shared/gpu/OFFLINE-GPU.md) carry the project's own wheel in .whl/ too
(`pip wheel --no-deps -w .whl .`): the search starts `tiersep train` by the command's module, which
it reads from the installed package's metadata (src/ on PYTHONPATH has none).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def cuda_init_probe(preset_name: str) -> dict:
    """In this (fresh) process: gate `preset_name` for cuda and report who started CUDA."""
    import torch

    from tiersep import config as C
    from tiersep.memory import GateSettings, gate

    first = {}
    real = torch.cuda._lazy_init

    def spy():
        if not first and not torch.cuda.is_initialized():
            first["stack"] = "".join(traceback.format_stack(limit=14)[:-1])
        return real()

    torch.cuda._lazy_init = spy
    preset = C.load_preset(preset_name, {"presets_dir": str(ROOT / "config" / "presets")})
    began = time.time()
    record = gate(preset, "cuda", None, GateSettings(0.08, "auto"))
    return {"preset": preset_name, "initialised": torch.cuda.is_initialized(), "first_stack": first.get("stack"),
            "gate_seconds": round(time.time() - began, 2), "gate_required_bytes": record["gate_required_bytes"]}


def nvml_sampler(path: Path, stop: threading.Event) -> None:
    from tiersep import gpu_info

    with open(path, "w") as f:
        while not stop.is_set():
            for p in gpu_info.processes() or []:
                f.write(json.dumps({"t": round(time.time(), 2), **p}) + "\n")
            time.sleep(0.1)


def run_search(out: Path, dry_run: bool, trials: int, parallel: int, steps: int) -> dict:
    from tiersep import config as C
    from tiersep.data.prepare import prepare

    work = out / "search"
    work.mkdir(parents=True, exist_ok=True)
    name = "cpu_tiny" if dry_run else "small"
    base = C.load_preset(name, {"presets_dir": str(ROOT / "config" / "presets")})
    base["name"] = "gpu_search_base"
    base["train"].update({"steps": steps, "validate_every": steps // 2, "checkpoint_every": steps // 2,
                          "validate_segments": 1, "warmup_steps": 2, "export": "last", "num_workers": 0})
    (work / "base.yaml").write_text(yaml.safe_dump(base, sort_keys=False))
    rate = base["audio"]["sample_rate"]
    raw = {"data": {"source": "synthetic", "prepared_dir": str(work / "data"),
                    "synthetic": {"seed": 3, "sample_rate": rate, "train_tracks": 3, "valid_tracks": 1,
                                  "test_tracks": 1, "track_seconds": 4}},
           "results_dir": str(work / "results"), "budget_gib": 2 if dry_run else 20,
           "search": {"preset": str(work / "base.yaml"), "evaluate": False, "trials": trials,
                      "parallel": parallel, "pruner": "none", "budget_gib": "auto", "sampler": "random",
                      "space": {"train.lr": {"low": 1e-4, "high": 1e-2, "log": True},
                                "train.batch_size": {"choices": [1, 2]},
                                "model.n_layers": {"low": 2, "high": 4}}}}
    config = work / "config.yaml"
    config.write_text(yaml.safe_dump(raw, sort_keys=False))
    prepare(C.load_config(config), work / "data" / "synthetic" / str(rate), rate, progress=False)
    stop = threading.Event()
    sampler = threading.Thread(target=nvml_sampler, args=(work / "nvml.jsonl", stop), daemon=True)
    sampler.start()
    began = time.time()
    with open(work / "search.log", "w") as log:
        done = subprocess.run([sys.executable, "-m", "tiersep.cli", "search", "--config", str(config)],
                              stdout=log, stderr=subprocess.STDOUT, cwd=work)
    stop.set()
    sampler.join()
    return {"rc": done.returncode, "seconds": round(time.time() - began, 1),
            "log_tail": (work / "search.log").read_text()[-3000:]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dry-run", action="store_true", help="cpu_tiny on a CPU: the plan, no GPU figures")
    parser.add_argument("--trials", type=int, default=4)
    parser.add_argument("--parallel", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--probe", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.probe:
        print(json.dumps(cuda_init_probe(args.probe)))
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    probes = []
    for name in ("small", "memory_optimized"):
        done = subprocess.run([sys.executable, __file__, "--out", str(args.out), "--probe", name],
                              capture_output=True, text=True, cwd=ROOT)
        probes.append(json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else
                      {"preset": name, "failed": done.stderr[-2000:]})
    (args.out / "cuda_init.json").write_text(json.dumps(probes, indent=1) + "\n")
    print(json.dumps(probes, indent=1)[:3000])
    result = run_search(args.out, args.dry_run, args.trials, args.parallel, args.steps)
    (args.out / "search.json").write_text(json.dumps(result, indent=1) + "\n")
    print(result["log_tail"])
    print(f"search exit {result['rc']} in {result['seconds']} s")
    return result["rc"]


if __name__ == "__main__":
    sys.exit(main())
