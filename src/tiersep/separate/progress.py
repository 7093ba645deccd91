"""Progress of one song in `tiersep separate`, by frames written: the work done, not the audio
decoded ahead of it (which ran ahead of the model, so the bar jumped, then stalled).

On a terminal: a tqdm bar in seconds of audio written, with tqdm's estimate of the time left.
Anywhere else (a Snakemake log, a pipe, a file): plain lines with no `\\r` or escape codes, one at
each further PLAIN_STEP of the song (every PLAIN_EVERY_S seconds when its length is unknown), with
the time left from the rate so far.
"""
from __future__ import annotations

import sys
import time

PLAIN_STEP = 0.1
PLAIN_EVERY_S = 30.0


class SongProgress:
    """with SongProgress(label, seconds, rate) as progress: progress.advance(frames) as stems are
    written. `seconds` is the declared duration (None: unknown)."""

    def __init__(self, label: str, seconds: float | None, rate: int, stream=None, tty: bool | None = None):
        self.label, self.total, self.rate = label, seconds, rate
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self.done = 0.0
        self.began = self.last = time.monotonic()
        self.shown = 0.0                   # the share of the song the last plain line showed
        self.bar = None

    def __enter__(self) -> "SongProgress":
        if self.tty:
            from tqdm import tqdm

            self.bar = tqdm(total=self.total, desc=self.label[:40], unit="s", leave=False, file=self.stream,
                            bar_format="{l_bar}{bar}| {n:.1f}/{total:.1f} s written [{elapsed}<{remaining}]")
        return self

    def advance(self, frames: int) -> None:
        seconds = frames / self.rate
        if self.total is not None:     # the declared duration may be a little short of the decoded one
            seconds = max(0.0, min(seconds, self.total - self.done))
        self.done += seconds
        if self.bar is not None:
            self.bar.update(seconds)
            return
        if self.total:
            share = self.done / self.total
            due = share > self.shown and share >= min(1.0, self.shown + PLAIN_STEP) - 1e-9
        else:
            due = time.monotonic() - self.last >= PLAIN_EVERY_S
        if due:
            self.last, self.shown = time.monotonic(), self.done / self.total if self.total else 0.0
            print(self.line(), file=self.stream, flush=True)

    def line(self) -> str:
        elapsed = time.monotonic() - self.began
        if not self.total:
            return f"{self.label}: {self.done:.1f} s written in {elapsed:.0f} s"
        line = (f"{self.label}: {self.done:.1f} of {self.total:.1f} s written ({100 * self.done / self.total:.0f}%) "
                f"in {elapsed:.0f} s")
        if self.done < self.total:
            line += f", about {elapsed * (self.total - self.done) / self.done:.0f} s left"
        return line

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.close()
