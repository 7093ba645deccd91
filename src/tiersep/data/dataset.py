"""Training segments streamed from a prepared folder, with Open-Unmix / Demucs augmentations.

Every segment is a pure function of (seed, step, index in batch): its random generator is seeded
with exactly that triple. So a resumed run sees the same batches, and the content does not depend
on how many worker processes fetch them. Nothing is cached: each segment is read with soundfile
partial reads (seek + read of the segment only), so memory stays flat over steps.

Augmentations (preset `train.augment`):
- remix: each stem from an independently drawn track and offset (tracks weighted by length);
- gain: each stem scaled by a factor drawn from [gain_min, gain_max];
- channel_swap: each stem's left/right swapped with probability 1/2;
- silence rejection: a segment whose mixture RMS is below silence_db dBFS is drawn again (at most
  MAX_DRAWS times; the last draw is kept);
and the mixture is the sum of the augmented stems.
"""
from __future__ import annotations

import contextlib
import itertools
import os
import re
import signal
import threading
import time
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from tiersep.data.errors import DataError
from tiersep.data.tracks import (BASE_STEMS, DERIVED_STEMS, check_sources, read_stem, track_names,
                                 track_samples)

MAX_DRAWS = 10  # silence rejection gives up after this many draws (a silent track must not hang)
VALID_STREAM = 0x5A11D  # seeds validation segments apart from training steps


def rms_db(audio: np.ndarray) -> float:
    return float(10.0 * np.log10(np.mean(np.square(audio, dtype=np.float64)) + 1e-20))


class SegmentDataset:
    """Random training segments of one split.

    batch(step, batch_size) -> (mixture Tensor[B, C, S], stems Tensor[B, n_src, C, S]), float32.
    augment: the preset's train.augment dict; None = no augmentation (one track and offset for all
    stems, unit gain, no swap, no silence rejection).
    """

    def __init__(self, prepared_dir, split: str, sources, segment_samples: int, seed: int,
                 augment: dict | None = None):
        self.prepared_dir = str(prepared_dir)
        self.split = split
        self.sources = list(sources)
        check_sources(self.sources)
        self.segment_samples = int(segment_samples)
        self.seed = int(seed)
        self.augment = dict(augment) if augment else None
        lengths = track_samples(self.prepared_dir, split)
        self.names = track_names(self.prepared_dir, split)
        if not self.names:
            raise DataError(f"{Path(self.prepared_dir) / 'manifest.json'}: split {split} has no tracks")
        self.lengths = np.array([lengths[n] for n in self.names], dtype=np.int64)
        self.weights = self.lengths / self.lengths.sum()

    def __repr__(self) -> str:
        return (f"SegmentDataset({self.prepared_dir!r}, {self.split!r}, {len(self.names)} tracks, "
                f"{self.segment_samples} samples, seed {self.seed}, augment={self.augment})")

    def _draw_position(self, rng: np.random.Generator) -> tuple[int, int]:
        """(track index, offset): tracks weighted by length, offset uniform within the track."""
        track = int(rng.choice(len(self.names), p=self.weights))
        offset = int(rng.integers(0, max(1, self.lengths[track] - self.segment_samples + 1)))
        return track, offset

    def _read(self, track: int, stem: str, offset: int) -> np.ndarray:
        return read_stem(self.prepared_dir, self.split, self.names[track], stem, offset, self.segment_samples)

    def segment(self, step: int, index: int, with_plan: bool = False):
        """Segment `index` of batch `step`: (mixture float32 [C, S], stems float32 [n_src, C, S]),
        plus, with_plan=True, what was drawn: {"draws": n, "stems": [{stem, track, offset, gain, swap}]}."""
        rng = np.random.default_rng([self.seed, int(step), int(index)])
        aug = self.augment
        for draw in range(MAX_DRAWS if aug else 1):
            parts, plan = {}, []
            shared = self._draw_position(rng)
            for stem in BASE_STEMS:
                track, offset = self._draw_position(rng) if aug and aug["remix"] else shared
                gain = float(rng.uniform(aug["gain_min"], aug["gain_max"])) if aug else 1.0
                swap = bool(aug and aug["channel_swap"] and rng.random() < 0.5)
                audio = self._read(track, stem, offset)  # [C, S]
                if gain != 1.0:
                    audio *= np.float32(gain)
                if swap:
                    audio = np.ascontiguousarray(audio[::-1])
                parts[stem] = audio
                plan.append({"stem": stem, "track": self.names[track], "offset": offset, "gain": gain, "swap": swap})
            mixture = sum(parts[s] for s in BASE_STEMS)  # [C, S]
            if not aug or rms_db(mixture) >= aug["silence_db"]:
                break
        for name, members in DERIVED_STEMS.items():
            parts[name] = sum(parts[s] for s in members)
        stems = np.stack([parts[s] for s in self.sources])
        if with_plan:
            return mixture, stems, {"draws": draw + 1, "stems": plan}
        return mixture, stems

    def batch(self, step: int, batch_size: int, indices=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Segments 0..batch_size-1 of step `step`, or the given segment `indices` of it (a rank's
        share of the step's global batch: rank_segments)."""
        items = [self.segment(step, i) for i in (range(batch_size) if indices is None else indices)]
        mixture = torch.from_numpy(np.stack([m for m, _ in items]))  # [B, C, S]
        stems = torch.from_numpy(np.stack([s for _, s in items]))  # [B, n_src, C, S]
        return mixture, stems


def rank_segments(micro_batch: int, grad_accum: int, rank: int, ranks: int) -> list[int]:
    """The segment indices of one step that `rank` of `ranks` trains on, micro-batch after
    micro-batch. The step's global batch is ranks x micro_batch x grad_accum segments; global
    micro-batch j is segments [j*ranks*m, (j+1)*ranks*m) and rank r takes its r-th slice of m. So the
    ranks' micro-batch j together is micro-batch j of one process with micro-batch ranks*m: the same
    segments in the same order whatever the world size (data-parallel tiers, docs/training.md)."""
    width = ranks * micro_batch
    return [j * width + rank * micro_batch + k for j in range(grad_accum) for k in range(micro_batch)]


class _StepBatches(torch.utils.data.Dataset):
    """Map-style view for torch's DataLoader: item `step` is the whole batch of that step (or this
    rank's share of it: `indices`)."""

    def __init__(self, dataset: SegmentDataset, batch_size: int, indices=None):
        self.dataset, self.batch_size, self.indices = dataset, batch_size, indices

    def __getitem__(self, step: int):
        return (step, *self.dataset.batch(step, self.batch_size, self.indices))


class _Steps(torch.utils.data.Sampler):
    def __init__(self, start: int, stop: int | None):
        self.start, self.stop = start, stop

    def __iter__(self):
        return iter(range(self.start, self.stop)) if self.stop is not None else itertools.count(self.start)


# ---------------------------------------------------------------------------------------------
# Worker processes and signals
# ---------------------------------------------------------------------------------------------
# Snakemake and SLURM stop a job with SIGTERM to its whole process group (Ctrl-C sends SIGINT to the
# foreground group; SLURM's --signal may send SIGUSR1). The main process turns these into "checkpoint
# and exit 75"; a worker that died of them first would make the main process fail instead
# ("DataLoader worker (pid N) is killed by signal: Terminated"). So workers ignore them, except a
# SIGTERM sent by their own main process: that is how torch's DataLoader ends a worker that does not
# stop by itself (and how multiprocessing ends daemonic children at exit).
WORKER_IGNORED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


def ignore_stop_signals(_worker_id: int = 0) -> None:
    """worker_init_fn: leave shutdown to the main process (see WORKER_IGNORED_SIGNALS).

    The signals stay blocked in every thread of the worker (they were blocked when it was forked,
    see make_loader; blocked again here for start methods that do not fork); one thread takes them
    with sigwaitinfo, which tells who sent each: a SIGTERM from the parent ends the worker at once,
    as torch's own worker handler does, anything else is dropped."""
    signal.pthread_sigmask(signal.SIG_BLOCK, WORKER_IGNORED_SIGNALS)
    parent = os.getppid()

    def take_signals() -> None:
        while True:
            info = signal.sigwaitinfo(WORKER_IGNORED_SIGNALS)
            if info.si_signo == signal.SIGTERM and info.si_pid == parent:
                os._exit(0)

    threading.Thread(target=take_signals, name="tiersep-worker-signals", daemon=True).start()


@contextlib.contextmanager
def _stop_signals_blocked():
    """Block the stop signals in this thread while worker processes are forked, so none can arrive
    in a worker before ignore_stop_signals runs there; a signal sent meanwhile to the main process
    stays pending and is delivered to its handler when the block ends."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, WORKER_IGNORED_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _owning(batches: Iterator, restore) -> Iterator:
    """A generator holding the only reference to torch's loader iterator: closing it (the trainer
    does, when its loop ends) drops that iterator, which shuts its workers down right away.
    A worker killed while it handed over a batch surfaces as the hand-over's error (EOFError,
    ConnectionResetError); it is raised as the dead worker's error, from that one.
    `restore`: undoes _report_dead_worker_once when the loader is done."""
    try:
        yield from batches
    except (EOFError, ConnectionError) as err:
        _raise_if_a_worker_died(err)
        raise
    finally:
        restore()


def _raise_if_a_worker_died(cause: BaseException, wait_s: float = 2.0) -> None:
    """torch's own check (what its SIGCHLD handler runs): a RuntimeError naming the dead worker's
    pid and signal, if one of this process's loader workers has died. A killed worker can break
    its connection before the kernel has made it a zombie: ask again for up to `wait_s`."""
    from torch.utils.data._utils.signal_handling import _error_if_any_worker_fails

    deadline = time.monotonic() + wait_s
    while True:
        try:
            _error_if_any_worker_fails()
        except RuntimeError as dead:
            raise dead from cause
        if time.monotonic() >= deadline:
            return
        time.sleep(0.05)


def _report_dead_worker_once():
    """Wrap torch's SIGCHLD handler for one loader. torch's raises "DataLoader worker (pid N) is
    killed by signal" in the main thread, at any bytecode, on every SIGCHLD while a dead worker is
    registered (its iterator lives on in the traceback), so a second one, from the other workers
    exiting, landed while the first was handled (3 runs in 6, tests/test_data_dataset.py) and
    could lose failure.json. The first goes through; once it has, the wrapper stays and drops the
    rest. Returns what puts torch's handler back when the loader is done (a no-op off the main
    thread)."""
    current = signal.getsignal(signal.SIGCHLD)
    torch_handler = getattr(current, "torch_handler", current)   # never wrap an earlier loader's wrapper
    if not callable(torch_handler):
        return lambda: None
    raised = False

    def once(signum, frame):
        nonlocal raised
        if raised:
            return
        try:
            torch_handler(signum, frame)
        except RuntimeError:
            raised = True
            raise

    once.torch_handler = torch_handler
    try:
        signal.signal(signal.SIGCHLD, once)
    except ValueError:       # not the main thread: torch's handler stays as it is
        return lambda: None

    def restore():
        if not raised and signal.getsignal(signal.SIGCHLD) is once:
            signal.signal(signal.SIGCHLD, torch_handler)
    return restore


# torch's messages for a worker that died: "DataLoader worker (pid 123) is killed by signal: Killed. ",
# "DataLoader worker (pid(s) 123, 456) exited unexpectedly", "... exited unexpectedly with exit code 1".
_DEAD_WORKER = re.compile(r"DataLoader worker \(pid(?:\(s\))? ([\d, ]+)\) (?:is killed by signal: ([^.]+)\."
                          r"|exited unexpectedly(?: with exit code (-?\d+))?)")
_SIGNAL_BY_DESCRIPTION = {signal.strsignal(s): s.name for s in signal.Signals if signal.strsignal(s)}


def dead_worker(err: BaseException | str) -> dict | None:
    """The DataLoader worker that died under this error: {"pids": [...], "signal": "SIGKILL" or None,
    "exit_code": int or None}, or None when the error is not about a dead worker. Follows the
    exception's causes: torch raises "exited unexpectedly" from the error that names the signal."""
    messages, seen = [], set()
    while isinstance(err, BaseException) and id(err) not in seen:
        seen.add(id(err))
        messages.append(str(err))
        err = err.__cause__ or err.__context__
    if isinstance(err, str):
        messages.append(err)
    found = None
    for message in messages:
        for match in _DEAD_WORKER.finditer(message):
            pids = [int(p) for p in re.findall(r"\d+", match.group(1))]
            if found is None:
                found = {"pids": pids, "signal": None, "exit_code": None}
            found["pids"] += [p for p in pids if p not in found["pids"]]
            if match.group(2):
                description = match.group(2).strip()
                found["signal"] = found["signal"] or _SIGNAL_BY_DESCRIPTION.get(description, description)
            if match.group(3):
                found["exit_code"] = int(match.group(3))
    return found


def make_loader(dataset: SegmentDataset, batch_size: int, num_workers: int, start_step: int = 0,
                stop_step: int | None = None, indices=None) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """Yield (step, mixture[B, C, S], stems[B, n_src, C, S]) for start_step, start_step + 1, ...
    (up to stop_step, exclusive, or forever), in order; the same content whatever num_workers is.
    `indices`: only these segments of every step (a data-parallel rank's share, rank_segments).
    Workers (processes) prefetch the next batches while the caller trains; they ignore SIGTERM,
    SIGINT and SIGUSR1 (ignore_stop_signals). Close the returned generator to stop them."""
    if num_workers <= 0:
        steps = range(start_step, stop_step) if stop_step is not None else itertools.count(start_step)
        return ((step, *dataset.batch(step, batch_size, indices)) for step in steps)
    loader = torch.utils.data.DataLoader(
        _StepBatches(dataset, batch_size, indices), batch_size=None, sampler=_Steps(start_step, stop_step),
        num_workers=num_workers, prefetch_factor=2, persistent_workers=False,
        worker_init_fn=ignore_stop_signals,
        # its own generator: creating the loader must not consume the global torch RNG (the
        # trainer's dropout draws would differ between a fresh and a resumed run)
        generator=torch.Generator().manual_seed(dataset.seed))
    with _stop_signals_blocked():
        batches = iter(loader)  # forks the workers; torch installs its SIGCHLD handler
        restore = _report_dead_worker_once()
    return _owning(batches, restore)


def validation_segments(prepared_dir, sources, segment_samples: int, count: int, seed: int,
                        silence_db: float = -60.0) -> tuple[torch.Tensor, torch.Tensor]:
    """`count` fixed, un-augmented segments of the valid split, taken in turn from its tracks:
    (mixture Tensor[N, C, S] from mixture.wav, stems Tensor[N, n_src, C, S]). Offsets are drawn
    from `seed`, preferring one where every requested stem is above `silence_db` (a silent
    reference makes SI-SDR meaningless); after MAX_DRAWS, the draw whose quietest stem is loudest."""
    sources = list(sources)
    check_sources(sources)
    lengths = track_samples(prepared_dir, "valid")
    names = track_names(prepared_dir, "valid")
    if not names:
        raise DataError(f"{Path(prepared_dir) / 'manifest.json'}: split valid has no tracks")
    mixtures, targets = [], []
    for i in range(count):
        name = names[i % len(names)]
        rng = np.random.default_rng([int(seed), VALID_STREAM, i])
        best, best_level = None, -np.inf
        for _draw in range(MAX_DRAWS):
            offset = int(rng.integers(0, max(1, lengths[name] - segment_samples + 1)))
            stems = np.stack([read_stem(prepared_dir, "valid", name, s, offset, segment_samples) for s in sources])
            level = min(rms_db(s) for s in stems)
            if level > best_level:
                best, best_level = (offset, stems), level
            if level >= silence_db:
                break
        offset, stems = best
        mixtures.append(read_stem(prepared_dir, "valid", name, "mixture", offset, segment_samples))
        targets.append(stems)
    return torch.from_numpy(np.stack(mixtures)), torch.from_numpy(np.stack(targets))
