"""`tiersep separate` on CPU: real-time factor, estimated vs measured peak, the chunk chosen for
three budgets, and whether a long song costs more memory than a short one.

For each tier (cpu_tiny, cpu_small, trained a few steps: memory and speed do not depend on the
weights) and each song length (1, 3, 10 minutes of the synthetic generator's music, 44.1 kHz stereo
16-bit wav, resampled to the tier's 8 kHz and back by separate), `tiersep separate` runs as its own
process under three budgets:
- tight: just above the booking of the shortest chunk (1 s, batch 1);
- mid: halfway between the bookings of the shortest and the longest chunk (10 s) at batch 1;
- auto: the available RAM (the longest chunk and the largest batch).
Its whole-life peak RSS (exit included) is measured from outside (os.wait4 through
tiersep.probe.measure_peak_rss); the chunk, batch, booking and real-time factor come from its sidecar.

    python bench/separate.py                       # -> bench/results/separate_cpu.md
    python bench/separate.py --minutes 1 --tiers cpu_tiny --no-write
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
GIB, MIB = 2**30, 2**20
SONG_RATE = 44100
TRAIN_STEPS = 3
DEMUCS_CPU_RTF = 1.5     # demucs on a CPU: about 1.5x the track's duration (its README)


def make_song(path: Path, minutes: float) -> None:
    """A song of the synthetic generator (its own process: the bench stays small)."""
    code = (
        "import sys, numpy as np, soundfile as sf\n"
        "from tiersep.data import synthetic\n"
        f"s = {{'seed': 7, 'sample_rate': {SONG_RATE}, 'train_tracks': 1, 'valid_tracks': 0, 'test_tracks': 0,"
        f" 'track_seconds': {minutes * 60}}}\n"
        "stems, _ = synthetic.synth_entry(s, {'index': 0})\n"
        "mix = sum(stems[k] for k in synthetic.STEMS)\n"
        "sf.write(sys.argv[1], np.clip(mix, -1, 1), s['sample_rate'], subtype='PCM_16')\n")
    subprocess.run([sys.executable, "-c", code, str(path)], check=True)


def prepare_models(work: Path, tiers: list[str]) -> dict:
    """Each tier trained TRAIN_STEPS steps on a tiny synthetic set; returns the config path and models."""
    config = work / "config.yaml"
    config.write_text(yaml.safe_dump({
        "data": {"source": "synthetic", "prepared_dir": str(work / "data"),
                 "synthetic": {"seed": 0, "sample_rate": 16000, "train_tracks": 3, "valid_tracks": 1,
                               "test_tracks": 1, "track_seconds": 4}},
        "tiers": tiers, "estimate_tiers": []}))
    data = work / "data" / "synthetic" / "8000"
    tiersep = str(Path(sys.executable).parent / "tiersep")
    if not (data / "manifest.json").is_file():
        subprocess.run([tiersep, "prepare", "--config", str(config), "--out", str(data), "--sample-rate", "8000"],
                       check=True, cwd=ROOT)
    models = {}
    for tier in tiers:
        out = work / "train" / tier
        if not (out / "model.pt").is_file():
            subprocess.run([tiersep, "train", "--config", str(config), "--preset", tier, "--data", str(data),
                            "--out", str(out), "--set", f"train.steps={TRAIN_STEPS}", "--set", "train.checkpoint_every=3",
                            "--set", "train.validate_every=3", "--set", "train.validate_segments=1"],
                           check=True, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        models[tier] = out / "model.pt"
    return {"config": config, "models": models}


def budgets(tier: str) -> dict[str, float | None]:
    """tight, mid (GiB) from the plan's own bookings (see module docstring), and auto (None)."""
    import torch

    from tiersep import config as C
    from tiersep.memory import GateSettings
    from tiersep.separate.plan import SeparationRequest, estimate_for

    preset, cpu = C.load_preset(tier), torch.device("cpu")
    rate = preset["audio"]["sample_rate"]
    common = (SeparationRequest(max_chunk=10 * rate, min_chunk=rate, max_batch=1, overlap=0.25, shifts=1,
                                longest_samples=10**12, rate_ratio=SONG_RATE / rate), GateSettings(0.08, "auto"))
    shortest = estimate_for(preset, cpu, rate, 1, None, *common)["gate_required_bytes"]
    longest = estimate_for(preset, cpu, 10 * rate, 1, None, *common)["gate_required_bytes"]
    return {"tight": shortest * 1.002 / 0.92 / GIB, "mid": (shortest + longest) / 2 / 0.92 / GIB, "auto": None}


def separate(setup: dict, tier: str, song: Path, out: Path, budget: float | None) -> dict:
    from tiersep.probe import measure_peak_rss

    cmd = [str(Path(sys.executable).parent / "tiersep"), "separate", "--config", str(setup["config"]),
           "--model", str(setup["models"][tier]), str(song), "--out", str(out)]
    if budget is not None:
        cmd += ["--budget", f"{budget:.6f}"]
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(str(out) + ".log", "w") as log:
        measured = measure_peak_rss(cmd, cwd=ROOT, log=log, timeout=3600)
    if measured["returncode"] != 0:
        raise SystemExit(f"separate failed ({measured['returncode']}): see {out}.log")
    record = json.loads((out / song.stem / "separate.json").read_text())
    memory = record["memory"]
    return {"tier": tier, "minutes": record["seconds"] / 60, "budget": "auto" if budget is None else None,
            "budget_gib": memory["budget_bytes"] / GIB, "chunk_s": record["chunk_seconds"], "batch": record["batch"],
            "booked_mib": memory["booked_bytes"] / MIB, "live_mib": memory["predicted_peak_bytes"] / MIB,
            "peak_mib": measured["peak_rss_bytes"] / MIB, "rtf": record["real_time_factor"],
            "malloc": (memory.get("malloc") or {}).get("mode", "?"),
            "within": measured["peak_rss_bytes"] <= memory["budget_bytes"]}


def table(rows: list[dict]) -> str:
    lines = ["| tier | song (min) | budget | budget (GiB) | chunk (s) x batch | malloc | live (MiB) | booked (MiB) | "
             "measured peak (MiB) | booked / measured | within budget | real-time factor | load |",
             "|---|---:|---|---:|---:|---|---:|---:|---:|---:|---|---:|---:|"]
    for r in rows:
        load = f"{r['load']:.1f}" if "load" in r else "-"
        lines.append(f"| {r['tier']} | {r['minutes']:.0f} | {r['budget']} | {r['budget_gib']:.3f} | "
                     f"{r['chunk_s']:.2f} x {r['batch']} | {r['malloc']} | {r['live_mib']:.0f} | {r['booked_mib']:.0f} | "
                     f"{r['peak_mib']:.0f} | {r['booked_mib'] / r['peak_mib']:.3f} | "
                     f"{'yes' if r['within'] else 'NO'} | {r['rtf']:.3f} | {load} |")
    return "\n".join(lines)


def growth(rows: list[dict]) -> list[str]:
    out = []
    for tier in sorted({r["tier"] for r in rows}):
        for budget in ("tight", "mid", "auto"):
            peaks = {round(r["minutes"]): r["peak_mib"] for r in rows if r["tier"] == tier and r["budget"] == budget}
            if 1 in peaks and 10 in peaks:
                out.append(f"{tier}, {budget} budget: {peaks[1]:.0f} MiB (1 min) -> {peaks[10]:.0f} MiB (10 min), "
                           f"{100 * (peaks[10] / peaks[1] - 1):+.1f}%")
    return out


def speed_by_malloc(rows: list[dict]) -> list[str]:
    """Median real-time factor per tier and malloc mode (the tuned mode trades speed for memory)."""
    import statistics

    out = []
    for tier in sorted({r["tier"] for r in rows}):
        parts = [f"{mode} {statistics.median(r['rtf'] for r in rows if r['tier'] == tier and r['malloc'] == mode):.3f}"
                 for mode in ("glibc_default", "tuned") if any(r["tier"] == tier and r["malloc"] == mode for r in rows)]
        out.append(f"{tier}: {', '.join(parts)}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiers", nargs="+", default=["cpu_tiny", "cpu_small"])
    parser.add_argument("--minutes", nargs="+", type=float, default=[1, 3, 10])
    parser.add_argument("--budgets", nargs="+", choices=["tight", "mid", "auto"], default=["tight", "mid", "auto"])
    parser.add_argument("--work", default="/tmp/tiersep-bench-separate", help="models, songs and outputs")
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--render-only", action="store_true", help="rewrite the results from WORK/rows.json")
    args = parser.parse_args()
    work = Path(args.work)
    if args.render_only:
        saved = json.loads((work / "rows.json").read_text())
        return report(saved["rows"], saved["load"], args.no_write)
    (work / "songs").mkdir(parents=True, exist_ok=True)
    setup = prepare_models(work, args.tiers)
    songs = {}
    for minutes in args.minutes:
        songs[minutes] = work / "songs" / f"song_{minutes:g}min.wav"
        if not songs[minutes].is_file():
            make_song(songs[minutes], minutes)
    load = os.getloadavg()
    rows = []
    for tier in args.tiers:
        for name, budget in budgets(tier).items():
            if name not in args.budgets:
                continue
            for minutes, song in songs.items():
                out = work / "out" / f"{tier}-{name}-{minutes:g}"
                if out.exists():
                    subprocess.run(["rm", "-rf", str(out)], check=True)
                row = separate(setup, tier, song, out, budget)
                row["budget"], row["load"] = name, os.getloadavg()[0]
                rows.append(row)
                print(table([row]).splitlines()[-1], flush=True)
                (work / "rows.json").write_text(json.dumps({"rows": rows, "load": load}))
    report(rows, load, args.no_write)


def report(rows: list[dict], load: list, no_write: bool) -> None:
    import torch

    from tiersep.memory.cpu_booking import process_allowance

    small = [r["rtf"] for r in rows if r["tier"] == "cpu_small" and r["budget"] == "auto"]
    text = "\n".join([
        "# `tiersep separate` on CPU: memory and speed",
        "",
        f"Generated by `python bench/separate.py` on {dt.date.today()}: {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores (load average {load[0]:.1f} at the start: the machine was shared), torch "
        f"{torch.__version__}, Python {platform.python_version()}, torch's default threads. Tiers trained "
        f"{TRAIN_STEPS} steps; songs: the synthetic generator's music, 44.1 kHz stereo 16-bit wav (resampled to "
        "8 kHz and back by separate), written as 16-bit wav stems (4 per song).",
        "",
        "- budget: tight = just above the booking of the shortest chunk (1 s, batch 1) + the 8% margin; mid = halfway "
        "between the bookings of a 1 s and a 10 s chunk; auto = the available RAM.",
        "- live: the inference trace's peak of live tensor bytes for the chosen chunk and batch. booked: what the plan "
        f"books against the budget (process allowance {process_allowance()['process_bytes'] / MIB:.0f} MiB, measured "
        "by the CPU gate's probe, + live x the factor of the malloc mode + the stream's buffers). malloc: the CPU "
        "gate's mode the plan chose and the process applied: glibc_default (1.8 x live) when its booking fits the "
        "budget, else tuned (a 64 KiB mmap threshold, 1.1 x live).",
        "- measured peak: the `tiersep separate` process's whole-life peak RSS, exit included (os.wait4).",
        "- real-time factor: wall time of the song / its duration (the sidecar's; lower is faster). load: the "
        "1-minute load average at the end of the run (2 cores: above 2, other work shared them).",
        "",
        table(rows),
        "",
        f"Measured peak within the budget: {sum(r['within'] for r in rows)} of {len(rows)} runs.",
        "",
        "Peak growth from a 1-minute to a 10-minute song (target: under 10%):",
        "",
        *[f"- {line}" for line in growth(rows)],
        "",
        "Median real-time factor by malloc mode (the tight and mid budgets chose the tuned mode, whose page "
        "faults cost time; the machine was shared, so single figures vary by 2-3x):",
        "",
        *[f"- {line}" for line in speed_by_malloc(rows)],
        "",
        f"cpu_small's real-time factor with the auto budget: {min(small):.3f}-{max(small):.3f} here, beside "
        f"demucs's published CPU figure of about {DEMUCS_CPU_RTF} (its README: a CPU takes about 1.5x the "
        "track's duration). Not a like-for-like comparison: cpu_small is an 8 kHz, 2-layer x 24 model made to "
        "train on a laptop, HT Demucs a 44.1 kHz model of about 42 M parameters." if small else "",
        ""])
    print(text)
    if not no_write:
        (ROOT / "bench" / "results" / "separate_cpu.md").write_text(text)


if __name__ == "__main__":
    main()
