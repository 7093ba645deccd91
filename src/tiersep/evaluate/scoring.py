"""museval scoring of separated tracks, serial or in a pool of processes.

museval costs about 1 s of CPU per second of audio (a 4096 x 4096 solve per track for 4 stereo
stems plus FFT projections), so tracks are scored in parallel processes. This module imports only
numpy and museval (no torch) to keep each worker small; workers are spawned (never forked from a
process running torch threads) with single-threaded BLAS so that N workers use N cores.
"""
from __future__ import annotations

import contextlib
import math
import os
import sys
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass
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
