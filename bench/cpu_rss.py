"""Does the CPU fit gate book the whole train process? Estimate vs booking vs real peak RSS.

For each preset below: the `trace` estimate on cpu (live tensor bytes), the booking of
tiersep.memory.cpu_process (what the gate compares with the budget), and the peak RSS of a real
`tiersep train` process (a few steps, validation every step, the export at the end), measured
from outside with os.wait4 through cpu_process.measure_peak_rss. Each preset is trained in both host-malloc
modes the booking knows: `tuned` (train.host_malloc: tuned, the trainer applies
cpu_process.configure_malloc()) and `default` (train.host_malloc: glibc_default, glibc as it comes,
what auto picks whenever its booking fits the budget).

    python bench/cpu_rss.py                        # all presets -> bench/results/cpu_rss.md
    python bench/cpu_rss.py --only cpu_tiny --phases cpu_tiny --no-write   # where the memory goes

--phases also runs the presets it names once more in a probe process that samples its own RSS
every millisecond and marks the trainer's phases (gate/trace, build, step, validate, checkpoint, export); what it
prints is diagnostic (the real figures are the outside measurements).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
KIB, MIB, GIB = 2**10, 2**20, 2**30
PRESETS_DIR = ROOT / "config" / "presets"

# What every bench preset trains: no dropout, a few steps, validation after every step, one
# checkpoint and the export at the end, no loader workers, GPU-sized shapes allowed on the CPU.
COMMON = {"model.dropout": 0.0, "train.warmup_steps": 1, "train.validate_every": 1,
          "train.num_workers": 0, "train.allow_cpu": True}
# name -> (base preset, overrides, what it is). The last three are the shapes of issue 15's
# measurements, rebuilt from the `small` seed (n_fft 1024, hop 256, 48 channels, 4 heads) at fp32
# with segments chosen so that their cpu estimates come out near the 2.11/1.14/2.12 GiB.
PRESETS = {
    "cpu_tiny": ("cpu_tiny", {}, "the CPU tier as shipped"),
    "cpu_small": ("cpu_small", {}, "the CPU tier as shipped"),
    "cpu_small_ckpt6": ("cpu_small", {"model.n_layers": 6, "model.checkpointing": True},
                        "cpu_small, 6 layers, checkpointing"),
    "cpu_small_bf16_b4": ("cpu_small", {"train.precision": "bf16", "train.batch_size": 4},
                          "cpu_small, bf16 autocast, batch 4"),
    "issue_2x48_b2": ("small", {"model.n_layers": 2, "train.batch_size": 2, "train.precision": "fp32",
                                "audio.segment_samples": 14080, "train.validate_segments": 2},
                      "44.1 kHz, 0.32 s, n_fft 1024, 2 layers x 48, batch 2"),
    "issue_4x48_ckpt": ("small", {"model.n_layers": 4, "model.checkpointing": True, "train.precision": "fp32",
                                  "audio.segment_samples": 28160, "train.validate_segments": 2},
                        "44.1 kHz, 0.64 s, n_fft 1024, 4 layers x 48, checkpointing"),
    "issue_nfft512_acc2": ("small", {"audio.sample_rate": 8000, "audio.n_fft": 512, "audio.hop": 128,
                                     "audio.segment_samples": 12000, "model.n_layers": 5,
                                     "train.grad_accum": 2, "train.precision": "fp32",
                                     "train.validate_segments": 2},
                           "8 kHz, 1.5 s, n_fft 512, 5 layers x 48, accumulation 2"),
}
VARIANTS = {"tuned": "tuned", "default": "glibc_default"}   # bench variant -> train.host_malloc


def make_preset(name: str, steps: int) -> dict:
    from tiersep import config as C

    base, overrides, _ = PRESETS[name]
    preset = C.load_preset(base, {"presets_dir": str(PRESETS_DIR)})
    preset = copy.deepcopy(preset)
    preset["name"] = name
    for key, value in {**COMMON, "train.steps": steps, "train.checkpoint_every": steps, **overrides}.items():
        preset = C.set_field(preset, key, value)
    preset = C.validate(preset, "preset.schema.yaml", name)
    C.check_preset(preset, name)
    return preset


def prepared(work: Path, rate: int) -> Path:
    """A small prepared synthetic set at `rate` (tests/configs/tiny.yaml's: 3 s tracks), made once."""
    folder = work / "data" / str(rate)
    if not (folder / "manifest.json").is_file():
        subprocess.run([sys.executable, "-m", "tiersep.cli", "prepare", "--config",
                        str(ROOT / "tests" / "configs" / "tiny.yaml"), "--out", str(folder),
                        "--sample-rate", str(rate)], cwd=ROOT, check=True, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return folder


def train_args(preset_file: Path, data: Path, out: Path) -> list[str]:
    return ["train", "--config", str(ROOT / "tests" / "configs" / "tiny.yaml"), "--preset", str(preset_file),
            "--data", str(data), "--out", str(out)]


def train_command(preset_file: Path, data: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "tiersep.cli", *train_args(preset_file, data, out)]


def child_env(threads: int) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    return {**env, "OMP_NUM_THREADS": str(threads)}


def run_preset(name: str, work: Path, steps: int, threads: int, variants, phases: bool) -> dict:
    from tiersep.memory import cpu_process
    from tiersep.memory.estimate import estimate

    preset = make_preset(name, steps)
    files = {}
    for variant, mode in VARIANTS.items():   # one preset file per host-malloc mode
        files[variant] = work / "presets" / f"{name}.{variant}.yaml"
        files[variant].parent.mkdir(parents=True, exist_ok=True)
        files[variant].write_text(yaml.safe_dump(dict(preset, train={**preset["train"], "host_malloc": mode}),
                                                 sort_keys=False))
    data = prepared(work, preset["audio"]["sample_rate"])
    start = time.time()
    record = estimate(preset, "trace", "cpu")
    row = {"preset": name, "what": PRESETS[name][2], "live_bytes": record["peak_bytes"],
           "largest_allocation_bytes": record["largest_allocation_bytes"],
           "booking": cpu_process.booking(record, preset), "estimate_s": round(time.time() - start, 1),
           "runs": {}}
    for variant in variants:
        out = work / "runs" / variant / name
        log_path = out.parent / f"{name}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "w") as log:
            started = time.time()
            result = cpu_process.measure_peak_rss(train_command(files[variant], data, out),
                                                  env=child_env(threads), cwd=ROOT, log=log)
        if result["returncode"] != 0:
            raise RuntimeError(f"{name} ({variant}): tiersep train exited {result['returncode']}; see {log_path}")
        run = json.loads((out / "run.json").read_text())
        applied = bool((run.get("malloc") or {}).get("applied"))
        if applied != (variant == "tuned"):
            raise RuntimeError(f"{name} ({variant}): run.json malloc is {run.get('malloc')}")
        row["runs"][variant] = {**result, "wall_s": round(time.time() - started, 1),
                                "start_process_bytes": run["start_process_bytes"],
                                "steps_per_s": run["steps_per_s"]}
        if phases:
            row["runs"][variant]["phases"] = phase_profile(files[variant], data, work / "phases" / variant / name,
                                                           threads)
    return row


# ------------------------------------------------------------------------------------------------
# --phases: the probe process (diagnostic)
# ------------------------------------------------------------------------------------------------
PHASE_HOOKS = [("plan_run", "gate+trace"), ("run_gate", "gate+trace"), ("Training._build", "build"),
               ("train_step", "step"), ("Training._validate", "validate"),
               ("Training._checkpoint", "checkpoint"), ("Training._finish", "export")]


def phase_profile(preset_file: Path, data: Path, out: Path, threads: int) -> list[dict]:
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child-phases", "--",
           *train_args(preset_file, data, out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=child_env(threads), text=True, stdout=subprocess.PIPE,
                          stderr=subprocess.DEVNULL)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{preset_file.stem}: the phase probe failed ({proc.returncode})")
    return json.loads(lines[-1])["phases"]


def child_phases(argv: list[str]) -> int:
    """In the probe process: sample RSS every ms, mark phases, run the CLI, print the phases as JSON."""
    import threading

    page = os.sysconf("SC_PAGE_SIZE")
    statm = os.open("/proc/self/statm", os.O_RDONLY)
    samples, marks, done = [], [], threading.Event()

    def sampler():
        while not done.is_set():
            samples.append((time.perf_counter(), int(os.pread(statm, 64, 0).split()[1]) * page))
            time.sleep(0.001)

    def mark(label):
        marks.append((time.perf_counter(), label))

    threading.Thread(target=sampler, daemon=True).start()
    mark("python start")
    import torch  # noqa: F401

    mark("import torch")
    from tiersep import cli
    from tiersep.train import plan, trainer
    mark("imports")
    for dotted, label in PHASE_HOOKS:
        owner_name, _, attr = dotted.rpartition(".")
        owner = getattr(trainer, owner_name, None) if owner_name else trainer
        if owner is None or not callable(getattr(owner, attr, None)):
            continue   # the trainer has no such function (any more): that phase is not marked
        original = getattr(owner, attr)

        def wrapped(*args, _original=original, _label=label, **kwargs):
            mark(_label)
            try:
                return _original(*args, **kwargs)
            finally:
                mark("loop")
        setattr(owner, attr, wrapped)
    code = cli.main(argv)
    mark("end")
    done.set()
    phases = []
    for (t0, label), (t1, _) in zip(marks, marks[1:]):
        rss = [r for t, r in samples if t0 <= t <= t1]
        if rss:
            phases.append({"phase": label, "seconds": round(t1 - t0, 3), "start": rss[0], "peak": max(rss),
                           "end": rss[-1]})
    print(json.dumps({"phases": phases}))
    return code


# ------------------------------------------------------------------------------------------------
# The baseline and the machine
# ------------------------------------------------------------------------------------------------
def machine() -> dict:
    import psutil
    import torch

    model = "unknown"
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                 if line.startswith("model name")]
        model = names[0] if names else model
    libc = " ".join(platform.libc_ver())
    return {"cpu": model, "cores": os.cpu_count(), "ram_gib": round(psutil.virtual_memory().total / GIB, 1),
            "torch": torch.__version__, "python": platform.python_version(), "libc": libc,
            "host": platform.node()}


# ------------------------------------------------------------------------------------------------
# Output
# ------------------------------------------------------------------------------------------------
def table(rows: list[dict], variants) -> list[str]:
    """Per preset: the live bytes, then per malloc variant what the gate books for it (tuned: the
    booking; default: the glibc-default bound), the real peak, their ratio, and the real growth
    over the RSS at the start of the run per live byte; CPU seconds (user + system) of the run."""
    head = ["preset", "what", "live (MiB)"]
    for v in variants:
        head += [f"booking {v} (MiB)", f"real {v} (MiB)", f"booking / real {v}", f"growth / live {v}"]
    head += ["CPU s " + " / ".join(variants), "steps/s " + " / ".join(variants)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * 2 + "---:|" * (len(head) - 2)]
    for row in rows:
        cells = [row["preset"], row["what"], f"{row['live_bytes'] / MIB:.0f}"]
        for v in variants:
            run = row["runs"][v]
            booked = row["booking"][VARIANTS[v]]["rss_bytes"]
            growth = (run["peak_rss_bytes"] - run["start_process_bytes"]) / row["live_bytes"]
            cells += [f"{booked / MIB:.0f}", f"{run['peak_rss_bytes'] / MIB:.0f}",
                      f"{booked / run['peak_rss_bytes']:.3f}", f"{growth:.2f}"]
        cells.append(" / ".join(f"{row['runs'][v]['user_s'] + row['runs'][v]['system_s']:.0f}" for v in variants))
        cells.append(" / ".join(f"{row['runs'][v]['steps_per_s']:.2f}" for v in variants))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def phases_section(rows: list[dict], variants) -> list[str]:
    lines = []
    for row in rows:
        for v in variants:
            phases = row["runs"][v].get("phases")
            if not phases:
                continue
            lines += ["", f"Phases of {row['preset']} ({v} malloc), RSS in MiB:", "",
                      "| phase | seconds | start | peak | end |", "|---|---:|---:|---:|---:|"]
            lines += [f"| {p['phase']} | {p['seconds']:.2f} | {p['start'] / MIB:.0f} | {p['peak'] / MIB:.0f} | "
                      f"{p['end'] / MIB:.0f} |" for p in phases]
    return lines


def ratio_range(rows, variant: str) -> str:
    ratios = [row["booking"][VARIANTS[variant]]["rss_bytes"] / row["runs"][variant]["peak_rss_bytes"]
              for row in rows if variant in row["runs"]]
    return f"{min(ratios):.3f} to {max(ratios):.3f}" if ratios else "not run"


def write_markdown(path: Path, rows, variants, base, info, args) -> None:
    from tiersep.memory import cpu_process

    env = " ".join(f"{k}={v}" for k, v in cpu_process.malloc_env().items())
    booking = rows[0]["booking"]
    lines = [
        "# CPU fit gate: booking vs the real train process's peak RSS", "",
        f"Generated by `python bench/cpu_rss.py` on {time.strftime('%Y-%m-%d')}: {info['cpu']}, "
        f"{info['cores']} cores, {info['ram_gib']} GiB RAM, torch {info['torch']}, Python {info['python']}, "
        f"{info['libc']}. Each preset: {args.steps} steps, validation after each, one checkpoint and the "
        f"export at the end, dropout 0, 0 loader workers, OMP_NUM_THREADS={args.threads}, no estimate file "
        "(the gate traces in the train process). Presets: PRESETS in the script.", "",
        "- live: the cpu trace's peak_bytes. booking: `cpu_process.booking` in the variant's mode: "
        f"tuned = {booking['tuned']['model']}; default = {booking['glibc_default']['model']} "
        f"({cpu_process.GLIBC_DEFAULT_FACTOR_CHECKPOINTED} x with checkpointing).",
        "- real: peak RSS of the whole `tiersep train` process, exit included (os.wait4 ru_maxrss through a "
        "fresh launcher: `cpu_process.measure_peak_rss`). growth: (real - RSS at the start of the run, "
        "after the imports) / live. steps/s: run.json's, the whole run (validation after every step).",
        "- tuned: `train.host_malloc: tuned`, the trainer applies `cpu_process.configure_malloc()` (glibc "
        f"mmap threshold {cpu_process.MMAP_THRESHOLD // KIB} KiB, trim threshold "
        f"{cpu_process.TRIM_THRESHOLD // KIB} KiB; the same as `{env}`). default: `train.host_malloc: "
        "glibc_default`, glibc as it comes (what `auto` picks whenever its booking fits the budget).", "",
        *table(rows, variants), "",
        f"Booking / real, tuned: {ratio_range(rows, 'tuned')}; default: {ratio_range(rows, 'default')} "
        "(target 1.0 to 1.25).",
        "",
        f"A probe process doing a train process's preset-independent work peaks at "
        f"{base['probe_peak_bytes'] / MIB:.0f} MiB here, exit included (library pages touched by C++ destructors). "
        f"The booking measures it on the machine it runs on (`cpu_process.process_allowance`: {base['source']}): "
        "it moves with the machine and with how the page cache holds torch's libraries, and the train "
        "process's peak moves with it.",
    ]
    lines += phases_section(rows, variants)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=sorted(PRESETS), help="presets to run (default all)")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of the train processes")
    parser.add_argument("--phases", nargs="*", default=[], metavar="PRESET",
                        help="also profile RSS by trainer phase for these presets (slower)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/tiersep-cpu-rss"))
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "cpu_rss.md")
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument("--child-phases", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child_phases:
        return child_phases([a for a in args.rest if a != "--"])

    import torch

    torch.set_num_threads(args.threads)
    from tiersep.memory import cpu_process

    info, base = machine(), cpu_process.process_allowance()
    rows = []
    for name in args.only or list(PRESETS):
        rows.append(run_preset(name, args.work, args.steps, args.threads, args.variants, name in args.phases))
        print("\n".join(table(rows[-1:], args.variants)[-1:]), flush=True)
    print("\n".join(table(rows, args.variants)))
    print(f"probe process peak: {base['probe_peak_bytes'] / MIB:.0f} MiB")
    if not args.no_write:
        write_markdown(args.out, rows, args.variants, base, info, args)
        print(f"wrote {args.out}")
    (args.work / "rows.json").write_text(json.dumps({"machine": info, "baseline": base, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
