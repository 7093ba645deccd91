"""Training-loader throughput and memory: segments per second, and RSS after 10 and after N batches.

    .venv/bin/python bench/loader_throughput.py                      # default synthetic set, cpu_small
    .venv/bin/python bench/loader_throughput.py --data data/prepared/synthetic/8000 --preset cpu_small \
        --workers 2 --batches 1000 --out bench/results/loader_throughput.json

Without --data, the default config's synthetic set (8 train / 3 test tracks of 12 s, generated at
44.1 kHz) is prepared at the preset's rate in a temporary folder first (and the time that takes
and its size on disk are reported too). RSS counts the main process and its loader workers.
"""
from __future__ import annotations

import argparse
import platform
import sys
import tempfile
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from tiersep import config as C  # noqa: E402
from tiersep.io import write_json  # noqa: E402


def memory_bytes() -> tuple[int, int]:
    """(RSS, PSS) of this process and its children (the loader workers). RSS counts the pages the
    processes share (torch's libraries) once per process; PSS splits them, so it adds up."""
    rss = pss = 0
    me = psutil.Process()
    for proc in [me, *me.children(recursive=True)]:
        try:
            info = proc.memory_full_info()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        rss += info.rss
        pss += getattr(info, "pss", info.rss)
    return rss, pss


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(REPO / "config" / "config.yaml"))
    parser.add_argument("--preset", default="cpu_small", help="segment length, batch size and augmentations")
    parser.add_argument("--data", help="a prepared folder (default: prepare the config's source in a temp folder)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batches", type=int, default=1000)
    parser.add_argument("--batch-size", type=int, help="default: the preset's batch_size x grad_accum")
    parser.add_argument("--out", help="also write the results as JSON here")
    args = parser.parse_args(argv)

    cfg = C.load_config(args.config, {"presets_dir": str(REPO / "config" / "presets")})
    preset = C.load_preset(args.preset, cfg)
    rate, segment = preset["audio"]["sample_rate"], preset["audio"]["segment_samples"]
    batch_size = args.batch_size or preset["train"]["batch_size"] * preset["train"]["grad_accum"]
    result = {"preset": preset["name"], "sample_rate": rate, "segment_samples": segment,
              "batch_size": batch_size, "workers": args.workers, "batches": args.batches,
              "cpus": psutil.cpu_count(), "python": platform.python_version()}

    with tempfile.TemporaryDirectory(prefix="tiersep-bench-") as tmp:
        data_dir = Path(args.data) if args.data else None
        if data_dir is None:
            from tiersep.data.prepare import prepare
            from tiersep.data.synthetic import synthetic_root

            cfg["data"]["prepared_dir"] = str(Path(tmp) / "prepared")
            data_dir = Path(tmp) / "prepared" / cfg["data"]["source"] / str(rate)
            start = time.perf_counter()
            prepare(cfg, data_dir, rate, progress=False)
            result["prepare_seconds"] = round(time.perf_counter() - start, 2)
            result["prepared_bytes"] = folder_bytes(data_dir)
            if cfg["data"]["source"] == "synthetic":
                result["raw_bytes"] = folder_bytes(synthetic_root(cfg))
            print(f"prepared {data_dir} in {result['prepare_seconds']} s: "
                  f"{result['prepared_bytes'] / 2**20:.1f} MiB prepared, "
                  f"{result.get('raw_bytes', 0) / 2**20:.1f} MiB raw")

        from tiersep.data.dataset import SegmentDataset, make_loader

        dataset = SegmentDataset(data_dir, "train", preset["model"]["sources"], segment,
                                 preset["train"]["seed"], preset["train"]["augment"])
        loader = make_loader(dataset, batch_size, args.workers, start_step=0, stop_step=args.batches)
        start = time.perf_counter()
        rss_after, first_batch_at, started_at = {}, None, None
        for step, mixture, stems in loader:
            done = step + 1
            if done == 1:
                first_batch_at = time.perf_counter() - start
                started_at = time.perf_counter()
            if done in (10, args.batches):
                rss_after[done] = memory_bytes()
            if done % 100 == 0:
                rate_now = (done - 1) * batch_size / (time.perf_counter() - started_at)
                print(f"  batch {done}: {rate_now:.0f} segments/s, RSS {memory_bytes()[0] / 2**20:.0f} MiB", flush=True)
        seconds = time.perf_counter() - started_at
        result["first_batch_seconds"] = round(first_batch_at, 3)
        result["segments_per_second"] = round((args.batches - 1) * batch_size / seconds, 1)
        result["audio_seconds_per_second"] = round(result["segments_per_second"] * segment / rate, 1)
        result["rss_after_10_bytes"], result["pss_after_10_bytes"] = rss_after.get(10, (None, None))
        result["rss_after_last_bytes"], result["pss_after_last_bytes"] = rss_after.get(args.batches, (None, None))

    print(f"{result['segments_per_second']} segments/s ({result['audio_seconds_per_second']} s of audio per s) "
          f"with {args.workers} workers, batch {batch_size} x {segment} samples at {rate} Hz")
    if result["rss_after_10_bytes"]:
        print(f"RSS after 10 batches: {result['rss_after_10_bytes'] / 2**20:.1f} MiB; after {args.batches}: "
              f"{result['rss_after_last_bytes'] / 2**20:.1f} MiB "
              f"({(result['rss_after_last_bytes'] - result['rss_after_10_bytes']) / 2**20:+.1f} MiB); "
              f"PSS {result['pss_after_10_bytes'] / 2**20:.1f} -> {result['pss_after_last_bytes'] / 2**20:.1f} MiB")
    if args.out:
        write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
