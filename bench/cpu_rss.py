"""Does the CPU fit gate book the whole train process? Estimate vs booking vs real peak RSS.

For each preset below: the `trace` estimate on cpu (live tensor bytes), the booking of
tiersep.memory.cpu_booking (what the gate compares with the budget), and the peak RSS of a real
`tiersep train` process (a few steps, validation every step, the export at the end), measured
from outside with os.wait4 through probe.measure_peak_rss. Each preset is trained in both host-malloc
modes the booking knows: `tuned` (train.host_malloc: tuned, the trainer applies
malloc.configure_malloc()) and `default` (train.host_malloc: glibc_default, glibc as it comes,
what auto picks whenever its booking fits the budget).

    python bench/cpu_rss.py                        # all presets -> bench/results/cpu_rss.md
    python bench/cpu_rss.py --only cpu_tiny --phases cpu_tiny --no-write   # where the memory goes
    python bench/cpu_rss.py --random 24 --seed 21 --jobs 2   # drawn presets -> bench/results/cpu_rss_random.md

--random N draws N presets from issue 21's ranges instead (draw_preset; the seed reproduces the
draw), --jobs trains a preset's two malloc variants at once. The process allowance is measured
afresh first (--keep-allowance: this boot's kept one).

--rebook ROWS_JSON trains nothing: it books a kept run's presets again with the booking model as it
is now (against that run's own allowance) and writes its table again, saying so. The real peaks and
times are that run's (the json every run leaves in --work).

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
    "issue21_acc2": ("small", {"audio.segment_samples": 66150, "audio.n_fft": 512, "audio.hop": 128,
                               "model.n_layers": 2, "model.emb_dim": 32, "model.attention_dim": 32,
                               "model.n_heads": 2, "model.ffn_hidden": 64, "model.norm_groups": 2,
                               "train.batch_size": 1, "train.grad_accum": 2, "train.precision": "fp32",
                               "train.validate_segments": 2},
                     "44.1 kHz, 1.5 s, n_fft 512, 2 layers x 32, accumulation 2 (issue 21)"),
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


def run_preset(name: str, work: Path, steps: int, threads: int, variants, phases: bool, jobs: int = 1) -> dict:
    return measure_preset(name, PRESETS[name][2], make_preset(name, steps), work, threads, variants, phases, jobs)


def measure_preset(name: str, what: str, preset: dict, work: Path, threads: int, variants, phases: bool = False,
                   jobs: int = 1, record: dict | None = None) -> dict:
    """The cpu trace estimate and booking of `preset`, and the peak RSS of a real `tiersep train`
    process in each malloc variant (`jobs` of them at once)."""
    from concurrent.futures import ThreadPoolExecutor

    from tiersep import probe
    from tiersep.memory import cpu_booking
    from tiersep.memory.estimate import estimate

    files = {}
    for variant, mode in VARIANTS.items():   # one preset file per host-malloc mode
        files[variant] = work / "presets" / f"{name}.{variant}.yaml"
        files[variant].parent.mkdir(parents=True, exist_ok=True)
        files[variant].write_text(yaml.safe_dump(dict(preset, train={**preset["train"], "host_malloc": mode}),
                                                 sort_keys=False))
    data = prepared(work, preset["audio"]["sample_rate"])
    start = time.time()
    record = record or estimate(preset, "trace", "cpu")
    row = {"preset": name, "what": what, "live_bytes": record["peak_bytes"],
           "grad_accum": preset["train"]["grad_accum"], "checkpointing": preset["model"]["checkpointing"],
           "largest_allocation_bytes": record["largest_allocation_bytes"],
           "booking": cpu_booking.booking(record, preset), "estimate_s": round(time.time() - start, 1),
           "runs": {}}

    def train(variant):
        out = work / "runs" / variant / name
        log_path = out.parent / f"{name}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "w") as log:
            started = time.time()
            result = probe.measure_peak_rss(train_command(files[variant], data, out),
                                                  env=child_env(threads), cwd=ROOT, log=log)
        if result["returncode"] != 0:
            raise RuntimeError(f"{name} ({variant}): tiersep train exited {result['returncode']}; see {log_path}")
        run = json.loads((out / "run.json").read_text())
        applied = bool((run.get("malloc") or {}).get("applied"))
        if applied != (variant == "tuned"):
            raise RuntimeError(f"{name} ({variant}): run.json malloc is {run.get('malloc')}")
        measured = {**result, "wall_s": round(time.time() - started, 1),
                    "start_process_bytes": run["start_process_bytes"], "steps_per_s": run["steps_per_s"]}
        if phases:
            measured["phases"] = phase_profile(files[variant], data, work / "phases" / variant / name, threads)
        return variant, measured

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        row["runs"] = dict(pool.map(train, variants))
    return row


# ------------------------------------------------------------------------------------------------
# --random: presets nobody tuned for
# ------------------------------------------------------------------------------------------------
# The ranges of issue 21, at the sample rates of the CPU tiers (8 kHz), the synthetic set (16 kHz)
# and MUSDB18 (44.1 kHz); fp32, no dropout. A draw whose cpu trace exceeds --max-live-gib is drawn
# again (CPU-sized presets: the bench trains each one four times on two cores).
RANDOM_RATES = (8000, 16000, 44100)
RANDOM_N_FFT = (256, 512, 1024)
RANDOM_EMB = (16, 24, 32, 48, 64)


def draw_preset(rng) -> tuple[dict, str, int]:
    """One random CPU preset from `rng` (random.Random): (cpu_small with the drawn fields, what it
    is in words, its steps)."""
    from tiersep import config as C

    rate = rng.choice(RANDOM_RATES)
    seconds = rng.uniform(0.25, 2.0)
    n_fft = rng.choice(RANDOM_N_FFT)
    hop = n_fft // rng.choice((4, 2))
    emb = rng.choice(RANDOM_EMB)
    heads = rng.choice([h for h in (1, 2, 4) if (emb // h) % 2 == 0 and emb % h == 0])
    groups = rng.choice([g for g in (1, 2, 4) if emb % g == 0])
    fields = {
        "audio.sample_rate": rate, "audio.segment_samples": max(n_fft, round(seconds * rate)),
        "audio.n_fft": n_fft, "audio.hop": hop,
        "model.n_layers": rng.randint(1, 4), "model.emb_dim": emb, "model.attention_dim": emb,
        "model.n_heads": heads, "model.ffn_hidden": emb * rng.choice((2, 4)), "model.norm_groups": groups,
        "model.checkpointing": rng.random() < 0.5,
        "train.batch_size": rng.randint(1, 4), "train.grad_accum": rng.randint(1, 4),
        "train.num_workers": rng.choice((0, 2)), "train.precision": "fp32",
    }
    steps = rng.choice((2, 3))
    preset = C.load_preset("cpu_small", {"presets_dir": str(PRESETS_DIR)})
    for key, value in {**COMMON, **fields, "train.steps": steps, "train.checkpoint_every": steps,
                       "train.validate_segments": 2}.items():
        preset = C.set_field(preset, key, value)
    preset = C.validate(preset, "preset.schema.yaml", "random")
    C.check_preset(preset, "random")
    m, t = preset["model"], preset["train"]
    what = (f"{rate / 1000:g} kHz, {seconds:.2f} s, n_fft {n_fft}/{hop}, {m['n_layers']} x {emb} ({heads} h), "
            f"b{t['batch_size']} x acc{t['grad_accum']}" + (", ckpt" if m["checkpointing"] else "")
            + f", {t['num_workers']} workers, {steps} steps")
    return preset, what, steps


def draw_presets(count: int, seed: int, max_live_bytes: int, want=None) -> tuple[list, int]:
    """`count` random presets (name, preset, what, cpu trace record) from `seed`, each traced; those
    whose live bytes exceed `max_live_bytes`, or that `want(preset)` refuses, are drawn again.
    Returns them and how many draws were refused."""
    import random

    from tiersep.memory.estimate import estimate

    rng, out, refused = random.Random(seed), [], 0
    while len(out) < count:
        preset, what, _ = draw_preset(rng)
        if want is not None and not want(preset):
            refused += 1
            continue
        preset["name"] = name = f"r{seed}_{len(out) + 1:02d}"
        record = estimate(preset, "trace", "cpu")
        if record["peak_bytes"] > max_live_bytes:
            refused += 1
            continue
        out.append((name, preset, what, record))
    return out, refused


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
    from tiersep import malloc, probe
    from tiersep.memory import cpu_booking

    env = " ".join(f"{k}={v}" for k, v in malloc.malloc_env().items())
    booking = rows[0]["booking"]
    lines = [
        "# CPU fit gate: booking vs the real train process's peak RSS", "",
        f"Generated by `python bench/cpu_rss.py` on {time.strftime('%Y-%m-%d')}: {info['cpu']}, "
        f"{info['cores']} cores, {info['ram_gib']} GiB RAM, torch {info['torch']}, Python {info['python']}, "
        f"{info['libc']}. Each preset: {args.steps} steps, validation after each, one checkpoint and the "
        f"export at the end, dropout 0, 0 loader workers, OMP_NUM_THREADS={args.threads}, no estimate file "
        "(the gate traces in the train process), the process allowance measured afresh first. Presets: "
        "PRESETS in the script.", "",
        "- live: the cpu trace's peak_bytes. booking: `cpu_booking.booking` in the variant's mode: "
        f"tuned = {booking['tuned']['model']}; default = {booking['glibc_default']['model']} "
        "(with checkpointing too: the trainer trims its heap around each block, `malloc.trimmed_heap`; "
        "and it gives its heap back before exit, `malloc.release_heap`, so the exit pages count once).",
        "- real: peak RSS of the whole `tiersep train` process, exit included (os.wait4 ru_maxrss through a "
        "fresh launcher: `probe.measure_peak_rss`). growth: (real - RSS at the start of the run, "
        "after the imports) / live. steps/s: run.json's, the whole run (validation after every step).",
        "- tuned: `train.host_malloc: tuned`, the trainer applies `malloc.configure_malloc()` (glibc "
        f"mmap threshold {malloc.MMAP_THRESHOLD // KIB} KiB, trim threshold "
        f"{malloc.TRIM_THRESHOLD // KIB} KiB; the same as `{env}`). default: `train.host_malloc: "
        "glibc_default`, glibc as it comes (what `auto` picks whenever its booking fits the budget).", "",
        *table(rows, variants), "",
        f"Booking / real, tuned: {ratio_range(rows, 'tuned')}; default: {ratio_range(rows, 'default')} "
        "(target 1.0 to 1.25).",
        "",
        f"A probe process doing a train process's preset-independent work peaks at "
        f"{base['probe_peak_bytes'] / MIB:.0f} MiB here, exit included (library pages touched by C++ destructors). "
        f"The booking measures it on the machine it runs on (`cpu_booking.process_allowance`: {base['source']}): "
        "it moves with the machine and with how the page cache holds torch's libraries, and the train "
        "process's peak moves with it.",
    ]
    lines += phases_section(rows, variants)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


def kinds(rows) -> list[tuple[str, list]]:
    return [("accumulation 2-4, no checkpointing", [r for r in rows if r["grad_accum"] > 1 and not r["checkpointing"]]),
            ("no accumulation, no checkpointing", [r for r in rows if r["grad_accum"] == 1 and not r["checkpointing"]]),
            ("checkpointing", [r for r in rows if r["checkpointing"]])]


def growth_range(rows, variant: str) -> str:
    """(real peak - the booking's allowance less its exit pages) / live bytes: the factor the booking
    needed (the exit pages count once, in the floor: cpu_booking.booking)."""
    g = [(r["runs"][variant]["peak_rss_bytes"] - r["booking"]["process_bytes"] + r["booking"]["exit_pages_bytes"])
         / r["live_bytes"] for r in rows]
    return f"{min(g):.2f}-{max(g):.2f}"


def write_random_markdown(path: Path, rows, variants, base, info, args, refused: int, seconds: float) -> None:
    from tiersep import malloc, probe
    from tiersep.memory import cpu_booking

    booking = rows[0]["booking"]
    lines = [
        "# CPU fit gate on random presets: booking vs the real train process's peak RSS", "",
        f"Generated by `python bench/cpu_rss.py --random {args.random} --seed {args.seed} --max-live-gib "
        f"{args.max_live_gib:g} --jobs {args.jobs}` on {time.strftime('%Y-%m-%d')}: {info['cpu']}, "
        f"{info['cores']} cores (shared with other jobs), {info['ram_gib']} GiB RAM, torch {info['torch']}, "
        f"Python {info['python']}, {info['libc']}, OMP_NUM_THREADS={args.threads}. It took "
        f"{seconds / 60:.0f} minutes ({args.jobs} train processes at a time).", "",
        "Presets drawn from issue 21's ranges with `random.Random(seed)` (`draw_preset`): cpu_small with "
        f"a sample rate of {', '.join(f'{r / 1000:g}' for r in RANDOM_RATES)} kHz, segments 0.25-2 s, n_fft "
        f"{'/'.join(map(str, RANDOM_N_FFT))}, hop n_fft/4 or n_fft/2, 1-4 layers, emb "
        f"{'/'.join(map(str, RANDOM_EMB))} (attention = emb, ffn 2 or 4 x emb, 1/2/4 heads and norm groups "
        "that divide it), micro-batch 1-4, accumulation 1-4, checkpointing on or off, 0 or 2 loader "
        "workers, 2 or 3 steps; fp32, dropout 0, validation (2 segments) after every step, one "
        "checkpoint and the export at the end; the process allowance measured afresh first. "
        f"{refused} draws whose cpu trace exceeded "
        f"{args.max_live_gib:g} GiB of live tensors were drawn again (CPU-sized presets).", "",
        "- live: the cpu trace's peak_bytes. booking: `cpu_booking.booking` in the variant's mode: tuned = "
        f"{booking['tuned']['model']}; default = {booking['glibc_default']['model']} "
        "(with checkpointing too: the trainer trims its heap around each block, `malloc.trimmed_heap`; "
        "and it gives its heap back before exit, `malloc.release_heap`, so the exit pages count once).",
        "- real: peak RSS of the whole `tiersep train` process (its loader workers included), exit included "
        "(`probe.measure_peak_rss`). growth: (real - RSS at the start of the run) / live.", "",
        *table(rows, variants), "",
        f"Booking / real, tuned: {ratio_range(rows, 'tuned')}; default: {ratio_range(rows, 'default')} "
        "(target 1.00 to 1.25). By kind (tuned; default):", "",
        *[f"- {label} ({len(chosen)}): {ratio_range(chosen, 'tuned')}; {ratio_range(chosen, 'default')}, "
          f"the default's peak {growth_range(chosen, 'default')} x live above the allowance less its exit pages"
          for label, chosen in kinds(rows) if chosen], "",
        f"The probe process (`cpu_booking.process_allowance`) peaked at {base['probe_peak_bytes'] / MIB:.0f} MiB "
        f"here ({base['source']}).",
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=sorted(PRESETS), help="presets to run (default all)")
    parser.add_argument("--random", type=int, metavar="N", help="N random presets instead (see --seed)")
    parser.add_argument("--seed", type=int, default=21, help="of --random's draw")
    parser.add_argument("--max-live-gib", type=float, default=2.0,
                        help="--random draws again a preset whose cpu trace exceeds this")
    parser.add_argument("--jobs", type=int, default=1, help="train processes at a time (each preset's variants)")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of the train processes")
    parser.add_argument("--phases", nargs="*", default=[], metavar="PRESET",
                        help="also profile RSS by trainer phase for these presets (slower)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/tiersep-cpu-rss"))
    parser.add_argument("--out", type=Path, help="default bench/results/cpu_rss.md (cpu_rss_random.md with --random)")
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument("--keep-allowance", action="store_true",
                        help="use this boot's kept process allowance instead of measuring it again first")
    parser.add_argument("--rebook", type=Path, metavar="ROWS_JSON",
                        help="book a kept run's presets again with the current model; trains nothing")
    parser.add_argument("--child-phases", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child_phases:
        return child_phases([a for a in args.rest if a != "--"])

    import torch

    torch.set_num_threads(args.threads)
    from tiersep.memory import cpu_booking

    if args.rebook:
        return rebook(args)
    started = time.time()
    if not args.keep_allowance:   # measured now, in the page-cache state the runs will see
        cache = cpu_booking.allowance_cache_file()
        if cache is not None:
            cache.unlink(missing_ok=True)
        cpu_booking.process_allowance.cache_clear()
    info, base = machine(), cpu_booking.process_allowance()
    rows = []
    if args.random:
        drawn, refused = draw_presets(args.random, args.seed, int(args.max_live_gib * GIB))
        for name, preset, what, record in drawn:
            rows.append(measure_preset(name, what, preset, args.work, args.threads, args.variants,
                                       name in args.phases, args.jobs, record))
            print("\n".join(table(rows[-1:], args.variants)[-1:]), flush=True)
    else:
        for name in args.only or list(PRESETS):
            rows.append(run_preset(name, args.work, args.steps, args.threads, args.variants, name in args.phases,
                                   args.jobs))
            print("\n".join(table(rows[-1:], args.variants)[-1:]), flush=True)
    seconds = time.time() - started
    print("\n".join(table(rows, args.variants)))
    print("booking / real: " + "; ".join(f"{v} {ratio_range(rows, v)}" for v in args.variants)
          + f"; {seconds / 60:.1f} minutes")
    print(f"probe process peak: {base['probe_peak_bytes'] / MIB:.0f} MiB")
    if not args.no_write:
        out = args.out or ROOT / "bench" / "results" / ("cpu_rss_random.md" if args.random else "cpu_rss.md")
        if args.random:
            write_random_markdown(out, rows, args.variants, base, info, args, refused, seconds)
        else:
            write_markdown(out, rows, args.variants, base, info, args)
        print(f"wrote {out}")
    args.work.mkdir(parents=True, exist_ok=True)
    (args.work / ("rows_random.json" if args.random else "rows.json")).write_text(
        json.dumps({"machine": info, "baseline": base, "rows": rows, "seconds": seconds,
                    "refused": refused if args.random else 0, "date": time.strftime("%Y-%m-%d")}, indent=1))
    return 0


def rebook(args) -> int:
    """--rebook: the kept run's rows booked again by cpu_booking.booking as it is now, against the
    allowance that run measured, and its table written again (saying so)."""
    from tiersep.memory import cpu_booking

    kept = json.loads(args.rebook.read_text())
    base = kept["baseline"]
    for row in kept["rows"]:   # against that run's allowance, not one measured now
        preset = {"model": {"checkpointing": row["checkpointing"]}, "train": {"host_malloc": "auto"}}
        row["booking"] = cpu_booking.booking({"peak_bytes": row["live_bytes"]}, preset, base)
    rows = kept["rows"]
    refused = kept.get("refused")
    if args.random and refused is None:                    # runs from before the json kept it
        refused = draw_presets(args.random, args.seed, int(args.max_live_gib * GIB))[1]
    print("\n".join(table(rows, args.variants)))
    print("booking / real: " + "; ".join(f"{v} {ratio_range(rows, v)}" for v in args.variants))
    note = (f"Booked again on {time.strftime('%Y-%m-%d')} with the booking model of this commit "
            f"(`--rebook {args.rebook.name}`) from the measurements of the run of {kept.get('date', 'the same day')}: "
            "real peaks, times and the allowance are that run's.")
    if not args.no_write:
        out = args.out or ROOT / "bench" / "results" / ("cpu_rss_random.md" if args.random else "cpu_rss.md")
        if args.random:
            write_random_markdown(out, rows, args.variants, base, kept["machine"], args, refused, kept["seconds"])
        else:
            write_markdown(out, rows, args.variants, base, kept["machine"], args)
        text = out.read_text().split("\n")
        out.write_text("\n".join([*text[:2], note, "", *text[2:]]))
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
