"""How close are the memory estimates to real training steps?

CPU (default): for CPU-sized configurations that vary layers, width, segment, batch, precision and
checkpointing, run one real training step per configuration in a fresh process and compare the
measured peak of live tensor bytes with the `cpu` trace estimate (target: within 3%) and with the
analytic form (target: within 10%). The process's peak RSS growth is shown beside them.

CUDA (--device cuda, needs a GPU): for the seed presets (shortened to fit the GPU where the estimate
says they do not fit as they are), run three real steps per preset in a fresh process, with the
allocator mode the preset plans (train.cuda_expandable_segments, or PYTORCH_CUDA_ALLOC_CONF), and
compare torch.cuda.max_memory_allocated / max_memory_reserved with the trace's allocated_peak_bytes /
reserved_peak_bytes (targets: 0.5% and 1.5%), the device use (total - free, what nvidia-smi shows)
with the estimate's peak_bytes (target: 1.5%), and the process's memory outside torch's counters
(CUDA context, library handles) with the calibration's context.

    python bench/estimator_accuracy.py                 # CPU table -> bench/results/estimator_accuracy_cpu.md
    python bench/estimator_accuracy.py --device cuda   # GPU table -> bench/results/estimator_accuracy_cuda.md
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MIB, GIB = 2**20, 2**30

# The base: the cpu_small tier's 8 kHz audio with every size pinned here (the tier may be retuned):
# 2 s segments, n_fft 256, hop 128, 2 layers x 24, 2 heads, micro-batch 4, fp32, no dropout.
BASE = {"audio.segment_samples": 16000, "audio.n_fft": 256, "audio.hop": 128, "model.n_layers": 2,
        "model.emb_dim": 24, "model.attention_dim": 24, "model.n_heads": 2, "model.ffn_hidden": 48,
        "model.norm_groups": 4, "model.dropout": 0.0, "model.checkpointing": False,
        "model.attention_backend": "auto", "train.batch_size": 4, "train.grad_accum": 1,
        "train.precision": "fp32"}
# name -> overrides of BASE. Each real step: a few seconds, < 4 GB.
CPU_CONFIGS = {
    "base": {},
    "4 layers": {"model.n_layers": 4},
    "width 48": {"model.emb_dim": 48, "model.attention_dim": 48, "model.n_heads": 4, "model.ffn_hidden": 96},
    "segment 4 s, batch 2": {"audio.segment_samples": 32000, "train.batch_size": 2},
    "batch 8": {"train.batch_size": 8},
    "bf16, dropout 0.1": {"train.precision": "bf16", "model.dropout": 0.1},
    "checkpointing, dropout 0.1": {"model.checkpointing": True, "model.dropout": 0.1},
    "bf16 + checkpointing, hop 64, accum 2": {"train.precision": "bf16", "model.checkpointing": True,
                                              "audio.hop": 64, "train.batch_size": 2, "train.grad_accum": 2},
}
SEED_PRESETS = ["ultra_safe", "small", "memory_optimized", "large", "xlarge"]


def load(name: str, overrides: dict) -> dict:
    from tiersep import config as C

    preset = C.load_preset(name, {"presets_dir": str(ROOT / "config" / "presets")})
    for key, value in overrides.items():
        preset = C.set_field(preset, key, value)
    return preset


# ------------------------------------------------------------------------------------------------
# one configuration, in its own process (clean RSS high-water mark / clean CUDA allocator)
# ------------------------------------------------------------------------------------------------
def run_one(spec: dict) -> dict:
    from tiersep.memory import estimate
    from tiersep.memory.measure import measure_step

    device = spec["device"]
    out = {"name": spec["name"]}
    if device == "cuda":            # before CUDA starts: the allocator mode the estimate models
        from tiersep.device import configure_cuda_allocator

        out["allocator"] = configure_cuda_allocator(load(spec["preset"], spec["overrides"]))["conf"] or "native"
    if spec.get("shrink_to_gpu"):   # sized here, in the measuring process, from its free memory
        import torch

        spec["overrides"] = shrink_to_gpu(spec["preset"], torch.cuda.mem_get_info()[0])
        if spec["overrides"]:
            rate = load(spec["preset"], {})["audio"]["sample_rate"]
            out["name"] = f"{spec['name']} @ {spec['overrides']['audio.segment_samples'] / rate:.2f} s"
    preset = load(spec["preset"], spec["overrides"])
    start = time.time()
    traced = estimate(preset, "trace", device)
    out["trace_seconds"] = time.time() - start
    closed = estimate(preset, "analytic", device)
    out.update(trace_allocated=traced["allocated_peak_bytes"], trace_reserved=traced["reserved_peak_bytes"],
               trace_peak=traced["peak_bytes"], analytic_allocated=closed["allocated_peak_bytes"],
               analytic_peak=closed["peak_bytes"], kernel=traced["attention_backend"],
               overhead_booked=traced.get("overhead_detail", {}).get("cuda_context"))
    if device == "cuda":
        import torch

        try:
            measured = measure_step(preset, "cuda", steps=3)
        except torch.OutOfMemoryError as err:
            out["oom"] = str(err).splitlines()[0]
            return out
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        out.update(measured_allocated=measured.allocated_peak, measured_reserved=measured.reserved_peak,
                   measured_device=total - free, outside_torch=(total - free) - torch.cuda.memory_reserved(),
                   step_seconds=measured.seconds_per_step)
    else:
        measured = measure_step(preset, "cpu", steps=1)
        out.update(measured_allocated=measured.allocated_peak, rss_growth=measured.rss_growth,
                   step_seconds=measured.seconds_per_step)
    return out


def in_subprocess(spec: dict) -> dict:
    result = subprocess.run([sys.executable, __file__, "--one", json.dumps(spec)], capture_output=True,
                            text=True, cwd=ROOT)
    if result.returncode != 0:
        raise RuntimeError(f"{spec['name']}: {result.stderr.strip()[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------------------------
# tables
# ------------------------------------------------------------------------------------------------
def rel(estimated, measured) -> float:
    return estimated / measured - 1.0


def cpu_table(rows: list[dict]) -> tuple[str, float, float]:
    lines = ["| configuration | kernel | measured peak live (MiB) | trace (MiB) | trace error | analytic (MiB) | "
             "analytic error | RSS growth (MiB) | step (s) | trace (s) |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    worst_trace = worst_analytic = 0.0
    for r in rows:
        m = r["measured_allocated"]
        et, ea = rel(r["trace_allocated"], m), rel(r["analytic_allocated"], m)
        worst_trace, worst_analytic = max(worst_trace, abs(et)), max(worst_analytic, abs(ea))
        rss = f"{r['rss_growth'] / MIB:.0f}" if r.get("rss_growth") else "n/a"
        lines.append(f"| {r['name']} | {r['kernel']} | {m / MIB:.1f} | {r['trace_allocated'] / MIB:.1f} | {et:+.2%} | "
                     f"{r['analytic_allocated'] / MIB:.1f} | {ea:+.2%} | {rss} | {r['step_seconds']:.1f} | "
                     f"{r['trace_seconds']:.1f} |")
    return "\n".join(lines), worst_trace, worst_analytic


def cuda_table(rows: list[dict]) -> tuple[str, dict]:
    lines = ["| preset | allocator | kernel | max_memory_allocated (GiB) | trace allocated (GiB) | error | "
             "max_memory_reserved (GiB) | trace reserved (GiB) | error | device use (GiB) | trace peak_bytes (GiB) | "
             "error | outside torch (MiB) | calibration context (MiB) | analytic peak (GiB) | step (s) |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    worst = {"allocated": 0.0, "reserved": 0.0, "device": 0.0}
    for r in rows:
        if "oom" in r:
            lines.append(f"| {r['name']} | {r['allocator']} | {r['kernel']} | OOM | {r['trace_allocated'] / GIB:.2f} | | | "
                         f"{r['trace_reserved'] / GIB:.2f} | | | {r['trace_peak'] / GIB:.2f} | | | | "
                         f"{r['analytic_peak'] / GIB:.2f} | |")
            continue
        ea, er = rel(r["trace_allocated"], r["measured_allocated"]), rel(r["trace_reserved"], r["measured_reserved"])
        ed = rel(r["trace_peak"], r["measured_device"])
        for key, err in (("allocated", ea), ("reserved", er), ("device", ed)):
            worst[key] = max(worst[key], abs(err))
        lines.append(f"| {r['name']} | {r['allocator']} | {r['kernel']} | {r['measured_allocated'] / GIB:.3f} | "
                     f"{r['trace_allocated'] / GIB:.3f} | {ea:+.2%} | {r['measured_reserved'] / GIB:.3f} | "
                     f"{r['trace_reserved'] / GIB:.3f} | {er:+.2%} | {r['measured_device'] / GIB:.3f} | "
                     f"{r['trace_peak'] / GIB:.3f} | {ed:+.2%} | {r['outside_torch'] / MIB:.0f} | "
                     f"{(r['overhead_booked'] or 0) / MIB:.0f} | {r['analytic_peak'] / GIB:.2f} | "
                     f"{r['step_seconds']:.2f} |")
    return "\n".join(lines), worst


def shrink_to_gpu(name: str, free_bytes: int) -> dict:
    """Overrides that halve the seed preset's segment (in hops) until the trace says it fits 80% of
    the GPU's free memory (no overrides when it fits as it is)."""
    from tiersep.memory.trace import trace_step

    from tiersep.device import planned_allocator

    preset = load(name, {})
    segment, hop, n_fft = preset["audio"]["segment_samples"], preset["audio"]["hop"], preset["audio"]["n_fft"]
    expandable = planned_allocator(preset)["expandable_segments"]
    overrides: dict = {}
    while (trace_step(load(name, overrides), "cuda", expandable_segments=expandable).reserved_peak > 0.8 * free_bytes
           and segment > 4 * n_fft):
        segment = max(segment // 2 // hop * hop, n_fft)
        overrides = {"audio.segment_samples": segment}
    return overrides


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--out", help="Markdown table path (default bench/results/estimator_accuracy_<device>.md)")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(run_one(json.loads(args.one))))
        return 0

    from tqdm import tqdm

    from tiersep.io import write_text

    out = Path(args.out or ROOT / "bench" / "results" / f"estimator_accuracy_{args.device}.md")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("estimator_accuracy: --device cuda needs a visible CUDA GPU (torch.cuda.is_available() is "
                  "False); run it on a GPU machine, or use the default CPU mode.", file=sys.stderr)
            return 2
        # This process stays CUDA-free (no context) so that each measuring child has the GPU to itself.
        probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.get_device_name())"],
                               capture_output=True, text=True, check=True)
        gpu = probe.stdout.strip()
        specs = [{"name": name, "preset": name, "overrides": {}, "device": "cuda", "shrink_to_gpu": True}
                 for name in SEED_PRESETS]
    else:
        gpu = None
        specs = [{"name": name, "preset": "cpu_small", "overrides": {**BASE, **o}, "device": "cpu"}
                 for name, o in CPU_CONFIGS.items()]
    rows = [in_subprocess(spec) for spec in tqdm(specs, desc=f"estimator accuracy ({args.device})", unit="config")]

    import platform

    import torch

    header = (f"# Estimator accuracy ({args.device})\n\n"
              f"torch {torch.__version__}, {platform.machine()}, {gpu.strip() if gpu else 'CPU'}; "
              f"generated by bench/estimator_accuracy.py on {time.strftime('%Y-%m-%d')}.\n\n")
    if args.device == "cuda":
        table, worst = cuda_table(rows)
        summary = (f"Worst error of the trace: allocated {worst['allocated']:.2%} (target 0.5%), reserved "
                   f"{worst['reserved']:.2%} (target 1.5%), device use {worst['device']:.2%} (target 1.5%; "
                   "peak_bytes = reserved + the calibration's CUDA context).")
    else:
        table, worst_t, worst_a = cpu_table(rows)
        summary = (f"Worst error: trace {worst_t:.2%} (target 3%), analytic {worst_a:.2%} (target 10%) against the "
                   "measured peak of live tensor bytes (same counter on real tensors). RSS growth is the "
                   "process's peak RSS minus its RSS before the step (includes malloc slack).")
    text = header + table + "\n\n" + summary + "\n"
    print(text)
    write_text(out, text)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
