"""Benchmark of evaluation: (1) memory of separating a short and a long track, (2) museval wall time
scoring tracks serially vs in parallel processes.

    .venv/bin/python bench/eval_memory.py                      # both parts, defaults below
    .venv/bin/python bench/eval_memory.py --skip-museval --durations 30 300

(1) Each duration runs in its own subprocess: a randomly initialised model of --preset separates
random noise of that length with the config's evaluate.chunk_seconds/overlap. Reported per run:
- peak live tensor bytes of the separation, counted by tiersep.memory.trace.tracker.StorageTracker (a TorchDispatchMode: each new storage adds
  its bytes, a finalizer subtracts them when freed), split into the buffers whose last axis is the
  track (output accumulator and summed window: they ARE the result, O(length) by nature) and the
  working memory (chunk input, model activations, chunk output: must not depend on the length);
- the peak RSS increase of the process during the separation (psutil sampling + ru_maxrss).
On a GPU only the working memory lives on the device (the accumulator stays on the CPU).

(2) The same synthetic tracks scored by museval via tiersep.evaluate.scoring.score_tracks, each
configuration in a fresh process: workers=1 in process with the default BLAS threads, the same with
one BLAS thread, and workers=N (spawned processes, one BLAS thread each, as `tiersep evaluate` runs).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------
# (1) memory, in a child process per duration
# ---------------------------------------------------------------------------------------------
def child_separate(args) -> None:
    import numpy as np
    import psutil
    import torch

    from tiersep.config import load_config, load_preset
    from tiersep.separate.overlap_add import separate_track as separate
    from tiersep.memory.trace.tracker import StorageTracker
    from tiersep.model import build_model

    torch.set_num_threads(args.threads)
    cfg = load_config(args.config)
    preset = load_preset(args.preset, cfg)
    rate, channels = preset["audio"]["sample_rate"], preset["audio"]["channels"]
    chunk = int(round(cfg["evaluate"]["chunk_seconds"] * rate))
    length = int(args.child_seconds * rate)
    torch.manual_seed(0)
    model = build_model(preset).eval()
    mixture = torch.from_numpy(np.random.default_rng(0).standard_normal((channels, length), dtype=np.float32) * 0.1)

    process = psutil.Process()
    rss_before = process.memory_info().rss
    maxrss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    sampled = {"peak": rss_before, "running": True}

    def sample():
        while sampled["running"]:
            sampled["peak"] = max(sampled["peak"], process.memory_info().rss)
            time.sleep(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    tracker = StorageTracker(block_bytes=lambda nbytes: nbytes)  # exact sizes, no allocator rounding
    made_before = set(tracker.register([mixture, *model.parameters(), *model.buffers()]))
    began = time.perf_counter()
    with tracker:
        out = separate(model, mixture, chunk, cfg["evaluate"]["overlap"], preset["train"]["precision"], "cpu")
    seconds = time.perf_counter() - began
    tracker.stop()
    # Storages whose last axis is the whole track (the output accumulator) apart from the working set.
    whole_track = {key for key, a in tracker.timeline.allocations.items() if a.shape and a.shape[-1] == length}
    peak_total, _ = tracker.timeline.replay(exclude=made_before)
    peak_work, _ = tracker.timeline.replay(exclude=made_before | whole_track)
    sampled["running"] = False
    sampler.join()
    maxrss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    peak_rss = max(sampled["peak"], maxrss_after if maxrss_after > maxrss_before else 0)
    print(json.dumps({
        "seconds_audio": args.child_seconds, "samples": length, "chunk_samples": chunk,
        "peak_working_bytes": peak_work, "peak_live_bytes": peak_total,
        "output_bytes": out.numel() * out.element_size(),
        "peak_rss_increase_bytes": peak_rss - rss_before, "wall_seconds": seconds,
    }))


def run_memory(args) -> list[dict]:
    rows = []
    for seconds in args.durations:
        cmd = [sys.executable, __file__, "--child-seconds", str(seconds), "--preset", args.preset,
               "--config", args.config, "--threads", str(args.threads)]
        proc = subprocess.run(cmd, cwd=REPO, text=True, capture_output=True)
        if proc.returncode != 0:
            sys.exit(f"child for {seconds} s failed:\n{proc.stderr[-3000:]}")
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    mib = 2**20
    print(f"\n(1) separation memory: preset {args.preset}, random weights, "
          f"{rows[0]['chunk_samples']}-sample chunks, {args.threads} torch thread(s), CPU")
    print(f"  {'track':>7} {'working peak':>13} {'all live peak':>14} {'output buffer':>14} "
          f"{'RSS increase':>13} {'wall':>7}")
    for r in rows:
        print(f"  {r['seconds_audio']:>6g}s {r['peak_working_bytes'] / mib:>10.1f} MiB "
              f"{r['peak_live_bytes'] / mib:>10.1f} MiB {r['output_bytes'] / mib:>10.1f} MiB "
              f"{r['peak_rss_increase_bytes'] / mib:>9.1f} MiB {r['wall_seconds']:>6.1f}s")
    first, last = rows[0], rows[-1]
    print(f"  ratio {last['seconds_audio']:g}s / {first['seconds_audio']:g}s: working memory "
          f"{last['peak_working_bytes'] / first['peak_working_bytes']:.3f}, all live tensors "
          f"{last['peak_live_bytes'] / first['peak_live_bytes']:.3f}, RSS increase "
          f"{last['peak_rss_increase_bytes'] / max(first['peak_rss_increase_bytes'], 1):.3f} "
          f"(track length x{last['samples'] / first['samples']:.0f})")
    return rows


# ---------------------------------------------------------------------------------------------
# (2) museval serial vs parallel, each configuration in a fresh process
# ---------------------------------------------------------------------------------------------
def child_museval(args) -> None:
    import numpy as np

    from tiersep.evaluate.scoring import TrackTask, score_tracks

    sources = ["vocals", "drums", "bass", "other"]
    rng = np.random.default_rng(0)
    length = int(args.museval_seconds * args.museval_rate)
    tasks = []
    for k in range(args.museval_tracks):
        refs = (0.1 * rng.standard_normal((4, 2, length))).astype(np.float32)
        ests = (refs + 0.05 * rng.standard_normal(refs.shape)).astype(np.float32)
        tasks.append(TrackTask(f"track{k}", ests, refs, refs.sum(0), sources, args.museval_rate))
    def cpu_seconds():
        own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime

    cpu_before, began = cpu_seconds(), time.perf_counter()
    results = score_tracks(tasks, args.child_museval_workers)   # workers are joined: their CPU counts
    seconds = time.perf_counter() - began
    assert all(r["error"] is None for r in results)
    print(json.dumps({"seconds": seconds, "cpu_seconds": cpu_seconds() - cpu_before, "load": os.getloadavg()[0]}))


def run_museval(args) -> dict:
    from tiersep.evaluate.scoring import BLAS_THREAD_VARIABLES, available_cores

    configurations = [
        ("serial, in process, default BLAS threads", 1, {}),
        ("serial, in process, 1 BLAS thread", 1, dict.fromkeys(BLAS_THREAD_VARIABLES, "1")),
        (f"parallel, {args.workers} spawned workers x 1 BLAS thread", args.workers, {}),
    ]
    timings = {}
    for label, workers, env in configurations:
        cmd = [sys.executable, __file__, "--child-museval-workers", str(workers),
               "--museval-tracks", str(args.museval_tracks), "--museval-seconds", str(args.museval_seconds),
               "--museval-rate", str(args.museval_rate)]
        clean = {k: v for k, v in os.environ.items() if k not in BLAS_THREAD_VARIABLES}
        proc = subprocess.run(cmd, cwd=REPO, text=True, capture_output=True, env={**clean, **env})
        if proc.returncode != 0:
            sys.exit(f"museval child ({label}) failed:\n{proc.stderr[-3000:]}")
        timings[label] = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"\n(2) museval BSSEval v4 wall time, {args.museval_tracks} tracks x {args.museval_seconds:g} s, "
          f"4 stereo stems at {args.museval_rate} Hz, {available_cores()} cores")
    serial = timings[configurations[0][0]]["seconds"]
    for label, result in timings.items():
        print(f"  {label:<45} wall {result['seconds']:6.1f} s ({result['seconds'] / args.museval_tracks:5.1f} s/track, "
              f"x{serial / result['seconds']:.2f} vs first), CPU {result['cpu_seconds']:6.1f} s; "
              f"load average {result['load']:.1f}")
    return timings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(REPO / "config" / "config.yaml"))
    parser.add_argument("--preset", default="cpu_tiny", help="model separated with (random weights)")
    parser.add_argument("--durations", type=float, nargs="+", default=[30, 300], help="track seconds")
    parser.add_argument("--threads", type=int, default=1, help="torch threads in the memory children")
    parser.add_argument("--museval-tracks", type=int, default=4)
    parser.add_argument("--museval-seconds", type=float, default=6.0)
    parser.add_argument("--museval-rate", type=int, default=44100)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--skip-museval", action="store_true")
    parser.add_argument("--child-seconds", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--child-museval-workers", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.chdir(REPO)  # presets_dir and schemas are relative to the repository
    if args.child_seconds is not None:
        child_separate(args)
        return
    if args.child_museval_workers is not None:
        child_museval(args)
        return
    if not args.skip_memory:
        run_memory(args)
    if not args.skip_museval:
        run_museval(args)


if __name__ == "__main__":
    main()
