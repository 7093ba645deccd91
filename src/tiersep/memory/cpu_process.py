"""What a CPU training process occupies beyond the live tensors the trace counts.

On a CPU the estimate's peak_bytes is the peak of live tensor bytes; the process's resident set
adds the Python/torch baseline, malloc's cached free blocks and per-thread arenas, autograd's
bookkeeping and the validation/export work after the last step. The fit gate books this module's
prediction of the whole train process's peak RSS.
"""
from __future__ import annotations

MIB = 2**20
# Measured RSS growth was 1.06-1.17x the live bytes plus up to ~400 MiB
# (bench/results/estimator_accuracy_cpu.md): book 1.35x the live peak plus 256 MiB for the process.
RSS_FACTOR = 1.35
BASE_BYTES = 256 * MIB


def booking(record: dict, preset: dict) -> dict:
    """The predicted peak RSS of a `tiersep train` process for this CPU estimate, with its parts."""
    live = int(record["peak_bytes"])
    return {"rss_bytes": int(live * RSS_FACTOR + BASE_BYTES), "live_bytes": live,
            "model": f"{RSS_FACTOR} x live tensor bytes + {BASE_BYTES // MIB} MiB"}


def live_budget(budget_bytes: int, safety_margin: float) -> int:
    """The live-tensor budget that books to `budget_bytes` (what `fit` searches against on CPU)."""
    return int((budget_bytes * (1 - safety_margin) - BASE_BYTES) / RSS_FACTOR / (1 - safety_margin))
