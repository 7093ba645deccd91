"""What a training run records as it goes: metrics.csv, memory.csv, the segment trace (the memory
probes, versions and host facts are tiersep.probe's).

CSV rows are appended and flushed every step, so a killed job keeps everything up to its last step;
on --resume the rows after the checkpoint's step are dropped first, so the continued files have no
duplicate steps.
"""
from __future__ import annotations

import csv
import io
import json
import os
from pathlib import Path

import torch

from tiersep.io import write_text

METRICS_FIELDS = ["step", "time_s", "loss", "lr", "grad_norm", "steps_per_s",
                  "val_loss", "val_sdr", "val_si_sdr",
                  # the EMA weights' validation (train.ema; empty without it)
                  "val_loss_ema", "val_sdr_ema", "val_si_sdr_ema",
                  # fp16's loss scale after the step and the steps skipped so far (empty otherwise)
                  "scale", "skipped"]
MEMORY_FIELDS = ["step", "allocated", "reserved", "peak", "device"]


class CsvLog:
    """An append-only CSV with a fixed header, one row per step, flushed after each row."""

    def __init__(self, path: Path, fields: list[str], keep_until_step: int | None):
        """keep_until_step: None = start a new file; N = keep existing rows with step <= N."""
        self.path, self.fields = Path(path), fields
        kept = self._rows_up_to(keep_until_step) if keep_until_step is not None else []
        # Rewrite atomically (header + kept rows) so a torn last line from a kill disappears.
        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, fieldnames=fields, lineterminator="\n")
        writer.writeheader()
        writer.writerows(kept)
        write_text(self.path, buffer.getvalue())
        self._file = open(self.path, "a", newline="")
        self._writer = csv.DictWriter(self._file, fieldnames=fields, lineterminator="\n")

    def _rows_up_to(self, step: int) -> list[dict]:
        if not self.path.is_file():
            return []
        rows = []
        # errors="replace" and csv.Error: a damaged log (binary garbage, NUL bytes) keeps the rows
        # read before the damage; the rest are rewritten by the resumed run.
        with open(self.path, newline="", errors="replace") as f:
            try:
                for row in csv.DictReader(f):
                    # A row cut short by a kill has missing fields (None) or a non-numeric step.
                    if None in row.values() or None in row or not (row.get("step") or "").isdigit():
                        continue
                    if int(row["step"]) <= step:
                        rows.append({k: row.get(k, "") for k in self.fields})
            except csv.Error:
                pass
        return rows

    def append(self, row: dict) -> None:
        self._writer.writerow({k: _fmt(row.get(k)) for k in self.fields})
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def _fmt(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def column_max(path: Path, column: str) -> int:
    """Largest integer value of one CSV column (0 when the file is missing or empty)."""
    best = 0
    if Path(path).is_file():
        with open(path, newline="") as f:
            for row in csv.DictReader(f):
                value = row.get(column) or ""
                if value.isdigit():
                    best = max(best, int(value))
    return best


# Debugging the data order: with TIERSEP_TRACE_SEGMENTS=FILE every rank appends one JSON line per
# step to FILE: {"step", "rank", "segments": the step's segment indices it trains on, "sums": the sum
# of each segment's mixture}. Two runs that should see the same data (another world size, a resume)
# can then be compared line by line.
TRACE_SEGMENTS_ENV = "TIERSEP_TRACE_SEGMENTS"


class SegmentTrace:
    """The TIERSEP_TRACE_SEGMENTS log of one rank (does nothing when the variable is unset)."""

    def __init__(self, path: str | None, rank: int):
        self.path, self.rank = path, rank

    @classmethod
    def from_env(cls, rank: int) -> "SegmentTrace":
        return cls(os.environ.get(TRACE_SEGMENTS_ENV) or None, rank)

    def write(self, step: int, segments: list[int] | None, mixture: torch.Tensor) -> None:
        """mixture: [B, C, S], this rank's segments of the step in order."""
        if self.path is None:
            return
        indices = list(segments) if segments is not None else list(range(mixture.shape[0]))
        sums = [float(x) for x in mixture.double().sum(dim=(1, 2))]
        line = json.dumps({"step": step, "rank": self.rank, "segments": indices, "sums": sums}) + "\n"
        # one write per line with O_APPEND: the ranks' lines do not interleave
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)
