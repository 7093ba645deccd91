"""museval scoring of separated tracks, serial or in a pool of processes, and their aggregation.

museval costs about 1 s of CPU per second of audio (a 4096 x 4096 solve per track for 4 stereo
stems plus FFT projections), so tracks are scored in parallel processes. This module imports only
numpy and museval (no torch) to keep each worker small; workers are spawned (never forked from a
process running torch threads) with single-threaded BLAS so that N workers use N cores.

Aggregation has one path, museval's own: every per-frame value is stored as museval's TrackStore
stores it (quantised to 1e-5, inf as NaN) and museval's EvalStore takes the median over a track's
frames, then over tracks, skipping NaN. The mixture baseline and the whole-track SI-SDR go through
the same EvalStore as extra metrics, so every median in scores.json is computed the same way.
"""
from __future__ import annotations

import contextlib
import math
import os
import sys
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np

from tiersep.evaluate import metrics

BLAS_THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


@dataclass
class TrackTask:
    """One separated track to score: arrays [n, C, S] in the order of `sources`."""
    name: str
    estimates: np.ndarray
    references: np.ndarray
    mixture: np.ndarray          # [C, S], the baseline estimate for every source
    sources: list[str]
    rate: int


def score_track(task: TrackTask) -> dict:
    """museval BSSEval v4 (1 s windows and hops) of the estimates, and the fast exact SDR of the
    mixture-as-estimate baseline. Returns {"name", "museval_json" (museval's TrackStore scores
    dict, or None when museval refused the track), "error" (why, or None),
    "sdr_mixture_frames" [n, frames]}."""
    import museval

    win = hop = int(1.0 * task.rate)
    # The baseline's SDR is the v4 per-frame formula (equal to museval to ~1e-15 dB), so it needs
    # no second full BSSEval run; silent frames are NaN exactly as museval marks them.
    mixture_as_estimates = np.broadcast_to(task.mixture, task.references.shape)
    result = {"name": task.name, "museval_json": None, "error": None,
              "sdr_mixture_frames": metrics.framewise_sdr(mixture_as_estimates, task.references, win, hop)}
    try:
        sdr, isr, sir, sar = museval.evaluate(
            np.moveaxis(task.references, 1, 2),    # museval wants [n, S, C]
            np.moveaxis(task.estimates, 1, 2),
            win=win, hop=hop, mode="v4",
        )
    except ValueError as err:
        # museval refuses a track where a whole reference or estimate is silent.
        result["error"] = f"museval refused the track: {str(err).splitlines()[0]}"
        return result
    store = museval.TrackStore(track_name=task.name, win=1.0, hop=1.0)
    for i, source in enumerate(task.sources):
        store.add_target(target_name=source, values={
            "SDR": sdr[i].tolist(), "SIR": sir[i].tolist(), "ISR": isr[i].tolist(), "SAR": sar[i].tolist()})
    store.validate()  # museval's own JSON schema
    result["museval_json"] = store.json
    return result


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))  # honours cgroup/Slurm CPU sets
    except AttributeError:
        return os.cpu_count() or 1


def museval_peak_bytes(n_src: int, channels: int, samples: int) -> int:
    """Peak memory of one worker scoring one track (fitted to measurements of museval 0.4.1, 4
    stereo stems, 44.1 kHz: 12 s -> 0.77 GiB, 24 s -> 0.98 GiB). museval holds the FFTs of all
    references at the next power of two above the track (complex128, ~1.75 copies live) and solves
    a (n_src*C*512)^2 system (~3 float64 copies); plus the task's float32 arrays and imports."""
    n_fft = 2 ** math.ceil(math.log2(samples + 511))
    system = 3 * (n_src * channels * 512) ** 2 * 8
    spectra = 1.75 * n_src * channels * n_fft * 16
    task = (2 * n_src + 1) * channels * samples * 4
    return int(200 * 2**20 + system + spectra + task)


def resolve_workers(configured: int, tracks: int, peak_bytes: int | None = None,
                    available_bytes: int | None = None) -> int:
    """cfg evaluate.workers (0 = automatic), never more than there are tracks. Automatic is one per
    available core, but no more than fit in 80% of the available memory when each needs
    `peak_bytes` (museval needs GBs per worker for full-length 44.1 kHz tracks)."""
    if configured:
        return max(1, min(configured, tracks))
    workers = min(available_cores(), tracks)
    if peak_bytes:
        if available_bytes is None:
            import psutil

            available_bytes = psutil.virtual_memory().available
        workers = min(workers, int(0.8 * available_bytes) // peak_bytes)
    return max(1, workers)


@contextlib.contextmanager
def single_threaded_blas() -> Iterator[None]:
    """Make spawned children start with 1 BLAS/OpenMP thread each (unless the user set it), while
    this process keeps its torch thread count."""
    saved = {name: os.environ.get(name) for name in BLAS_THREAD_VARIABLES}
    torch = sys.modules.get("torch")  # loaded when this process separates; read before env changes
    torch_threads = torch.get_num_threads() if torch is not None else None
    for name in BLAS_THREAD_VARIABLES:
        os.environ.setdefault(name, "1")
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        if torch is not None:
            torch.set_num_threads(torch_threads)


def score_tracks(tasks: Iterable[TrackTask], workers: int,
                 on_result: Callable[[dict], None] | None = None) -> list[dict]:
    """Score tasks (a generator is fine: separation of the next track overlaps with scoring).

    workers <= 1 scores in this process. Otherwise at most one separated track waits beyond those
    being scored, so memory stays bounded on long test sets. Results come back in the
    order of the tasks; `on_result` is called as each finishes (for a progress bar).
    """
    results: dict[int, dict] = {}
    if workers <= 1:
        for index, task in enumerate(tasks):
            results[index] = score_track(task)
            if on_result:
                on_result(results[index])
        return [results[i] for i in sorted(results)]

    import multiprocessing

    with single_threaded_blas(), ProcessPoolExecutor(
            max_workers=workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        pending: dict[Future, int] = {}

        def collect(block_until_below: int) -> None:
            while len(pending) >= block_until_below and pending:
                done, _ = wait(pending, return_when=FIRST_COMPLETED)
                for future in done:
                    index = pending.pop(future)
                    results[index] = future.result()
                    if on_result:
                        on_result(results[index])

        for index, task in enumerate(tasks):
            collect(block_until_below=workers + 1)
            pending[pool.submit(score_track, task)] = index
        collect(block_until_below=1)
    return [results[i] for i in sorted(results)]


# ---------------------------------------------------------------------------------------------
# Aggregation (museval's EvalStore) and the scores.json record
# ---------------------------------------------------------------------------------------------
# scores.json key -> metric name in museval's long table (the last three are ours, same medians)
METRIC_NAMES = {"si_sdr": "SI-SDR", "sdr": "SDR", "sir": "SIR", "isr": "ISR", "sar": "SAR",
                "si_sdr_mixture": "SI-SDR_MIXTURE", "sdr_mixture": "SDR_MIXTURE"}


def _whole_track_rows(track: str, whole_track: dict[str, dict], sources: list[str]):
    """SI-SDR over the whole track as one 'frame' per stem (not quantised: it is not a museval
    metric), so its median over tracks is the EvalStore's too."""
    import pandas as pd

    return pd.DataFrame([{"time": 0.0, "target": source, "metric": METRIC_NAMES[key], "score": value,
                          "track": track}
                         for source in sources for key, value in whole_track[source].items()])


def aggregate_scores(results: list[dict], whole_track: dict[str, dict], sources: list[str]) -> dict:
    """per_track, per_stem and overall scores of a tier's test tracks.

    results: score_track() outputs in track order; whole_track: {track: {stem: {"si_sdr",
    "si_sdr_mixture"}}} (dB, NaN when undefined). Per track and stem: the median over valid frames
    (`frames` counts all 1 s frames, `valid_frames` those whose SDR is a number: museval marks a
    frame NaN when any reference or estimate is silent in it). Per stem: the median over tracks;
    overall: the mean over stems of the per-stem medians (undefined if any stem is), as papers
    report "avg". NaN means undefined (written as null)."""
    import museval
    import pandas as pd
    import simplejson

    tables, frame_counts = [], {}
    for result in results:
        name, mixture_sdr = result["name"], result["sdr_mixture_frames"]      # [n, frames]
        frame_counts[name] = mixture_sdr.shape[1]
        if result["museval_json"] is not None:
            tables.append(museval.aggregate.json2df(simplejson.loads(result["museval_json"], allow_nan=True),
                                                    name))
        tables.append(metrics.stored_frames(name, dict(zip(sources, mixture_sdr)), METRIC_NAMES["sdr_mixture"]))
        tables.append(_whole_track_rows(name, whole_track[name], sources))
    store = museval.EvalStore(frames_agg="median", tracks_agg="median")
    store.add_track(pd.concat(tables, ignore_index=True))
    by_track = store.agg_frames_scores()               # (track, target, metric) -> median
    by_stem = store.agg_frames_tracks_scores()         # (target, metric) -> median of the above
    sdr = store.df[store.df.metric == "SDR"]
    valid = sdr.groupby(["track", "target"])["score"].count()   # count() skips NaN

    per_track = {}
    for result in results:
        name = result["name"]
        per_track[name] = {
            source: {**{key: float(by_track.get((name, source, metric), math.nan))
                        for key, metric in METRIC_NAMES.items()},
                     "frames": int(frame_counts[name]), "valid_frames": int(valid.get((name, source), 0))}
            for source in sources}
    per_stem = {}
    for source in sources:
        stem = {key: float(by_stem.get((source, metric), math.nan)) for key, metric in METRIC_NAMES.items()}
        stem["si_sdr_improvement"] = stem["si_sdr"] - stem["si_sdr_mixture"]
        stem["sdr_improvement"] = stem["sdr"] - stem["sdr_mixture"]
        per_stem[source] = stem
    overall = {key: float(np.mean([per_stem[s][key] for s in sources])) for key in per_stem[sources[0]]}
    return {"per_track": per_track, "per_stem": per_stem, "overall": overall}


def write_scores(path: str | Path, scores: dict) -> None:
    """Write scores.json atomically once it follows workflow/schemas/records/scores.schema.yaml."""
    from tiersep.io import write_json
    from tiersep.records import validate_record

    validate_record("scores", scores, path)
    write_json(path, scores)
