"""Estimate beside measurement: which numbers of a trained tier may be compared, and what each means.

Only an estimate made for the device the tier trained on is compared (estimate `device` ==
run.json `device_type`). The estimate is the one the train job's fit gate used (run.json
`estimate`: the gate makes its own when results/vram/<tier>.json was made for another device), else
results/vram/<tier>.json. Error = estimate / measured - 1 (negative: the estimate was too low).

cuda  device use: estimate peak_bytes (allocator reserved peak + CUDA context) vs run.json
      peak_device_bytes (total - free) - the headline; allocated: allocated_peak_bytes vs
      peak_allocated_bytes (max_memory_allocated); reserved: reserved_peak_bytes vs
      peak_reserved_bytes (max_memory_reserved).
cpu   process RSS: the gate's booking before exit (cpu_process.run_rss_bytes: the booked process
      without the library pages touched only at interpreter exit, which a run's own VmHWM cannot
      see; older estimates: gate_required_bytes) vs peak_rss_bytes - the headline;
      live tensors: peak_bytes vs peak_allocated_bytes (tensor bytes the trainer counted).
"""
from __future__ import annotations

from dataclasses import dataclass

from tiersep.report.collect import Tier, device_type

MIB = 2**20
# A start with this much less free memory than the run's best start is flagged (another process,
# or a leftover CUDA context, held memory): 2% of the best start or 256 MiB, whichever is smaller.
START_SHORTFALL_FRACTION = 0.02
START_SHORTFALL_BYTES = 256 * MIB


@dataclass
class Comparison:
    quantity: str     # what is compared, e.g. "device use"
    estimated_as: str  # the estimate field and what it counts
    measured_as: str  # the run.json field and what it counts
    estimated: float | None
    measured: float | None

    @property
    def error(self) -> float | None:
        if self.estimated is None or not self.measured:
            return None
        return self.estimated / self.measured - 1


def _bytes(record: dict | None, key: str) -> float | None:
    value = (record or {}).get(key)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def comparable_estimate(tier: Tier) -> tuple[dict | None, str]:
    """(the estimate made for the device the tier trained on, where it came from), or (None, '')."""
    measured = tier.measured_device_type
    gate = (tier.run or {}).get("estimate")
    if isinstance(gate, dict) and device_type(gate.get("device")) == measured:
        return gate, "train job's fit gate (run.json)"
    if tier.estimate is not None and device_type(tier.estimate.get("device")) == measured:
        return tier.estimate, f"results/vram/{tier.name}.json"
    return None, ""


def not_comparable(tier: Tier) -> str | None:
    """'not comparable (estimated for cuda, trained on cpu)' when the tier trained but no estimate
    was made for its device; None otherwise."""
    if tier.run is None or comparable_estimate(tier)[0] is not None:
        return None
    made_for = {device_type(r.get("device")) for r in (tier.estimate, (tier.run or {}).get("estimate"))
                if isinstance(r, dict) and r.get("device")}
    if not made_for:
        return "no estimate"
    return f"not comparable (estimated for {', '.join(sorted(made_for))}, trained on {tier.measured_device_type})"


def cpu_rss_and_live(run: dict) -> tuple[float | None, float | None]:
    """(peak RSS, peak live tensor bytes) of a CPU run. Records from before peak_rss_bytes hold
    the RSS in peak_allocated_bytes and peak_reserved_bytes; a peak_allocated_bytes equal to the
    RSS is the RSS again (the trainer counted no tensors), not a tensor count."""
    rss = _bytes(run, "peak_rss_bytes")
    if rss is None:
        rss = _bytes(run, "peak_reserved_bytes")
    live = _bytes(run, "peak_allocated_bytes")
    return rss, (None if live == rss else live)


def comparisons(tier: Tier) -> list[Comparison]:
    """The estimate-vs-measurement rows of a trained tier, headline first; [] when there is nothing
    to compare (not trained, or no estimate for its device)."""
    estimate, _source = comparable_estimate(tier)
    if tier.run is None or estimate is None:
        return []
    run = tier.run
    if tier.measured_device_type == "cuda":
        return [
            Comparison("device use", "peak_bytes: allocator reserved peak + CUDA context",
                       "peak_device_bytes: device total - free", _bytes(estimate, "peak_bytes"),
                       _bytes(run, "peak_device_bytes")),
            Comparison("allocated", "allocated_peak_bytes: live tensors",
                       "peak_allocated_bytes: max_memory_allocated", _bytes(estimate, "allocated_peak_bytes"),
                       _bytes(run, "peak_allocated_bytes")),
            Comparison("reserved", "reserved_peak_bytes: caching allocator",
                       "peak_reserved_bytes: max_memory_reserved", _bytes(estimate, "reserved_peak_bytes"),
                       _bytes(run, "peak_reserved_bytes")),
        ]
    rss, live = cpu_rss_and_live(run)
    booked = estimate.get("cpu_process") or {}
    if booked.get("run_rss_bytes") is not None:   # the booking less the pages touched at exit
        predicted = ("cpu_process.run_rss_bytes: the gate's booking before exit", _bytes(booked, "run_rss_bytes"))
    else:                                          # estimates from before run_rss_bytes
        predicted = ("gate_required_bytes: what the fit gate books for the process",
                     _bytes(estimate, "gate_required_bytes"))
    return [
        Comparison("process RSS", predicted[0], "peak_rss_bytes: peak resident set size before exit",
                   predicted[1], rss),
        Comparison("live tensors", "peak_bytes: live tensor bytes",
                   "peak_allocated_bytes: live tensor bytes counted by the trainer",
                   _bytes(estimate, "peak_bytes"), live),
    ]


def headline(tier: Tier) -> Comparison | None:
    rows = comparisons(tier)
    return rows[0] if rows else None


def start_shortfalls(tiers: list[Tier]) -> dict[str, float]:
    """{tier: bytes} for every trained tier that started with noticeably less free memory than the
    best start among tiers run on the same host and kind of device (see START_SHORTFALL_*)."""
    groups: dict[tuple, list[tuple[str, float]]] = {}
    for tier in tiers:
        record = tier.run or tier.failure or {}
        free = _bytes(record, "start_free_bytes")
        if free is not None:
            groups.setdefault((record.get("host"), tier.measured_device_type), []).append((tier.name, free))
    flagged = {}
    for starts in groups.values():
        best = max(free for _name, free in starts)
        limit = min(START_SHORTFALL_FRACTION * best, START_SHORTFALL_BYTES)
        flagged.update({name: best - free for name, free in starts if best - free > limit})
    return flagged


def measured_peak(tier: Tier) -> tuple[float | None, str]:
    """(the tier's headline measurement, what it is): CUDA device use (older records: reserved),
    CPU peak RSS; from run.json, or from memory.csv while the run has none yet."""
    cuda = tier.measured_device_type == "cuda"
    per_rank = (tier.run or {}).get("per_rank")
    if per_rank and isinstance(per_rank, list):
        # a data-parallel tier: its estimate is per rank, so the largest rank's peak is the measurement
        key, what = ("peak_device_bytes", "device use") if cuda else ("peak_rss_bytes", "peak RSS")
        peaks = [_bytes(rank, key) for rank in per_rank if isinstance(rank, dict)]
        if peaks and None not in peaks:
            return max(peaks), f"{what}, largest of {len(peaks)} ranks"
    if tier.run is not None:
        if cuda:
            device = _bytes(tier.run, "peak_device_bytes")
            return (device, "device use") if device is not None else (_bytes(tier.run, "peak_reserved_bytes"),
                                                                       "reserved")
        return cpu_rss_and_live(tier.run)[0], "peak RSS"
    if cuda:  # memory.csv: allocated, reserved, peak (max_memory_allocated), device (total - free)
        column, what = ("device", "device use") if any(r.get("device") for r in tier.memory) else \
            ("reserved", "reserved")
    else:     # memory.csv: allocated = reserved = RSS, peak = the peak RSS so far
        column, what = "peak", "peak RSS"
    values = [row[column] for row in tier.memory if row.get(column) is not None]
    return (max(values) if values else None), what
